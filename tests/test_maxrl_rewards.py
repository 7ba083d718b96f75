"""MaxRL's advantage (r - mean) / mean is defined for rewards in {0, 1}: with a negative group mean its sign
flips (a penalised sample is reinforced). Rewards that can leave {0, 1} are refused in one line naming
the term: at config time where the settings say so (length shaping, reward models, weights), at run time
on the actual rewards (a user function, a task class)."""

from __future__ import annotations

import json

import pytest
import torch

from grpolab.commands.cli import main
from grpolab.config import ConfigError, load_config
from grpolab.objectives.advantages import group_advantages

EPS = 1e-6


@pytest.mark.parametrize("rewards", [[0.0, -0.5, 0.0, 0.0], [0.1, -0.3, 0.2, -0.1], [0.0, 0.5, 1.0, 1.0]])
def test_maxrl_refuses_rewards_outside_zero_one(rewards):
    # today: [0, -0.5, 0, 0] -> [-1, +3, -1, -1] (the penalised sample reinforced), [0.1, -0.3, 0.2, -0.1] ->
    # [-5, +11, -9, +3]
    with pytest.raises(ValueError, match=r"rewards in \{0, 1\}"):
        group_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0], rewards]), "mean", "mean")


def test_maxrl_on_zero_one_rewards_is_unchanged():
    rewards = [[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]]
    got = group_advantages(torch.tensor(rewards, dtype=torch.float64), "mean", "mean", EPS)
    want = []
    for group in rewards:  # float64 reference: (r - mean) / (mean + eps), 0 when mean = 0 or all equal
        mean = sum(group) / len(group)
        want.append([0.0 if mean == 0 or len(set(group)) == 1 else (r - mean) / (mean + EPS) for r in group])
    assert got.tolist() == want
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
    assert len(str(err.value).splitlines()) == 1 and named in str(err.value) and "{0, 1}" in str(err.value)


DATASET = {"task.name": "dataset", "task.train": "train.jsonl", "task.validation_size": 4, "model.path": "model"}


@pytest.mark.parametrize(
    "rewards,named",
    [
        ([{"function": "numeric"}, {"function": "model:RM", "weight": 0.5}], "task.rewards[1] (model:"),
        ([{"function": "numeric", "weight": 0.5}], "task.rewards[0] (numeric, weight 0.5)"),
        ([{"function": "numeric"}, {"function": "exact", "name": "exact"}], "task.rewards[1] (exact"),
    ],
)
def test_maxrl_with_reward_terms_beyond_zero_one_is_refused_at_config_time(rewards, named, reward_model_dir):
    rewards = [{**r, "function": r["function"].replace("RM", str(reward_model_dir))} for r in rewards]
    with pytest.raises(ConfigError) as err:
        load_config(None, {"algo": "maxrl", **DATASET, "task.rewards": rewards})
    assert len(str(err.value).splitlines()) == 1 and named in str(err.value), str(err.value)


def test_maxrl_keeps_zero_one_reward_settings():
    load_config(None, {"algo": "maxrl"})
    load_config(
        None,
        {
            "algo": "maxrl",
            **DATASET,
            "task.rewards": [{"function": "numeric"}, {"function": "reward_fns:brevity", "weight": 0.0}],
        },
    )
    # a user function's values are known only when it runs: checked on the actual rewards
    load_config(
        None,
        {
            "algo": "maxrl",
            **DATASET,
            "task.rewards": [{"function": "numeric", "weight": 0.0}, {"function": "reward_fns:scaled"}],
        },
    )
    # other algorithms take any reward
    load_config(None, {"algo": "grpo", "reward.truncation_penalty": 0.5})


def test_maxrl_run_refuses_a_user_function_reward_outside_zero_one(tmp_path, warm_model_dir, capsys):
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
    assert "penalty -0.5" in err[0] and "{0, 1}" in err[0], err


@pytest.mark.parametrize(
    "task,named",
    [
        ({"task.name": "openenv", "task.app": "openenv_envs:GuessEnvironment"}, "task.app (openenv_envs:Guess"),
        ({"task.name": "verifiers", "task.environment": "vf_single"}, "task.environment"),
    ],
)
def test_maxrl_refuses_environments_whose_rewards_take_any_value(task, named):
    with pytest.raises(ConfigError) as err:
        load_config(None, {"algo": "maxrl", "model.path": "model", **task})
    assert len(str(err.value).splitlines()) == 1 and named in str(err.value), str(err.value)
