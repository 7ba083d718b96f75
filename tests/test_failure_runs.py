"""Real runs with failing rewards: a failure is a state, never a zero.

A reward function that fails on about a fifth of the samples: the run trains on the others, its advantages are the
float64 reference's over the valid samples only, every step counts the failures by kind, and the run's last lines
and summary.json say so. One that fails on every call: the run stops before its first update, in one line naming
the kind and the first error, with the resume command, exit 2 (it used to score 0 and end ``done``, exit 0)."""

from __future__ import annotations

import json

import torch
from test_dataset_run import sums_config
from test_failed_samples import reference_batch

from grpolab.commands.cli import main
from grpolab.run.trainer import Trainer


def test_a_run_with_a_fifth_of_its_rewards_failing_trains_on_the_others(tmp_path, warm_model_dir, capsys):
    rewards = [{"function": "reward_fns:flaky", "name": "flaky"}]
    cfg = sums_config(tmp_path, warm_model_dir, rewards, steps=2)
    trainer = Trainer(cfg)
    try:
        rollout = trainer.parts.collector.collect(1)
        valid = [[g.ok for g in group] for group in rollout.grades]
        failed = sum(not v for row in valid for v in row)
        assert 0 < failed < 32 and all(g.failure == "reward" for row in rollout.grades for g in row if not g.ok)
        _, advantages, _ = trainer.parts.learner.advantages(rollout)
        known = [[g.reward for g in group] for group in rollout.grades]
        want = reference_batch(known, valid, "mean", "std")
        torch.testing.assert_close(advantages.double(), torch.tensor(want, dtype=torch.float64), rtol=1e-5, atol=1e-5)
    finally:
        trainer.close()
    code = main(["train", "--config", str(config_file(cfg, tmp_path / "cli.json", tmp_path / "run2"))])
    out = " ".join(capsys.readouterr().out.split())
    assert code == 0, out
    run = tmp_path / "run2"
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if "reward_mean" in line]
    counted = [r["rollout/failed/reward"] for r in steps]
    assert all(r["rollout/failed"] == r["rollout/failed/reward"] == r["reward/flaky_failed"] for r in steps)
    assert sum(counted) > 0 and all(r["rollout/failed/environment"] == 0 for r in steps)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["failed_samples"] == {"reward": sum(counted)}
    assert f"{sum(counted)} sample(s) failed and trained nothing: reward {sum(counted)}" in out
    # the evaluation: a failed item says so, and the accuracy is over the others
    items = [json.loads(line) for line in (run / "eval" / "step_000002.jsonl").read_text().splitlines()]
    failed = [r for r in items if r.get("failed")]
    assert failed and all(r["failed"] == "reward" and "ConnectionError" in r["error"] for r in failed)
    final = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "val/accuracy" in r][-1]
    known = [r["correct"] for r in items if not r.get("failed")]
    assert final["val/failed"] == final["val/failed/reward"] == len(failed)
    assert final["val/accuracy"] == sum(known) / len(known)


def test_a_reward_that_fails_every_call_stops_the_run_in_one_line(tmp_path, warm_model_dir, capsys):
    rewards = [{"function": "numeric", "name": "correct"}, {"function": "reward_fns:always_fails", "weight": 0.5}]
    cfg = sums_config(tmp_path, warm_model_dir, rewards, steps=2)
    run = tmp_path / "run"
    code = main(["train", "--config", str(config_file(cfg, tmp_path / "cli.json", run))])
    out = capsys.readouterr().out
    assert code == 2
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, out
    line = errors[0]
    # the first evaluation fails first (its items are graded by the same function)
    assert "evaluation at step 0: 8 of 8 samples failed (over rollout.max_failure_rate 0.5): 8 reward" in line
    assert "the first reward error: reward 'always_fails': ConnectionError: the grader service is unreachable" in line
    assert line.endswith(f"continue from its last checkpoint with: grpolab train --resume {run}")
    assert not (run / "summary.json").exists()
    assert not (run / "metrics.jsonl").exists() or "reward_mean" not in (run / "metrics.jsonl").read_text()
    # a function failing on the training items only: the first step's rollouts stop the run, before its update
    rewards[1]["function"] = "reward_fns:fails_on_train_items"
    cfg = sums_config(tmp_path, warm_model_dir, rewards, steps=2)
    assert main(["train", "--config", str(config_file(cfg, tmp_path / "cli2.json", tmp_path / "run2"))]) == 2
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("error:")]
    assert "step 1: 32 of 32 samples failed (over rollout.max_failure_rate 0.5): 32 reward" in line
    assert "reward 'fails_on_train_items': ConnectionError: the grader service is unreachable" in line
    assert "reward_mean" not in (tmp_path / "run2" / "metrics.jsonl").read_text()


def config_file(cfg, path, run):
    """``cfg`` as a JSON config file whose run goes to ``run``."""
    path.write_text(json.dumps(cfg.model_copy(update={"output_dir": str(run)}).model_dump(mode="json")))
    return path


def test_an_async_run_whose_rollouts_all_fail_stops_in_one_line_and_leaves_no_engine_process(
    tmp_path, warm_model_dir, capsys
):
    import multiprocessing

    rewards = [{"function": "numeric", "name": "correct"}, {"function": "reward_fns:fails_on_train_items"}]
    cfg = sums_config(
        tmp_path, warm_model_dir, rewards, steps=3, **{"rollout.mode": "async", "rollout.max_staleness": 1}
    )
    run = tmp_path / "run"
    assert main(["train", "--config", str(config_file(cfg, tmp_path / "cli.json", run))]) == 2
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("error:")]
    assert "step 1: 32 of 32 samples failed" in line and line.endswith(f"grpolab train --resume {run}")
    assert multiprocessing.active_children() == []
