"""RL runs whose reward is (partly) a reward model: metrics, evaluation records, exact resume with the
running normalizer, and the scores a run records against the model's own forward."""

from __future__ import annotations

import json
import os
import random

import pytest
import torch
from conftest import run_numbers, train_until
from test_dataset_run import write_problems

from grpolab.commands.cli import main
from grpolab.config import load_config, load_run_config
from grpolab.models.reward_model import RewardModel
from grpolab.run.rundir import read_metrics
from grpolab.run.trainer import train
from grpolab.tasks import build_task
from grpolab.tasks.reward_model_spec import reward_model_spec

STEPS = {"steps": 4, "checkpoint.every": 2, "eval.every": 2, "seed": 3}


def rm_config(model_dir, rm_dir, out, tmp_path, **overrides):
    pairs = [(a, b) for a in range(1, 10) for b in range(1, 10)]
    random.Random(0).shuffle(pairs)
    train_file = write_problems(tmp_path / "train.jsonl", pairs[:60])
    val_file = write_problems(tmp_path / "val.jsonl", pairs[60:72])
    settings = {
        "model.path": str(model_dir),
        "output_dir": str(out),
        "task.name": "dataset",
        "task.train": str(train_file),
        "task.validation": str(val_file),
        "task.question_field": "problem",
        "task.answer_field": "result",
        "task.rewards": [
            {"function": "numeric", "name": "correct", "weight": 0.0},
            {
                "function": f"model:{rm_dir}",
                "name": "rm",
                "weight": 1.0,
                "options": {"normalize": "running", "clip": 3.0, "batch_size": 8},
            },
        ],
        "rollout.prompts_per_step": 4,
        "rollout.group_size": 8,
        "rollout.max_new_tokens": 40,
        "optim.micro_batch_size": 16,
        "optim.lr": 1e-3,
        **STEPS,
        **overrides,
    }
    return load_config(None, settings)


@pytest.fixture(scope="module")
def uninterrupted(warm_model_dir, reward_model_dir, tmp_path_factory):
    base = tmp_path_factory.mktemp("rm_run")
    run = base / "run"
    train(rm_config(warm_model_dir, reward_model_dir, run, base))
    return run


def test_the_reward_model_is_the_rl_reward_and_its_metrics_are_logged(uninterrupted, reward_model_dir):
    records = read_metrics(uninterrupted / "metrics.jsonl")
    steps = [r for r in records if "reward_mean" in r]
    assert len(steps) == 4
    for r in steps:
        assert r["reward_model/rm/mean"] == pytest.approx(r["reward/rm"])
        assert r["reward_model/rm/min"] <= r["reward_model/rm/mean"] <= r["reward_model/rm/max"]
        assert r["reward_model/rm/std"] > 0
        assert "reward/rm_failed" in r and r["reward/rm_failed"] == 0
        assert r["accuracy"] == r["reward/correct"]  # the verifier still measures, with weight 0
        if 0 < r["accuracy"] < 1:
            assert -1 <= r["reward_model/rm/corr_correct"] <= 1
    # running z-scores: the first batch's own moments, so its mean reward is 0 (weight 1, verifier weight 0)
    assert steps[0]["reward_mean"] == pytest.approx(0.0, abs=1e-5)
    assert steps[1]["reward_mean"] != pytest.approx(0.0, abs=1e-5)
    evals = [r for r in records if "val/accuracy" in r]
    assert [r["step"] for r in evals] == [0, 2, 4] and all("val/reward_model/rm/mean" in r for r in evals)


def test_recorded_scores_equal_the_models_own_forward_of_the_rendered_text(uninterrupted, reward_model_dir):
    cfg = load_run_config(uninterrupted)
    task = build_task(cfg.task)
    examples = {e.id: e for e in task.validation_examples()}
    items = [json.loads(line) for line in (uninterrupted / "eval" / "step_000004.jsonl").read_text().splitlines()]
    rm = RewardModel.load(reward_model_spec(f"model:{reward_model_dir}", "rm", 1.0, {}), torch.device("cpu"))
    for item in items[:4]:
        text = task.prompt(examples[item["id"]]) + item["completion"]  # no chat template: concatenated
        inputs = rm.tokenizer(text, return_tensors="pt")
        assert item["rewards"]["rm"] == pytest.approx(rm.model(**inputs).logits[0, 0].item(), abs=1e-5)


def test_resume_with_the_running_normalizer_is_exact(warm_model_dir, reward_model_dir, uninterrupted, tmp_path):
    run = tmp_path / "run"
    train_until(rm_config(warm_model_dir, reward_model_dir, run, tmp_path), stop_at=4)
    saved = torch.load(run / "checkpoints" / "step_000002" / "trainer_state.pt", weights_only=False)
    assert saved["reward_models"]["rm"]["count"] == 2 * 32  # two batches of 4 x 8 scores
    train(load_run_config(run), resume=True)
    assert run_numbers(run) == run_numbers(uninterrupted)


