"""Suites: queued runs in child processes from a snapshot, a manifest that never lies, exact resume."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import TASK, descendants
from suite_runs import (
    assert_same_metrics,
    assert_same_runs,
    cli_process,
    forked_runner,
    one_run_suite,
    steps_recorded,
    suite_file,
    trainers_of,
    wait_for_steps,
    write_hook,
)

from grpolab.commands.cli import main
from grpolab.config import load_config
from grpolab.run.rundir import read_metrics
from grpolab.studies.manifest import MANIFEST, SuiteManifest
from grpolab.studies.suite.runner import completion_problems, last_error

pytest_plugins = ["suite_fixtures"]  # finished: the uninterrupted suite; the fake trainer and its suite

ROOT = Path(__file__).resolve().parents[1]


def test_dry_run_prints_configs_commands_and_footprint_and_writes_nothing(warm_model_dir, tmp_path, capsys):
    root = tmp_path / "out"
    assert (
        main(["suite", "run", str(suite_file(tmp_path, warm_model_dir)), "--output-root", str(root), "--dry-run"]) == 0
    )
    out = capsys.readouterr().out
    assert "grpolab.commands.cli train --config" in out and out.count('"name": "dr_grpo"') == 1
    assert str(root / "runs" / "a" / "checkpoints" / "step_000003") in out  # b starts from a's final checkpoint
    assert "expected checkpoint footprint: about" in out and "placement: one run at a time" in out
    assert not root.exists()


def test_a_suite_runs_every_run_from_its_snapshot_and_records_it(finished, capsys):
    manifest = SuiteManifest.load(finished)
    assert [r.state for r in manifest.runs] == ["completed", "completed"]
    a, b = manifest.runs
    assert a.exit_code == 0 and a.final_checkpoint_sha256 and len(a.config_sha256) == 64
    assert set(a.data_sha256) == {"train", "validation", "prompt"} and a.data_sha256 == b.data_sha256
    assert manifest.code["sha256"] and manifest.code["git"] is None or "commit" in manifest.code["git"]
    for record in manifest.runs:
        run_manifest = json.loads((Path(record.run_dir) / "manifest.json").read_text())
        assert run_manifest["grpolab_source"] == str(finished / "snapshot" / "src" / "grpolab")
        assert not completion_problems(Path(record.run_dir), load_config(record.config_file))
    b_config = load_config(b.config_file)
    assert b_config.model.path == a.final_checkpoint and b_config.seed == 1  # a warm start, not a resume
    b_manifest = json.loads((Path(b.run_dir) / "manifest.json").read_text())
    assert "resumes" not in b_manifest and b_manifest["warm_start_from"] == a.final_checkpoint
    assert (finished / "snapshot" / "data").is_dir() and (finished / "logs" / "a.log").is_file()
    assert main(["suite", "status", str(finished)]) == 0
    status = capsys.readouterr().out
    assert "completed" in status and "3/3" in status
    # the suite's report, written once every run completed
    assert b.factors == {"start": "warm"} and a.factors == {}
    report = (finished / "report" / "report.md").read_text()
    assert "| a | completed | grpo | 0 | 3/3 |" in report and "| b | completed | dr_grpo | 1 | 3/3 |" in report
    assert "not exactly two factors with two levels each: start: warm" in report


def test_a_used_output_root_is_refused_and_left_alone(finished, warm_model_dir, tmp_path, capsys):
    before = (finished / MANIFEST).read_bytes()
    assert main(["suite", "run", str(suite_file(tmp_path, warm_model_dir)), "--output-root", str(finished)]) == 2
    assert "already exists and is not empty" in capsys.readouterr().out
    assert (finished / MANIFEST).read_bytes() == before


@pytest.mark.slow  # default tier: the run's one line (next test) and a failing fake run's line as its reason
def test_a_failed_run_stops_the_queue_with_its_reason(warm_model_dir, tmp_path):
    spec = suite_file(tmp_path, warm_model_dir, first_overrides='overrides = { "eval.n_examples" = 17 }')
    assert main(["suite", "run", str(spec), "--output-root", str(tmp_path / "out")]) == 1
    a, b = SuiteManifest.load(tmp_path / "out").runs
    assert (a.state, b.state) == ("failed", "queued") and a.exit_code == 2
    assert a.reason == "eval.n_examples 17 > the 16 validation examples of task 'arithmetic'"


def test_a_run_asking_for_more_validation_examples_than_its_task_has_ends_in_one_error_line(
    warm_model_dir, tmp_path, capsys
):
    """The line a suite records as the failed run's reason (last_error: its log's last 'error:' line)."""
    overrides = {
        "model.path": str(warm_model_dir),
        "output_dir": str(tmp_path / "run"),
        "eval.n_examples": 17,
        **{f"task.{k}": v for k, v in TASK.items()},
    }
    assert main(["train", *[f"--{k}={v}" for k, v in overrides.items()]]) == 2
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("error:")]
    assert lines == ["error: eval.n_examples 17 > the 16 validation examples of task 'arithmetic'"]
    assert not (tmp_path / "run").exists()


def test_a_missing_start_model_is_refused_before_anything_is_written(warm_model_dir, tmp_path, capsys):
    spec = suite_file(tmp_path, warm_model_dir, first_overrides='overrides = { "model.path" = "/nonexistent/model" }')
    assert main(["suite", "run", str(spec), "--output-root", str(tmp_path / "out")]) == 2
    assert "model directory not found: /nonexistent/model" in capsys.readouterr().out
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", ["demo_all", "reference_eight", "tools_minimind", "moe_e3", "demo_decide"])
def test_the_shipped_suites_resolve(name, tmp_path, capsys):
    assert (
        main(["suite", "run", str(ROOT / "suites" / f"{name}.toml"), "--output-root", str(tmp_path / "o"), "--dry-run"])
        == 0
    )
    out = capsys.readouterr().out
    assert (
        out.count("grpolab.commands.cli train --config")
        == {"demo_all": 15, "reference_eight": 8, "tools_minimind": 4, "moe_e3": 4, "demo_decide": 24}[name]
    )


def test_the_reason_of_a_failure_is_its_error_line_or_the_end_of_its_traceback(tmp_path):
    log = tmp_path / "a.log"
    log.write_text("Traceback (most recent call last):\n  File x\nRuntimeError: probability tensor contains nan\n")
    assert last_error(log) == "RuntimeError: probability tensor contains nan"
    log.write_text("12:00:00 step 1/3 ...\nerror: non-finite loss (nan) or ratio in the policy update\n")
    assert last_error(log) == "non-finite loss (nan) or ratio in the policy update"
    assert last_error(tmp_path / "missing.log") is None


def write_checkpoint(folder: Path, files: dict[str, bytes], step: int) -> Path:
    """A checkpoint folder as the trainer writes one: its files, then checkpoint.json listing them."""
    folder.mkdir(parents=True)
    for name, content in files.items():
        (folder / name).write_bytes(content)
    listing = {
        name: {"bytes": len(content), "sha256": hashlib.sha256(content).hexdigest()} for name, content in files.items()
    }
    (folder / "checkpoint.json").write_text(json.dumps({"step": step, "files": listing}))
    return folder


def test_exit_0_without_the_final_validation_record_is_not_completion(tmp_path):
    cfg = load_config(None, {"steps": 2})
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 2, "reward_mean": 0.5}) + "\n")
    write_checkpoint(
        tmp_path / "checkpoints" / "step_000002",
        {"config.json": b"{}", "model.safetensors": b"w", "trainer_state.pt": b"s"},
        step=2,
    )
    assert completion_problems(tmp_path, cfg) == ["the validation record of step 2"]


@pytest.mark.slow  # default tier: the one-run suite below (real runs) and the same with fake runs
def test_ctrl_c_mid_suite_leaves_it_resumable_and_resume_matches_the_uninterrupted_suite(
    finished, warm_model_dir, tmp_path
):
    """The suite runs from a copy of the package; that copy is broken once the suite has started (queued
    runs must not care), Ctrl-C stops run a after a step, and resume finishes with identical numbers."""
    package = tmp_path / "pkg"
    shutil.copytree(ROOT / "grpolab", package / "grpolab", ignore=shutil.ignore_patterns("__pycache__"))
    root = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(package)}
    spec = suite_file(tmp_path, warm_model_dir)
    proc = cli_process("suite", "run", str(spec), "--output-root", str(root), env=env, stdout=subprocess.PIPE)
    deadline = time.monotonic() + 300
    while not (root / MANIFEST).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    with (package / "grpolab" / "run" / "trainer.py").open("a") as f:
        f.write('\nraise SystemExit("edited after the suite started")\n')
    metrics = root / "runs" / "a" / "metrics.jsonl"
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and '"reward_mean"' in metrics.read_text():
            proc.send_signal(signal.SIGINT)
            break
        time.sleep(0.05)
    out = proc.communicate(timeout=300)[0].decode()
    assert proc.returncode == 130, out
    a, b = SuiteManifest.load(root).runs
    assert (a.state, b.state) == ("stopped", "queued") and "grpolab suite resume" in out
    assert not descendants(proc.pid) and a.pid is None
    assert main(["suite", "resume", str(root)]) == 0
    resumed = SuiteManifest.load(root).runs
    assert [r.state for r in resumed] == ["completed", "completed"] and resumed[0].attempts
    assert_same_metrics(root, finished)
    assert [r.final_checkpoint_sha256 for r in resumed] == [
        r.final_checkpoint_sha256 for r in SuiteManifest.load(finished).runs
    ]


SLOW_CHECKPOINTS = """
import time
import grpolab.run.checkpoints as checkpoints
_save = checkpoints.save_checkpoint
def save_checkpoint(*args, **kwargs):
    time.sleep(1)  # the run is surely still training when the test stops the suite
    return _save(*args, **kwargs)
