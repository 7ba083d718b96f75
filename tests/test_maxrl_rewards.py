"""MaxRL's advantage (r - mean) / mean is well defined for any rewards >= 0, partial credit included (0 for a group
of mean 0); only a negative group mean flips its sign (a penalised sample reinforced). Negative rewards are refused in
one line naming the term: at config time where the settings say so (length shaping, reward models, negative weights),
at run time on the actual rewards (a user function, a task class, an environment)."""

from __future__ import annotations

import importlib.util
import json
import math

import pytest
import torch
from test_dataset_run import sums_config

from grpolab.commands.cli import main
from grpolab.config import ConfigError, load_config
from grpolab.objectives.advantages import group_advantages
from grpolab.run.trainer import Trainer

EPS = 1e-6


def reference_maxrl(rewards: list[list[float]]) -> list[list[float]]:
    """float64 reference: (r - mean) / (mean + eps), 0 when the group mean is 0 or its rewards are all equal."""
    want = []
    for group in rewards:
        mean = sum(group) / len(group)
        want.append([0.0 if mean == 0 or len(set(group)) == 1 else (r - mean) / (mean + EPS) for r in group])
    return want


@pytest.mark.parametrize("rewards", [[0.0, -0.5, 0.0, 0.0], [0.1, -0.3, 0.2, -0.1], [0.0, 0.5, 1.0, -1e-9]])
def test_maxrl_refuses_negative_rewards(rewards):
    # unguarded: [0, -0.5, 0, 0] -> [-1, +3, -1, -1] (the penalised sample reinforced), [0.1, -0.3, 0.2, -0.1] ->
    # [-5, +11, -9, +3]
    with pytest.raises(ValueError, match=r"rewards >= 0") as err:
        group_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0], rewards], dtype=torch.float64), "mean", "mean")
    assert len(str(err.value).splitlines()) == 1 and "group 1 sample" in str(err.value)


def test_maxrl_on_partial_credit_rewards_matches_the_float64_reference():
    rewards = [
        [0.5, 1.0, 0.0, 0.5],
        [0.25, 0.0, 0.0, 0.0],
        [0.5, 0.5, 0.5, 0.5],
        [0.0, 0.0, 0.0, 0.0],
        [0.3, 0.7, 0.9, 0.1],
        [1.5, 0.5, 0.0, 2.0],  # weighted sums past 1 too
    ]
    got = group_advantages(torch.tensor(rewards, dtype=torch.float64), "mean", "mean", EPS)
    torch.testing.assert_close(got, torch.tensor(reference_maxrl(rewards), dtype=torch.float64), rtol=1e-12, atol=0)
    assert got[0].tolist()[:2] == pytest.approx([0.0, 0.5 / (0.5 + EPS)])  # (1 - 0.5) / 0.5: +1
    assert got[2].eq(0).all() and got[3].eq(0).all()


def test_maxrl_on_zero_one_rewards_is_unchanged():
    rewards = [[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]]
    got = group_advantages(torch.tensor(rewards, dtype=torch.float64), "mean", "mean", EPS)
    assert got.tolist() == reference_maxrl(rewards)
    # other normalizers still take any reward
    assert torch.isfinite(group_advantages(torch.tensor([[0.0, -0.5, 0.0, 0.0]]), "mean", "std")).all()


@pytest.mark.parametrize(
    "overrides,named",
    [
        ({"reward.truncation_penalty": 0.5}, "reward.truncation_penalty"),
        ({"reward.overlong_buffer": 8}, "reward.overlong_buffer"),
        (
            {"algorithm.name": "grpo", "algorithm.normalizer": "mean", "reward.truncation_penalty": 0.1},
            "reward.truncation_penalty",
        ),
    ],
)
def test_maxrl_with_length_shaping_is_refused_at_config_time(overrides, named):
    with pytest.raises(ConfigError) as err:
        load_config(None, {"algo": "maxrl", **overrides})
    assert len(str(err.value).splitlines()) == 1 and named in str(err.value) and "rewards >= 0" in str(err.value)


DATASET = {"task.name": "dataset", "task.train": "train.jsonl", "task.validation_size": 4, "model.path": "model"}


@pytest.mark.parametrize(
    "rewards,named",
    [
        ([{"function": "numeric"}, {"function": "model:RM", "weight": 0.5}], "task.rewards[1] (model:"),
        ([{"function": "numeric", "weight": -0.5}], "task.rewards[0] (numeric, weight -0.5)"),
        ([{"function": "numeric"}, {"function": "reward_fns:brevity", "weight": -1}], "task.rewards[1] (reward_fns:"),
    ],
)
def test_maxrl_with_reward_terms_that_can_be_negative_is_refused_at_config_time(rewards, named, reward_model_dir):
    rewards = [{**r, "function": r["function"].replace("RM", str(reward_model_dir))} for r in rewards]
    with pytest.raises(ConfigError) as err:
        load_config(None, {"algo": "maxrl", **DATASET, "task.rewards": rewards})
    assert len(str(err.value).splitlines()) == 1 and named in str(err.value), str(err.value)
    assert "rewards >= 0" in str(err.value)