@pytest.mark.slow  # ~30 s (a vLLM engine); default tier: the scores above, test_trainer_vllm.py's run on vLLM
def test_a_reward_model_beside_the_colocated_vllm_engine(warm_model_dir, reward_model_dir, uninterrupted, tmp_path):
    """The engine samples, the reward model scores on the trainer's device; the step-0 greedy evaluation (the
    same weights) gets the same scores for the same completions as the transformers engine's run."""
    pytest.importorskip("vllm")
    run = tmp_path / "run"
    train(rm_config(warm_model_dir, reward_model_dir, run, tmp_path, **{"rollout.engine": "vllm", "steps": 2}))
    steps = [r for r in read_metrics(run / "metrics.jsonl") if "reward_mean" in r]
    assert len(steps) == 2 and all(r["sync/logprob_diff_max"] < 1e-4 and "reward_model/rm/mean" in r for r in steps)

    def scores(folder):
        return {
            (r["id"], r["completion"]): r["rewards"]["rm"]
            for r in map(json.loads, (folder / "eval" / "step_000000.jsonl").read_text().splitlines())
        }

    vllm_scores, hf_scores = scores(run), scores(uninterrupted)
    shared = vllm_scores.keys() & hf_scores.keys()
    assert len(shared) >= 0.9 * len(hf_scores)  # greedy: the same completions but for near-ties
    assert all(vllm_scores[k] == pytest.approx(hf_scores[k], abs=1e-5) for k in shared)


def test_bad_reward_model_config_is_one_line_before_anything_is_written(
    warm_model_dir, reward_model_dir, tmp_path, capsys, tiny_model_dirs
):
    out = tmp_path / "run"
    config = tmp_path / "run.toml"
    base = (
        'output_dir = "{out}"\n[model]\npath = "{model}"\n[task]\nname = "dataset"\ntrain = "{train}"\n'
        'validation_size = 4\nquestion_field = "problem"\nanswer_field = "result"\n'
    )
    write_problems(tmp_path / "train.jsonl", [(1, 2), (3, 4), (5, 6), (7, 8), (2, 2), (3, 3)])
    head = base.format(out=out, model=warm_model_dir, train=tmp_path / "train.jsonl")
    cases = {
        f'[[task.rewards]]\nfunction = "model:{reward_model_dir}"\n': "the first reward is the task's correctness",
        f'[[task.rewards]]\nfunction = "numeric"\n[[task.rewards]]\nfunction = "model:{tiny_model_dirs["llama"]}"\n': "is not a sequence-classification model (architectures: LlamaForCausalLM)",
        f'[[task.rewards]]\nfunction = "numeric"\n[[task.rewards]]\nfunction = "model:{tmp_path}"\n'
        'options = {normalize = "zscore"}\n': "options.normalize: Input should be",
        f'[[task.rewards]]\nfunction = "numeric"\n[[task.rewards]]\nfunction = "model:{reward_model_dir}"\n'
        "options = {max_length = 200}\n": "(380 of its tokens) plus rollout.max_new_tokens 48 exceeds its max_length 200",
    }
    for rewards, message in cases.items():
        config.write_text(head + rewards)
        assert main(["train", "--config", str(config)]) == 2
        errors = [line for line in capsys.readouterr().out.splitlines() if "error" in line]
        assert len(errors) == 1 and message in errors[0], errors
        assert not out.exists()


def test_the_docs_example_parses(reward_model_dir, tmp_path):
    """docs/reward-models.md's TOML example, with its paths pointed at real files, is a valid config."""
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "reward-models.md").read_text()
    example = re.search(r"```toml\n(.*?)```", page, re.S).group(1)
    (tmp_path / "train.jsonl").write_text(
        "".join(
            json.dumps({"question": f"{a}+{b}", "answer": a + b}) + "\n" for a in range(1, 10) for b in range(1, 10)
        )
    )
    example = (
        example.replace("data/train.jsonl", str(tmp_path / "train.jsonl"))
        .replace("models/my-reward-model", str(reward_model_dir))
        .replace("validation_size = 200", "validation_size = 20")
    )
    (tmp_path / "run.toml").write_text(example)
    cfg = load_config(tmp_path / "run.toml", {"model.path": str(reward_model_dir)})
    task = build_task(cfg.task)
    (spec,) = task.reward_models
    assert spec.name == "rm" and spec.options.normalize == "running" and spec.options.truncate == "left"
    assert task.rewards.terms[0].weight == 0.0


@pytest.mark.slow  # about 7 minutes on 2 cores: a warm start, 1500 reward-model steps, three 40-step RL runs
def test_rl_whose_only_reward_is_a_trained_reward_model_raises_the_verifier_accuracy(tmp_path, capsys):
    """The benchmark's recipe at its defaults: a reward model trained on the policy's own samples, then RL on its
    score alone with a KL penalty; the paired CI on the verifier's accuracy excludes 0, and the report has the
    reward-model section."""
    import re
    import sys
    from pathlib import Path

    from rich.console import Console

    from grpolab.common.progress import Reporter
    from grpolab.studies.report import write_report

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import reward_model_learning

    try:
        assert reward_model_learning.main(["--out", str(tmp_path / "bench"), "--threads", "1"]) == 0
    finally:
        torch.set_num_threads(int(os.environ.get("GRPOLAB_TEST_THREADS", "1")))
    out = capsys.readouterr().out
    assert float(re.search(r"within-question AUC (\d\.\d+)", out).group(1)) > 0.65, out
    low = re.search(r"^rm \+ KL\s+\S+\s+\S+\s+\S+ \[([+-]\d\.\d+), ", out, re.M).group(1)
    assert float(low) > 0, out
    run = tmp_path / "bench" / "run_rm_KL"
    write_report(run, Reporter(Console()))
    report = (run / "report" / "report.md").read_text()
    assert "## Reward models" in report and "score by completion length decile" in report
