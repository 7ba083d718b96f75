"""Short RL runs on tasks from outside the package: a JSONL file and reward functions from a test module,
configured in TOML; a task class by import path whose grader raises."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import torch
from conftest import cli_pairs, quick_settings
from reference_advantage_variants import reference_decoupled_advantages

from grpolab.commands.cli import main
from grpolab.config import load_config
from grpolab.run.trainer import Trainer
from grpolab.tasks import build_task
from grpolab.tasks.stream import PromptStream

CONFIG = """
steps = 2
seed = 3
output_dir = "{out}"

[model]
path = "{model}"

[task]
name = "dataset"
train = "{train}"
validation = "{val}"
question_field = "problem"
answer_field = "result"
n_train = 40

[task.prompt]
format = "r1_zero"

[[task.rewards]]
function = "numeric"
name = "correct"

[[task.rewards]]
function = "reward_fns:brevity"
weight = 0.1

[[task.rewards]]
function = "reward_fns:faulty"
weight = 0.0
timeout_s = 0.3

[reward]
overlong_buffer = 8

[rollout]
prompts_per_step = 4
group_size = 8
max_new_tokens = 40
max_failure_rate = 1.0

[optim]
micro_batch_size = 16
lr = 1e-3

[eval]
every = 2

[checkpoint]
every = 2
"""


def write_problems(path: Path, pairs: list[tuple[int, int]]) -> Path:
    path.write_text("".join(json.dumps({"problem": f"{a}+{b}", "result": a + b}) + "\n" for a, b in pairs))
    return path


def test_rl_run_from_toml_on_a_jsonl_with_user_reward_functions(tmp_path, warm_model_dir):
    rng = random.Random(0)
    pairs = [(a, b) for a in range(1, 10) for b in range(1, 10)]
    rng.shuffle(pairs)
    train, val = (
        write_problems(tmp_path / "train.jsonl", pairs[:60]),
        write_problems(tmp_path / "val.jsonl", pairs[60:76]),
    )
    out = tmp_path / "run"
    config = tmp_path / "run.toml"
    config.write_text(CONFIG.format(out=out, model=warm_model_dir, train=train, val=val))
    assert main(["train", "--config", str(config)]) == 0

    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "reward_mean" in r]
    assert len(steps) == 2
    cfg = load_config(config)
    task = build_task(cfg.task)
    stream = PromptStream(task.train_examples(), cfg.seed)
    for record in steps:
        drawn = stream.take(4)  # the run's prompts, replayed: faulty fails on ids ending in 0-5
        failing = 8 * sum(e.id[-1] in "012345" for e in drawn)
        assert record["reward/faulty_failed"] == record["rollout/failed/reward"] == record["rollout/failed"] == failing
        assert record["reward/correct_failed"] == record["reward/brevity_failed"] == 0
        assert 0 < failing < 32  # the steps below have samples that failed and samples that did not
        # over the samples that did not fail: the first reward is the correctness
        assert record["accuracy"] == record["reward/correct"]
        shaped = record["reward/correct"] + 0.1 * record["reward/brevity"] + record["reward/overlong_penalty"]
        assert abs(record["reward_mean"] - shaped) < 1e-6  # reward_mean is a float32 mean
        assert -1.0 <= record["reward/overlong_penalty"] <= 0.0
    assert 0 < steps[0]["reward/correct"] < 1  # the warm-started model solves some
    items = [json.loads(line) for line in (out / "eval" / "step_000002.jsonl").read_text().splitlines()]
    assert len(items) == 16 and set(items[0]["rewards"]) == {"correct", "brevity", "faulty"}
    assert items[0]["id"] == "validation-0" and items[0]["gold"] == str(sum(pairs[60]))
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["data"]["task"] == "dataset" and manifest["data"]["train_rows"] == 40
    assert manifest["data"]["rewards"][1]["source"].endswith("reward_fns.py")
    assert (out / "checkpoints" / "step_000002").is_dir()


def test_a_task_class_whose_grader_raises_does_not_end_the_run(tmp_path, warm_model_dir):
    out = tmp_path / "run"
    task = {"task.name": "custom_task:CountdownTask", "task.n": 16, "task.raise_on": "'</answer>'"}
    rollout = {"rollout.prompts_per_step": 2, "rollout.group_size": 4, "rollout.max_new_tokens": 24}
    settings = {"steps": 1, **task, **rollout, "optim.micro_batch_size": 8, "rollout.max_failure_rate": 1}
    code = main(["train", "--model", str(warm_model_dir), "--output-dir", str(out), *cli_pairs(settings)])
    assert code == 0
    step = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if "reward_mean" in line][0]
    assert step["reward/grade_failed"] >= 1  # completions with '</answer>' made the user's grader raise
    assert step["rollout/failed/reward"] == step["reward/grade_failed"]  # failed samples, not zeros
    assert json.loads((out / "config.json").read_text())["task"] == {
        "name": "custom_task:CountdownTask",
        "n": 16,
        "raise_on": "</answer>",
    }


def test_malformed_data_is_one_error_line_and_nothing_is_written(tmp_path, warm_model_dir, capsys):
    train = tmp_path / "train.jsonl"
    train.write_text('{"problem": "1+1", "result": 2}\n{"problem": "2+2"}\n')
    out = tmp_path / "run"
    task = {"task.name": "dataset", "task.train": train, "task.validation_size": 1}
    fields = {"task.question_field": "problem", "task.answer_field": "result"}
    code = main(["train", "--model", str(warm_model_dir), "--output-dir", str(out), *cli_pairs({**task, **fields})])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert code == 2 and not out.exists()
    assert [line for line in lines if "error" in line] == [
        f"error: {train}:2: missing field 'result' (fields: problem)"
    ]


def test_the_built_in_task_and_the_same_rows_as_a_dataset_task_train_identically(tmp_path, warm_model_dir):
    """Pair: arithmetic (built in) and its rows written to JSONL, read back by the dataset task with the
    r1_zero prompt and the numeric verifier: same prompts, same grades, so the same numbers."""
    from conftest import TASK, quick_config

    from grpolab.config import validate_config
    from grpolab.run.trainer import train
    from grpolab.tasks import ArithmeticTask

    built_in = ArithmeticTask(**TASK)
    for split, examples in (("train", built_in.train_examples()), ("val", built_in.validation_examples())):
        (tmp_path / f"{split}.jsonl").write_text(
            "".join(json.dumps({"question": e.question, "answer": e.answer}) + "\n" for e in examples)
        )
    train(quick_config(warm_model_dir, tmp_path / "a"))
    cfg = quick_config(warm_model_dir, tmp_path / "b").model_dump(mode="json")
    cfg["task"] = {
        "name": "dataset",
        "train": str(tmp_path / "train.jsonl"),
        "validation": str(tmp_path / "val.jsonl"),
        "rewards": [{"function": "numeric"}],
    }
    train(validate_config(cfg))

    def numbers(run: Path) -> list[dict]:
        return [
            {k: v for k, v in json.loads(line).items() if not k.startswith(("time/", "tokens_per_s", "reward/"))}
            for line in (run / "metrics.jsonl").read_text().splitlines()
        ]

    def items(run: Path) -> list[dict]:
        return [
            {k: v for k, v in json.loads(line).items() if k not in ("id", "rewards")}
            for line in (run / "eval" / "step_000002.jsonl").read_text().splitlines()
        ]

    a, b = numbers(tmp_path / "a"), numbers(tmp_path / "b")
    assert a == b and len(a) == 4  # eval 0, step 1, step 2, eval 2
    assert items(tmp_path / "a") == items(tmp_path / "b")


def test_the_step_line_says_when_samples_failed():
    from grpolab.run.step import vital_signs

    record = {
        "step": 3,
        "reward_mean": 0.5,
        "accuracy": 0.5,
        "advantage_std": 1.0,
        "time/step": 1.0,
        "rollout/failed": 13,
        "rollout/failed/reward": 12,
        "rollout/failed/timeout": 1,
        "rollout/failed/endpoint": 0,
    }
    assert "failed 13 (reward 12, timeout 1)  1.0 s/step" in vital_signs(record, 10, 7.0)
    assert "failed" not in vital_signs({**record, "rollout/failed": 0}, 10, 7.0)


def sums_config(tmp_path, model_dir, rewards: list[dict], **overrides):
    """conftest's quick run on a dataset task of the 81 one-digit sums in a JSONL file (8 held out), r1_zero
    prompts, with ``rewards`` and ``overrides``."""
    rows = [{"problem": f"{a}+{b}", "result": a + b} for a in range(1, 10) for b in range(1, 10)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    quick = {k: v for k, v in quick_settings(model_dir, tmp_path / "run").items() if not k.startswith("task.")}
    task = {"name": "dataset", "train": str(tmp_path / "train.jsonl"), "validation_size": 8}
    task |= {"question_field": "problem", "answer_field": "result", "prompt.format": "r1_zero", "rewards": rewards}
    return load_config(None, {**quick, **{f"task.{k}": v for k, v in task.items()}, **overrides})


def test_gdpo_trains_a_dataset_task_on_its_named_reward_terms(tmp_path, warm_model_dir):
    """A real rollout of a dataset task with two weighted terms and overlong shaping: the learner's advantages are
    the reference's on the grades' own components (the config's term names are the grades')."""
    rewards = [{"function": "numeric", "name": "correct"}, {"function": "reward_fns:brevity", "weight": 0.1}]
    cfg = sums_config(tmp_path, warm_model_dir, rewards, algo="gdpo", **{"reward.overlong_buffer": 8})
    assert cfg.reward_weights() == {"correct": 1.0, "brevity": 0.1, "overlong_penalty": 1.0}
    trainer = Trainer(cfg)
    try:
        rollout = trainer.parts.collector.collect(1)
        terms = [
            [[dict(g.components)[n] for n in ("correct", "brevity", "overlong_penalty")] for g in group]
            for group in rollout.grades
        ]
        want = reference_decoupled_advantages(terms, [1.0, 0.1, 1.0], "std", 1e-6)
        _, advantages, _ = trainer.parts.learner.advantages(rollout)
        torch.testing.assert_close(advantages.double(), torch.tensor(want, dtype=torch.float64), rtol=1e-4, atol=1e-5)
        assert (advantages != 0).any()
        record = trainer.train_step(1)
        assert record["attempted_updates"] == 1 and math.isfinite(record["advantage_std"])
    finally:
        trainer.close()