checkpoints.save_checkpoint = save_checkpoint
"""


def test_ctrl_c_mid_suite_leaves_it_resumable_and_resume_matches_the_uninterrupted_suite_with_one_real_run(
    finished, warm_model_dir, tmp_path, monkeypatch
):
    """The suite's exact resume with real runs (run a of the tiny suite, alone): Ctrl-C to the runner stops
    run a after a step, and resume finishes it with the numbers and weights of the uninterrupted suite's run a.
    (That a suite's runs import its code snapshot, not the working tree: test_a_suite_runs_every_run_...)"""
    monkeypatch.setenv("PYTHONPATH", str(write_hook(tmp_path, SLOW_CHECKPOINTS)))
    root, log = tmp_path / "out", tmp_path / "runner.log"
    runner = forked_runner("run", str(one_run_suite(tmp_path, warm_model_dir)), "--output-root", str(root), log=log)
    wait_for_steps([root / "runs" / "a"], 1, runner.is_alive, seconds=300, interval=0.05)
    os.kill(runner.pid, signal.SIGINT)
    runner.join(300)
    out = log.read_text()
    assert runner.exitcode == 130, out
    (a,) = SuiteManifest.load(root).runs
    assert a.state == "stopped" and "resumable from its newest checkpoint" in a.reason and "grpolab suite resume" in out
    assert not trainers_of(root, "a") and a.pid is None and steps_recorded(root / "runs" / "a") < 3
    monkeypatch.delenv("PYTHONPATH")
    assert main(["suite", "resume", str(root)]) == 0
    (resumed,) = SuiteManifest.load(root).runs
    assert resumed.state == "completed" and resumed.attempts and resumed.command[-2] == "--resume"
    assert_same_metrics(root, finished, ("a",))
    assert resumed.final_checkpoint_sha256 == SuiteManifest.load(finished).runs[0].final_checkpoint_sha256


@pytest.mark.slow  # default tier: the same with fake runs below; exact resume of real runs: the Ctrl-C test above
def test_a_suite_killed_outright_resumes_with_identical_numbers(finished, warm_model_dir, tmp_path):
    """A power cut: the runner and its run die with SIGKILL; the manifest still says 'running'."""
    root = tmp_path / "out"
    proc = cli_process("suite", "run", str(suite_file(tmp_path, warm_model_dir)), "--output-root", str(root))
    wait_for_steps([root / "runs" / "a"], 2, lambda: proc.poll() is None, seconds=300, interval=0.05)
    child = SuiteManifest.load(root).runs[0].pid
    proc.kill()
    os.killpg(child, signal.SIGKILL)
    proc.wait()
    assert SuiteManifest.load(root).runs[0].state == "running"
    assert main(["suite", "resume", str(root)]) == 0
    assert_same_metrics(root, finished)


INJECT = {
    "loss": """
import grpolab.objectives.losses as losses
_aggregate, calls = losses.aggregate, [0]
def aggregate(*args, **kwargs):
    calls[0] += 1
    out = _aggregate(*args, **kwargs)
    return out * float("nan") if calls[0] > 2 else out  # from the second step on (2 micro-batches a step)
losses.aggregate = aggregate
""",
    "gradient": """
import torch
_clip, calls = torch.nn.utils.clip_grad_norm_, [0]
def clip(parameters, *args, **kwargs):
    parameters = list(parameters)
    calls[0] += 1
    if calls[0] > 1:
        parameters[0].grad.fill_(float("nan"))
    return _clip(parameters, *args, **kwargs)
torch.nn.utils.clip_grad_norm_ = clip
""",
}


@pytest.mark.slow  # default tier: test_update's non-finite tests and the failing fake run below
@pytest.mark.parametrize("where", ["loss", "gradient"])
def test_a_nan_stops_its_run_before_the_optimizer_step_and_stops_the_queue(
    where, warm_model_dir, tmp_path, monkeypatch
):
    """A NaN is injected into every run process (a sitecustomize module on PYTHONPATH) from step 2 on."""
    monkeypatch.setenv("PYTHONPATH", str(write_hook(tmp_path, INJECT[where])))
    root = tmp_path / "out"
    assert main(["suite", "run", str(suite_file(tmp_path, warm_model_dir)), "--output-root", str(root)]) == 1
    a, b = SuiteManifest.load(root).runs
    assert (a.state, b.state) == ("failed", "queued") and a.exit_code == 2
    assert ("non-finite loss (nan)" if where == "loss" else "non-finite gradient norm (nan)") in a.reason
    assert max(r["step"] for r in read_metrics(root / "runs" / "a" / "metrics.jsonl")) == 1
    last_good = root / "runs" / "a" / "checkpoints" / "step_000001"
    assert sorted(p.name for p in (root / "runs" / "a" / "checkpoints").iterdir()) == ["step_000001"]
    assert (last_good / "trainer_state.pt").is_file() and (last_good / "model.safetensors").is_file()


# ---- the scheduler with fake runs (tests/fake_trainer.py): the same claims in seconds ------------------
def test_a_suite_killed_outright_resumes_with_identical_numbers_with_fake_runs(
    fake_finished, fake_runs, warm_model_dir, tmp_path
):
    """A power cut: the runner and its run die with SIGKILL; the manifest still says 'running'."""
    fake_runs.use(slow={"a": 0.3})
    root = tmp_path / "out"
    runner = forked_runner("run", str(suite_file(tmp_path, warm_model_dir)), "--output-root", str(root))
    wait_for_steps([root / "runs" / "a"], 2, runner.is_alive)
    child = SuiteManifest.load(root).runs[0].pid
    runner.kill()
    os.killpg(child, signal.SIGKILL)
    runner.join()
    a, b = SuiteManifest.load(root).runs
    assert (a.state, b.state) == ("running", "queued") and steps_recorded(root / "runs" / "a") < 3
    assert main(["suite", "resume", str(root)]) == 0
    a, b = SuiteManifest.load(root).runs
    assert (a.state, b.state) == ("completed", "completed") and a.command[-2] == "--resume"
    assert_same_runs(root, fake_finished)


def test_a_run_failing_mid_way_stops_the_queue_with_its_error_and_keeps_its_last_checkpoint_with_fake_runs(
    fake_runs, warm_model_dir, tmp_path
):
    fake_runs.use(fail={"a": 2})
    root = tmp_path / "out"
    assert main(["suite", "run", str(suite_file(tmp_path, warm_model_dir)), "--output-root", str(root)]) == 1
    a, b = SuiteManifest.load(root).runs
    assert (a.state, b.state) == ("failed", "queued") and a.exit_code == 2
    assert a.reason == "non-finite loss (nan) or ratio in the policy update"
    assert max(r["step"] for r in read_metrics(root / "runs" / "a" / "metrics.jsonl")) == 1
    assert sorted(p.name for p in (root / "runs" / "a" / "checkpoints").iterdir()) == ["step_000001"]
    assert not (root / "logs" / "b.log").exists()


def test_ctrl_c_mid_suite_leaves_it_resumable_and_resume_matches_the_uninterrupted_suite_with_fake_runs(
    fake_finished, fake_runs, warm_model_dir, tmp_path
):
    fake_runs.use(slow={"a": 0.3})
    root, log = tmp_path / "out", tmp_path / "runner.log"
    runner = forked_runner("run", str(suite_file(tmp_path, warm_model_dir)), "--output-root", str(root), log=log)
    wait_for_steps([root / "runs" / "a"], 1, runner.is_alive)
    os.kill(runner.pid, signal.SIGINT)
    runner.join(120)
    out = log.read_text()
    assert runner.exitcode == 130, out
    a, b = SuiteManifest.load(root).runs
    assert (a.state, b.state) == ("stopped", "queued") and "grpolab suite resume" in out
    assert "resumable from its newest checkpoint" in a.reason and steps_recorded(root / "runs" / "a") < 3
    assert not descendants(runner.pid) and a.pid is None
    fake_runs.use()
    assert main(["suite", "resume", str(root)]) == 0
    resumed = SuiteManifest.load(root).runs
    assert [r.state for r in resumed] == ["completed", "completed"] and resumed[0].attempts
    assert resumed[0].command[-2] == "--resume"
    assert_same_runs(root, fake_finished)
