"""DAPO's dynamic sampling keeps the groups with 0 < #correct < G (the paper's condition), on the task's
correctness rather than the shaped RL reward (``algorithm.dynamic_sampling_filter = "reward"`` for that);
a reward model's running moments see the scores of the groups that train, not of every round sampled."""

from __future__ import annotations

import torch
from test_reward_model_run import rm_config

from grpolab.config import load_config
from grpolab.objectives.presets import PRESETS
from grpolab.run.trainer import Trainer
from grpolab.tasks.base import Grade


def graded(answers: list[float], shaping: list[float]) -> list[Grade]:
    return [Grade(format_reward=1.0, answer_reward=a).plus("overlong_penalty", p) for a, p in zip(answers, shaping)]


GROUPS = [
    graded([1, 1, 1, 1], [0, -0.25, 0, 0]),  # all correct, lengths differ: uninformative on correctness
    graded([1, 0, 0, 0], [-1, 0, 0, 0]),  # one correct but overlong: totals all 0
    graded([0, 0, 0, 0], [0, 0, 0, 0]),  # all wrong
    graded([1, 0, 1, 0], [0, 0, 0, -0.5]),  # mixed
]


def test_the_default_filter_is_correctness_and_the_total_reward_is_an_option():
    from grpolab.rollout.collect import kept_groups

    assert PRESETS["dapo"].dynamic_sampling_filter == "correct"
    assert kept_groups(GROUPS, "correct").tolist() == [False, True, False, True]
    assert kept_groups(GROUPS, "reward").tolist() == [True, False, False, True]
    assert (
        load_config(
            None, {"algo": "dapo", "algorithm.dynamic_sampling_filter": "reward"}
        ).algorithm.dynamic_sampling_filter
        == "reward"
    )


def test_running_moments_see_only_the_groups_that_train(warm_model_dir, reward_model_dir, tmp_path):
    """Two new tokens hold no answer: every group is all wrong, so the correctness filter resamples every round
    and tops the batch up with dropped groups; the reward model's running moments count exactly the
    batch's B x G scores (were every round's: 4 x 32), with their float64 mean."""
    overrides = {"algorithm.name": "dapo", "rollout.max_new_tokens": 2, "steps": 1}
    trainer = Trainer(rm_config(warm_model_dir, reward_model_dir, tmp_path / "run", tmp_path, **overrides))
    try:
        batch = trainer.parts.collector.collect(1)
        moments = trainer.parts.collector.reward_models.moments["rm"]
    finally:
        trainer.close()
    assert batch.rounds == PRESETS["dapo"].max_resample_rounds + 1
    raw = torch.tensor([dict(g.components)["rm"] for group in batch.grades for g in group], dtype=torch.float64)
    assert moments.count == 32 and abs(moments.mean - raw.mean().item()) < 1e-12
    # the RL reward carries the normalized term of every sample that trains
    want = ((raw - moments.mean) / (moments.std + 1e-6)).clamp(-3, 3)
    got = torch.tensor([g.reward for group in batch.grades for g in group], dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_the_total_reward_filter_keeps_groups_the_reward_model_separates(warm_model_dir, reward_model_dir, tmp_path):
    overrides = {
        "algorithm.name": "dapo",
        "algorithm.dynamic_sampling_filter": "reward",
        "rollout.max_new_tokens": 2,
        "steps": 1,
    }
    trainer = Trainer(rm_config(warm_model_dir, reward_model_dir, tmp_path / "run", tmp_path, **overrides))
    try:
        batch = trainer.parts.collector.collect(1)
    finally:
        trainer.close()
    # the reward model's scores separate the samples of a group with different completions: the batch fills up
    # with groups of all-wrong answers
    from grpolab.rollout.collect import kept_groups

    assert batch.rounds <= PRESETS["dapo"].max_resample_rounds and kept_groups(batch.grades, "reward").all()
    assert not kept_groups(batch.grades, "correct").any()