def test_maxrl_takes_partial_credit_reward_settings():
    load_config(None, {"algo": "maxrl"})
    for rewards in (
        [{"function": "numeric"}, {"function": "reward_fns:brevity", "weight": 0.0}],
        [{"function": "numeric", "weight": 0.5}],  # a weighted verifier: {0, 0.5}
        [{"function": "numeric"}, {"function": "exact", "name": "exact"}],  # two correct terms add up to 2
        # a user function's values are known only when it runs: checked on the actual rewards
        [{"function": "numeric", "weight": 0.0}, {"function": "reward_fns:scaled"}],
    ):
        load_config(None, {"algo": "maxrl", **DATASET, "task.rewards": rewards})
    if importlib.util.find_spec("reasoning_gym") is not None:  # the [envs] extra
        gym = {"task.name": "reasoning_gym", "task.generators": [{"name": "gcd"}], "task.score_weight": 0.5}
        load_config(None, {"algo": "maxrl", "model.path": "model", **gym})  # partial credit in [0, 1]
    # other algorithms take any reward
    load_config(None, {"algo": "grpo", "reward.truncation_penalty": 0.5})


@pytest.mark.parametrize(
    "rewards,named",
    [
        ([{"function": "numeric", "weight": 0.5}], "task.rewards[0] (numeric, weight 0.5)"),
        ([{"function": "numeric"}, {"function": "exact", "name": "exact"}], "task.rewards[1] (exact"),
    ],
)
def test_bnpo_still_needs_zero_one_rewards(rewards, named):
    # BNPO's group mean is a success probability of binary rewards (its paper's setting): partial credit is refused
    with pytest.raises(ConfigError) as err:
        load_config(None, {"algo": "bnpo", **DATASET, "task.rewards": rewards})
    assert len(str(err.value).splitlines()) == 1 and named in str(err.value) and "{0, 1}" in str(err.value)


def test_maxrl_trains_on_partial_credit_rewards(tmp_path, warm_model_dir):
    """A real rollout of a dataset task with a 0.5 format credit: the learner's advantages are the float64
    reference's on the actual rewards, some of them partial, and an update runs."""
    rewards = [{"function": "numeric", "name": "correct"}, {"function": "reward_fns:format_credit", "name": "format"}]
    cfg = sums_config(tmp_path, warm_model_dir, rewards, algo="maxrl")
    trainer = Trainer(cfg)
    try:
        rollout = trainer.parts.collector.collect(1)
        rewards = [[g.reward for g in group] for group in rollout.grades]
        assert any(r == 0.5 for group in rewards for r in group), rewards  # right format, wrong answer
        _, advantages, _ = trainer.parts.learner.advantages(rollout)
        want = torch.tensor(reference_maxrl(rewards), dtype=torch.float64)
        torch.testing.assert_close(advantages.double(), want, rtol=1e-4, atol=1e-5)
        assert (advantages != 0).any()
        record = trainer.train_step(1)
        assert record["attempted_updates"] == 1 and math.isfinite(record["advantage_std"])
    finally:
        trainer.close()


def test_maxrl_run_refuses_a_negative_user_function_reward(tmp_path, warm_model_dir, capsys):
    rows = [{"problem": f"{a}+{b}", "result": a + b} for a in range(1, 10) for b in range(1, 10)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    rewards = json.dumps(
        [
            {"function": "numeric", "name": "correct", "weight": 0.0},
            {"function": "reward_fns:scaled", "name": "penalty", "options": {"scale": -0.5}},
        ]
    )
    code = main(
        [
            "train",
            "--algo",
            "maxrl",
            "--model",
            str(warm_model_dir),
            "--output_dir",
            str(tmp_path / "run"),
            "--steps",
            "1",
            "--task",
            "dataset",
            "--task.train",
            str(tmp_path / "train.jsonl"),
            "--task.validation_size",
            "8",
            "--task.question_field",
            "problem",
            "--task.answer_field",
            "result",
            "--task.prompt.format",
            "r1_zero",
            "--task.rewards",
            rewards,
            "--rollout.prompts_per_step",
            "8",
            "--rollout.group_size",
            "8",
            "--rollout.max_new_tokens",
            "40",
            "--eval.every",
            "100",
        ]
    )
    err = [line for line in capsys.readouterr().out.splitlines() if line.startswith("error:")]
    assert code == 2 and len(err) == 1, err
    assert "penalty -0.5" in err[0] and "rewards >= 0" in err[0], err


@pytest.mark.parametrize(
    "task,named",
    [
        ({"task.name": "openenv", "task.app": "openenv_envs:GuessEnvironment"}, "task.app (openenv_envs:Guess"),
        ({"task.name": "verifiers", "task.environment": "vf_single"}, "task.environment"),
    ],
)
def test_environments_whose_rewards_take_any_value(task, named):
    # MaxRL: their range is known only when they run (a negative reward is refused then); BNPO: refused up front
    load_config(None, {"algo": "maxrl", "model.path": "model", **task})
    with pytest.raises(ConfigError) as err:
        load_config(None, {"algo": "bnpo", "model.path": "model", **task})
    assert len(str(err.value).splitlines()) == 1 and named in str(err.value), str(err.value)
