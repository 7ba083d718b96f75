"""Per-item evaluation records: one line per validation item per evaluation, agreeing with the means."""

from __future__ import annotations

import json
from statistics import mean

from conftest import TASK, quick_config

from grpolab.rollout.evaluation import prompt_sha256
from grpolab.run.rundir import eval_record_steps, read_metrics
from grpolab.run.trainer import train
from grpolab.tasks import make_task


def records_of(run_dir, step):
    return [json.loads(line) for line in (run_dir / "eval" / f"step_{step:06d}.jsonl").read_text().splitlines()]


def test_every_evaluation_writes_one_record_per_item_that_agrees_with_its_metrics(warm_model_dir, tmp_path):
    cfg = quick_config(warm_model_dir, tmp_path / "run", **{"eval.pass_k": [1, 4], "eval.pass_n": 4})
    train(cfg)
    run_dir = tmp_path / "run"
    assert eval_record_steps(run_dir) == [0, 2]
    task = make_task("arithmetic", **TASK)
    examples = task.validation_examples()
    evals = {r["step"]: r for r in read_metrics(run_dir / "metrics.jsonl") if "val/accuracy" in r}
    for step in (0, 2):
        records = records_of(run_dir, step)
        assert [r["id"] for r in records] == [e.id for e in examples]
        assert [r["gold"] for r in records] == [e.answer for e in examples]
        assert [r["prompt_sha256"] for r in records] == [prompt_sha256(task.prompt(e)) for e in examples]
        metrics = evals[step]
        assert mean(r["correct"] for r in records) == metrics["val/accuracy"]
        assert mean(r["format_ok"] for r in records) == metrics["val/format_rate"]
        assert mean(r["length"] for r in records) == metrics["val/completion_len_mean"]
        assert mean(r["truncated"] for r in records) == metrics["val/truncation_rate"]
        for r in records:  # a record is graded as it reads: correct needs the gold answer extracted
            assert r["correct"] <= r["format_ok"]
            if r["correct"]:
                assert r["extracted"].strip() == r["gold"]
            assert r["pass_n"] == 4 and 0 <= r["pass_correct"] <= 4
        # the unbiased pass@1 from the counts is the fraction correct
        assert abs(mean(r["pass_correct"] / 4 for r in records) - metrics["val/pass@1"]) < 1e-12
