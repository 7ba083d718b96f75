"""Exact resume: a run interrupted after step k and resumed from its newest complete checkpoint gives
the metrics and final weights of an uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import TASK, quick_config, quick_run, run_numbers, train_until
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from transformers import AutoModelForCausalLM

from grpolab.commands.cli import main, parse_overrides
from grpolab.config import ConfigError, load_config, load_run_config
from grpolab.run.rundir import read_metrics
from grpolab.run.trainer import Trainer, train

OVERRIDES = {"steps": 4, "checkpoint.every": 2, "eval.every": 2, "reference": "frozen"}


def final_weights(run_dir) -> dict[str, torch.Tensor]:
    return AutoModelForCausalLM.from_pretrained(run_dir / "checkpoints" / "step_000004").state_dict()


@pytest.fixture(scope="module")
def uninterrupted(warm_model_dir, tmp_path_factory):
    return quick_run(tmp_path_factory, warm_model_dir, "full", **OVERRIDES)


def test_a_run_stopped_after_step_3_resumes_from_step_2_with_identical_numbers(warm_model_dir, uninterrupted, tmp_path):
    run = tmp_path / "run"
    cfg = quick_config(warm_model_dir, run, **OVERRIDES, **{"log.tensorboard": True})
    train_until(cfg, stop_at=4)  # after step 3's records, before step 4's
    assert max(r["step"] for r in read_metrics(run / "metrics.jsonl")) == 3
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 4, "reward_m')  # a line torn by the kill
    torn = run / "checkpoints" / ".step_000003-x1y2"  # a checkpoint write the kill interrupted
    torn.mkdir()
    (torn / "model.safetensors").write_bytes(b"\0" * 10)
    (run / "eval" / "step_000004.jsonl").write_text("stale\n")  # as if killed between evaluation and checkpoint

    train(load_run_config(run), resume=True)
    assert run_numbers(run) == run_numbers(uninterrupted)
    for step in (0, 2, 4):  # per-item records too; the stale one kept aside
        name = f"eval/step_{step:06d}.jsonl"
        assert (run / name).read_text() == (uninterrupted / name).read_text()
    assert (run / "eval" / "discarded" / "session_002" / "step_000004.jsonl").read_text() == "stale\n"
    assert not torn.exists()  # the interrupted write is removed at resume, under the run's lock
    events = EventAccumulator(str(run / "tensorboard"))  # step 3, logged twice, shows once: the resumed one
    events.Reload()
    logged = {e.step: e.value for e in events.Scalars("reward_mean")}
    assert logged == pytest.approx(
        {r["step"]: r["reward_mean"] for r in read_metrics(run / "metrics.jsonl") if "reward_mean" in r}, rel=1e-6
    )
    assert [e.step for e in events.Scalars("reward_mean")] == [1, 2, 3, 4]
    discarded = (run / "metrics.discarded.jsonl").read_text().splitlines()
    assert len(discarded) == 2 and json.loads(discarded[0])["step"] == 3  # redone, kept aside
    for (name, a), (_, b) in zip(final_weights(run).items(), final_weights(uninterrupted).items()):
        assert torch.equal(a, b), name
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["resumes"][0]["step"] == 2 and manifest["resumes"][0]["from_checkpoint"].endswith("step_000002")


def test_a_run_records_what_auto_resolved_to_and_logs_the_engine_mismatch_every_step(uninterrupted):
    """float32 on a CPU: algorithm.rollout_correction auto is none, and config.json and the manifest say so
    (a resume reads it back: the resume test above gives identical numbers); every step logs the engine /
    trainer k3 and the ratio pi_old / pi_engine, near 0 and 1, and nothing a correction would log."""
    config = json.loads((uninterrupted / "config.json").read_text())
    manifest = json.loads((uninterrupted / "manifest.json").read_text())
    assert config["algorithm"]["rollout_correction"] == "none" == manifest["algorithm"]["rollout_correction"]
    assert manifest["resolved"] == {
        "algorithm.rollout_correction": "none (auto: the engine samples in float32 from the current weights)"
    }
    steps = [r for r in read_metrics(uninterrupted / "metrics.jsonl") if "reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    for r in steps:
        assert 0 <= r["rollout_kl_k3"] < 1e-6 and abs(r["rollout_is_ratio_mean"] - 1) < 1e-3
        assert r["rollout_is_ratio_max"] >= r["rollout_is_ratio_mean"] and "rollout_truncated_frac" not in r


@pytest.mark.slow  # a `grpolab train` process: default tier, the in-process interruption above and the Ctrl-C test
def test_sigkill_mid_run_then_train_resume_matches_the_uninterrupted_run(warm_model_dir, uninterrupted, tmp_path):
    run = tmp_path / "run"
    cfg = quick_config(warm_model_dir, run, **OVERRIDES, threads=1)
    flat = {
        "model.path": str(warm_model_dir),
        "output_dir": str(run),
        "threads": 1,
        **OVERRIDES,
        **{f"task.{k}": v for k, v in TASK.items()},
        "rollout.prompts_per_step": 4,
        "rollout.max_new_tokens": 40,
        "optim.micro_batch_size": 16,
        "optim.lr": 1e-3,
    }
    args = [f"--{k}={v}" for k, v in flat.items()]
    assert load_config(None, parse_overrides(args)) == cfg  # the same run as in-process, on the command line
    proc = subprocess.Popen(
        [sys.executable, "-m", "grpolab.commands.cli", "train", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        metrics = run / "metrics.jsonl"
        if metrics.exists() and any(
            json.loads(line).get("step") == 3 for line in metrics.read_text().splitlines() if line.endswith("}")
        ):
            os.kill(proc.pid, signal.SIGKILL)
            break
        time.sleep(0.05)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run ended before it could be killed at step 3"
    assert main(["train", "--resume", str(run), "--optim.lr", "0.5"]) == 2  # only --steps, --log_every, --threads
    assert main(["train", "--resume", str(run)]) == 0
    assert run_numbers(run) == run_numbers(uninterrupted)
    for (name, a), (_, b) in zip(final_weights(run).items(), final_weights(uninterrupted).items()):
        assert torch.equal(a, b), name


def test_resume_needs_a_run_with_a_complete_checkpoint(tmp_path, capsys):
    with pytest.raises(ConfigError, match="nothing to resume"):
        load_run_config(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "checkpoints" / ".step_000002-tmp").mkdir(parents=True)  # a write the kill interrupted
    assert main(["train", "--resume", str(tmp_path)]) == 2
    assert "no manifest.json" in capsys.readouterr().out
    assert (tmp_path / "checkpoints" / ".step_000002-tmp").is_dir()  # refused before anything moved


def test_ctrl_c_ends_the_step_writes_a_checkpoint_and_says_how_to_resume(
    warm_model_dir, uninterrupted, tmp_path, monkeypatch, capsys
):
    run = tmp_path / "run"
    flat = {
        "model.path": str(warm_model_dir),
        "output_dir": str(run),
        **OVERRIDES,
        **{f"task.{k}": v for k, v in TASK.items()},
        "rollout.prompts_per_step": 4,
        "rollout.max_new_tokens": 40,
        "optim.micro_batch_size": 16,
        "optim.lr": 1e-3,
    }
    original = Trainer.train_step

    def ctrl_c_during_step_3(self, step, *args):
        if step == 3:
            signal.raise_signal(signal.SIGINT)  # the handler only asks for a stop: step 3 still completes
        return original(self, step, *args)

    monkeypatch.setattr(Trainer, "train_step", ctrl_c_during_step_3)
    assert main(["train", *[f"--{k}={v}" for k, v in flat.items()]]) == 130
    out = capsys.readouterr().out
    assert f"stopped after step 3 with a checkpoint; continue with: grpolab train --resume {run}" in out
    assert max(r["step"] for r in read_metrics(run / "metrics.jsonl")) == 3
    assert (run / "checkpoints" / "step_000003" / "trainer_state.pt").is_file()
    monkeypatch.setattr(Trainer, "train_step", original)
    assert main(["train", "--resume", str(run)]) == 0
    assert not (run / "metrics.discarded.jsonl").exists()  # nothing to redo
    assert run_numbers(run) == run_numbers(uninterrupted)
