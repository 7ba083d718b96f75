"""A suite never lets two trainers write one run, never completes or resumes what it should not, refuses
edited inputs and bad targets with one line, and keeps earlier attempts apart from the runs."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from rich.console import Console
from suite_runs import (
    assert_same_metrics,
    cli_process,
    forked_runner,
    one_run_suite,
    suite_file,
    trainers_of,
    wait_for_steps,
    write_hook,
)
from test_suite import ROOT, write_checkpoint

from grpolab.commands.cli import main
from grpolab.config import load_config
from grpolab.run.checkpoints import weights_sha256
from grpolab.run.lock import lock_holder
from grpolab.run.rundir import read_metrics
from grpolab.studies.manifest import MANIFEST, RunRecord, SuiteManifest
from grpolab.studies.suite.flight import Flight, classify
from grpolab.studies.suite.launch import LocalLauncher
from grpolab.studies.suite.runner import SuiteRunner, completion_problems, prepare_suite, progress_of

pytest_plugins = ["suite_fixtures"]  # finished: the uninterrupted suite; the fake trainer and its suite

SLOW_FINAL_CHECKPOINT = """
import time
import grpolab.run.checkpoints as checkpoints
_save = checkpoints.save_checkpoint
def save_checkpoint(model, tokenizer, run_dir, step, *args, **kwargs):
    if step == 3 and str(run_dir).endswith("a"):
        time.sleep(3)  # run a's final checkpoint: the orphan is surely still alive when resume looks
    return _save(model, tokenizer, run_dir, step, *args, **kwargs)
checkpoints.save_checkpoint = save_checkpoint
"""


@pytest.fixture
def queued(warm_model_dir, tmp_path) -> Path:
    """A suite made (snapshots, configs, manifest) and not run."""
    root = tmp_path / "out"
    prepare_suite(suite_file(tmp_path, warm_model_dir), root, Console())
    return root


@pytest.fixture
def wide(monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")  # status tables on one line a row


def complete_on_disk(run_dir: Path, steps: int = 3) -> Path:
    """A run directory as a finished run leaves it: every training record, the final validation record
    and a final checkpoint that verifies. Returns the checkpoint."""
    run_dir.mkdir(parents=True, exist_ok=True)
    records = [{"step": s, "reward_mean": 0.5} for s in range(1, steps + 1)] + [{"step": steps, "val/accuracy": 0.25}]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return write_checkpoint(
        run_dir / "checkpoints" / f"step_{steps:06d}",
        {"config.json": b"{}", "model.safetensors": b"weights", "trainer_state.pt": b"state"},
        step=steps,
    )


def mark_running(root: Path, name: str, pid: int | None = None) -> None:
    """The manifest as a runner killed mid-run leaves it: the run 'running' with its command."""
    manifest = SuiteManifest.load(root)
    record = next(r for r in manifest.runs if r.name == name)
    record.state, record.pid, record.started = "running", pid, "2026-01-01T00:00:00+0000"
    record.command = [sys.executable, "-m", "grpolab.commands.cli", "train", "--config", record.config_file]
    manifest.save(root)


def lock_holder_process(run_dir: Path, seconds: float) -> subprocess.Popen:
    """A process holding ``run_dir``'s lock for ``seconds`` (a trainer left behind), in its own session."""
    code = (
        f"import time; from pathlib import Path; from grpolab.run.lock import RunLock; "
        f"RunLock(Path({str(run_dir)!r})).acquire(); print('held', flush=True); time.sleep({seconds})"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, start_new_session=True)
    assert proc.stdout.readline().strip() == b"held"
    return proc


def resume_never_starts_a_second_trainer(root: Path, orphan: int, finished: Path, capsys) -> None:
    """``suite resume`` of ``root``, whose killed runner left ``orphan`` training run a: it waits for the orphan
    (sampled all along: never a second trainer), then finishes both runs with ``finished``'s numbers."""
    samples: list[set[int]] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            samples.append(trainers_of(root, "a"))
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    try:
        assert trainers_of(root, "a") == {orphan}  # the orphan trains on
        sampler.start()
        assert main(["suite", "resume", str(root)]) == 0
    finally:
        stop.set()
        if sampler.is_alive():
            sampler.join()
        for pid in trainers_of(root, "a") & {orphan}:
            os.kill(pid, signal.SIGKILL)
    assert samples and samples[0] == {orphan} and all(s <= {orphan} for s in samples)  # never a second trainer
    out = capsys.readouterr().out
    assert f"run a: waiting for process {orphan} (left training by an earlier runner) to end" in out
    a, b = SuiteManifest.load(root).runs
    assert (a.state, b.state) == ("completed", "completed")
    assert a.waits[0]["pid"] == orphan and a.waits[0]["until"] and a.command[-2:] == ["--config", a.config_file]
    log = (root / "logs" / "a.log").read_text().splitlines()
    assert len([line for line in log if line.startswith("# ") and "grpolab.commands.cli train" in line]) == 1
    for name in ("a", "b"):
        records = read_metrics(root / "runs" / name / "metrics.jsonl")
        for key in ("reward_mean", "val/accuracy"):
            steps = [r["step"] for r in records if key in r]
            assert len(steps) == len(set(steps)), (name, key, steps)
    assert_same_metrics(root, finished)
    assert [r.final_checkpoint_sha256 for r in (a, b)] == [
        r.final_checkpoint_sha256 for r in SuiteManifest.load(finished).runs
    ]


@pytest.mark.slow  # default tier: the same with fake runs (next test) and the real Ctrl-C resume (test_suite.py)
def test_resume_never_starts_a_second_trainer_on_a_run_its_killed_runner_left_training(
    finished, warm_model_dir, tmp_path, capsys
):
    """The runner alone dies (SIGKILL; its run, in its own session, trains on); suite resume at once waits
    for that orphan, finds run a complete on disk, runs b, and every number equals the uninterrupted suite's."""
    hook = write_hook(tmp_path, SLOW_FINAL_CHECKPOINT)
    root = tmp_path / "out"
    command = ["suite", "run", str(suite_file(tmp_path, warm_model_dir)), "--output-root", str(root)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(hook)])}  # this checkout's package, first
    proc = cli_process(*command, env=env)
    wait_for_steps([root / "runs" / "a"], 2, lambda: proc.poll() is None, seconds=300, interval=0.05)
    orphan = SuiteManifest.load(root).runs[0].pid
    proc.kill()
    proc.wait()
    resume_never_starts_a_second_trainer(root, orphan, finished, capsys)


def test_resume_never_starts_a_second_trainer_on_a_run_its_killed_runner_left_training_with_fake_runs(
    fake_finished, fake_runs, warm_model_dir, tmp_path, capsys
):
    fake_runs.use(slow={"a": 1.0})  # the orphan is surely still alive when resume looks
    root = tmp_path / "out"
    runner = forked_runner("run", str(suite_file(tmp_path, warm_model_dir)), "--output-root", str(root))
    wait_for_steps([root / "runs" / "a"], 1, runner.is_alive)
    orphan = SuiteManifest.load(root).runs[0].pid
    runner.kill()
    runner.join()
    resume_never_starts_a_second_trainer(root, orphan, fake_finished, capsys)


def test_resume_waits_for_a_trainer_its_runner_was_killed_starting_before_it_took_the_runs_lock_with_fake_runs(
    fake_finished, fake_runs, warm_model_dir, tmp_path, capsys
):
    """The runner is killed the moment its trainer started (before it recorded the pid), and the trainer
    has not yet taken its run's lock: suite resume finds it all the same, waits for it, judges run a from
    disk, and never starts a second trainer on it."""
    fake_runs.use(slow={"a": 0.5}, start_seconds=3.0)  # the trainer's start: its imports and model load
    root = tmp_path / "out"
    start = LocalLauncher.start

    def start_then_die(self, *args):
        started = start(self, *args)
        os.kill(os.getpid(), signal.SIGKILL)
        return started

    with pytest.MonkeyPatch.context() as patch:  # the forked runner alone dies so
        patch.setattr(LocalLauncher, "start", start_then_die)
        runner = forked_runner("run", str(suite_file(tmp_path, warm_model_dir)), "--output-root", str(root))
    runner.join(120)
    (orphan,) = trainers_of(root, "a")
    assert lock_holder(root / "runs" / "a") is None  # the window: started, not yet holding the run
    resume_never_starts_a_second_trainer(root, orphan, fake_finished, capsys)


def test_resume_waits_for_the_process_holding_a_runs_lock_then_judges_the_run_from_disk(
    warm_model_dir, tmp_path, capsys
):
    root = tmp_path / "out"
    prepare_suite(one_run_suite(tmp_path, warm_model_dir), root, Console())
    checkpoint = complete_on_disk(root / "runs" / "a")
    holder = lock_holder_process(root / "runs" / "a", seconds=2)
    mark_running(root, "a", pid=holder.pid)
    try:
        assert main(["suite", "resume", str(root)]) == 0
    finally:
        holder.kill()
        holder.wait()
    assert (
        f"run a: waiting for process {holder.pid} (left training by an earlier runner) to end"
        in capsys.readouterr().out
    )
    (a,) = SuiteManifest.load(root).runs
    assert a.state == "completed" and a.waits[0]["pid"] == holder.pid and a.waits[0]["until"]
    assert a.final_checkpoint_sha256 == weights_sha256(checkpoint)
    assert not (root / "logs" / "a.log").exists()  # nothing was started


def test_ctrl_c_while_waiting_stops_the_runner_and_leaves_the_training_process_alone(warm_model_dir, tmp_path, capsys):
    root = tmp_path / "out"
    prepare_suite(one_run_suite(tmp_path, warm_model_dir), root, Console())
    (root / "runs" / "a").mkdir(parents=True)
    holder = lock_holder_process(root / "runs" / "a", seconds=120)
    mark_running(root, "a", pid=holder.pid)

    def interrupt_once_waiting() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if json.loads((root / MANIFEST).read_text())["runs"][0]["waits"]:
                    break
            except (OSError, ValueError, KeyError):
                pass
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=interrupt_once_waiting, daemon=True).start()
    try:
        assert main(["suite", "resume", str(root)]) == 130
        assert holder.poll() is None  # left alone
    finally:
        holder.kill()
        holder.wait()
    (a,) = SuiteManifest.load(root).runs
    assert a.state == "running" and a.pid == holder.pid and a.waits[0]["interrupted"] and a.waits[0]["until"] is None
    assert "goes on training the run" in capsys.readouterr().out
    assert not (root / "logs" / "a.log").exists()


def test_a_run_recorded_running_but_complete_on_disk_is_completed_without_starting_anything(warm_model_dir, tmp_path):
    """The runner died while hashing run a's final checkpoint: resume records it, and starts nothing."""
    root = tmp_path / "out"
    prepare_suite(one_run_suite(tmp_path, warm_model_dir), root, Console())
    checkpoint = complete_on_disk(root / "runs" / "a")
    before = (root / "runs" / "a" / "metrics.jsonl").read_bytes()
    mark_running(root, "a")
    assert main(["suite", "resume", str(root)]) == 0
    (a,) = SuiteManifest.load(root).runs
    assert a.state == "completed" and a.final_checkpoint == str(checkpoint) and not a.attempts
    assert a.final_checkpoint_sha256 == weights_sha256(checkpoint)
    assert not (root / "logs" / "a.log").exists() and (root / "runs" / "a" / "metrics.jsonl").read_bytes() == before


def edit_config(root: Path) -> str:
    path = root / "configs" / "b.json"
    data = json.loads(path.read_text())
    data["optim"]["lr"] = 0.05
    path.write_text(json.dumps(data, indent=2))
    return f"{path} was edited after the suite was made: optim.lr is 0.05, was 0.001; not run"


def edit_code(root: Path) -> str:
    with (root / "snapshot" / "src" / "grpolab" / "run" / "trainer.py").open("a") as f:
        f.write("\n# edited\n")
    return (
        f"the code snapshot {root / 'snapshot' / 'src' / 'grpolab'} was changed after the suite was made: "
        "run/trainer.py was changed; not run"
    )


def edit_data(root: Path) -> str:
    (path,) = (root / "snapshot" / "data").glob("*/train.jsonl")
    path.write_text(path.read_text().replace('"answer": "', '"answer": "1', 1))
    return f"{path} was edited after the suite was made (its SHA-256 differs); not run"


@pytest.mark.parametrize("edit", [edit_config, edit_code, edit_data])
def test_a_suite_whose_configs_code_or_data_were_edited_is_refused_before_anything_moves(edit, queued, capsys):
    expected = edit(queued)
    before = (queued / MANIFEST).read_bytes()
    assert main(["suite", "resume", str(queued)]) == 2
    errors = [line for line in capsys.readouterr().out.splitlines() if line.startswith("error:")]
    assert errors == [f"error: {expected}"]
    assert (queued / MANIFEST).read_bytes() == before  # not even the runner's pid
    assert not (queued / "runs").exists() and not (queued / "logs").exists()


def test_a_suite_records_each_runs_config_and_the_code_files(queued):
    manifest = SuiteManifest.load(queued)
    assert "run/trainer.py" in manifest.code["files"]
    for record in manifest.runs:
        assert record.config == json.loads(Path(record.config_file).read_text())
        assert record.data_dir and (Path(record.data_dir) / "train.jsonl").is_file()
        cfg = load_config(record.config_file)
        assert (
            record.config_sha256
            == hashlib.sha256(json.dumps(cfg.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()
        )


@pytest.mark.parametrize(
    "where, expected",
    [
        ("base", "error: base: output_dir is set by the suite"),
        ("overrides", "error: run a: output_dir is set by the suite"),
    ],
)
def test_output_dir_is_refused_in_a_suite(where, expected, warm_model_dir, tmp_path, capsys):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "keep.txt").write_text("the user's")
    spec = suite_file(
        tmp_path,
        warm_model_dir,
        first_overrides=f'overrides = {{ "output_dir" = "{mine}" }}' if where == "overrides" else "",
    )
    if where == "base":
        spec.write_text(spec.read_text().replace("[base]\n", f'[base]\noutput_dir = "{mine}"\n', 1))
    root = tmp_path / "out"
    for dry in (["--dry-run"], []):
        assert main(["suite", "run", str(spec), "--output-root", str(root), *dry]) == 2
        errors = [line for line in capsys.readouterr().out.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and errors[0].startswith(expected), errors
    assert not root.exists() and [p.name for p in mine.iterdir()] == ["keep.txt"]


def test_an_earlier_attempt_moves_under_attempts_apart_from_every_run_name(tmp_path):
    root = tmp_path / "out"
    run_dir, other = root / "runs" / "a", root / "runs" / "a.attempt-1"
    for folder in (run_dir, other):
        folder.mkdir(parents=True)
        (folder / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward_mean": 0.5}) + "\n")
    record = RunRecord(name="a", run_dir=str(run_dir), config_file=str(root / "configs" / "a.json"), config_sha256="")
    runner = SuiteRunner(root, Console())
    assert runner._command(record)[-2:] == ["--config", record.config_file]
    assert not run_dir.exists() and (root / "attempts" / "a" / "attempt-1" / "metrics.jsonl").is_file()
    assert (other / "metrics.jsonl").is_file()  # run a.attempt-1 untouched
    run_dir.mkdir()
    (run_dir / "log.txt").write_text("second try")
    runner._command(record)
    assert (root / "attempts" / "a" / "attempt-2" / "log.txt").is_file()
    assert [a["moved_to"] for a in record.attempts] == [str(root / "attempts" / "a" / f"attempt-{n}") for n in (1, 2)]


def test_a_torn_metrics_line_is_skipped_and_counted_never_fatal(queued, wide, capsys):
    run_dir = queued / "runs" / "a"
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text(
        json.dumps({"step": 1, "reward_mean": 0.5})
        + "\n"
        + json.dumps({"step": 2, "reward_mean": 0.4})
        + '\n{"step": 3, "rew'
    )
    cfg = load_config(SuiteManifest.load(queued).runs[0].config_file)
    assert completion_problems(run_dir, cfg)[0] == "the training record of step 3"
    assert tuple(progress_of(run_dir)) == (2, None, 1)
    assert main(["suite", "status", str(queued)]) == 0
    assert "2/3 (1 unreadable metrics line skipped)" in capsys.readouterr().out


def test_a_signal_before_the_first_checkpoint_does_not_promise_a_resume(tmp_path):
    cfg = load_config(None, {"steps": 3})
    record = RunRecord(name="a", run_dir=str(tmp_path / "a"), config_file="a.json", config_sha256="")
    flight = Flight(record, cfg, job=None, stop_asked="stopped by SIGINT to the suite runner")
    (tmp_path / "a").mkdir()
    classify(flight, tmp_path / "a.log", -15)
    assert record.state == "stopped" and "resumable" not in record.reason
    assert record.reason.endswith("before its first checkpoint; suite resume starts it afresh")
    write_checkpoint(tmp_path / "a" / "checkpoints" / "step_000001", {"trainer_state.pt": b"s"}, step=1)
    classify(flight, tmp_path / "a.log", -15)
    assert record.reason.endswith("resumable from its newest checkpoint step_000001")


@pytest.mark.parametrize(
    "exit_code, note, state, reason",
    [
        (130, None, "stopped", "a signal from outside the suite: stopped by a signal (exit code 130)"),
        (
            -15,
            "Slurm job 7 ended (CANCELLED) before its command recorded an exit code",
            "stopped",
            "Slurm job 7 ended (CANCELLED) before its command recorded an exit code: stopped by a signal",
        ),
        (-9, None, "failed", "killed by signal SIGKILL"),
        (3, None, "failed", "exit code 3"),
    ],
)
def test_a_run_ended_by_a_signal_from_outside_is_stopped_and_any_other_end_failed(
    exit_code, note, state, reason, tmp_path
):
    cfg = load_config(None, {"steps": 3})
    record = RunRecord(name="a", run_dir=str(tmp_path / "a"), config_file="a.json", config_sha256="")
    (tmp_path / "a").mkdir()
    classify(Flight(record, cfg, job=None), tmp_path / "a.log", exit_code, note)
    assert record.state == state and record.reason.startswith(reason), record.reason


def test_the_suite_page_records_a_kill_from_outside_as_the_suite_does(tmp_path):
    """docs/suites-and-resume.md says what a run killed from outside becomes: SIGKILL a failure, in the words of
    its record; SIGTERM a stop."""
    text = " ".join((ROOT / "docs" / "suites-and-resume.md").read_text().split())
    cfg = load_config(None, {"steps": 3})
    records = {}
    for exit_code in (-signal.SIGKILL, -signal.SIGTERM):
        record = RunRecord(name="a", run_dir=str(tmp_path / "a"), config_file="a.json", config_sha256="")
        (tmp_path / "a").mkdir(exist_ok=True)
        classify(Flight(record, cfg, job=None), tmp_path / "a.log", exit_code)
        records[exit_code] = record
    killed = records[-signal.SIGKILL]
    assert f"`{killed.state} ({killed.reason})`" in text
    assert "SIGKILL: `kill -9`" in text and "is a failure the suite reports" in text
    assert records[-signal.SIGTERM].state == "stopped" and "(SIGTERM or SIGINT: a plain `kill`" in text
    assert "is `stopped`, not failed" not in text


@pytest.mark.parametrize("target", ["missing", "empty", "not_json", "not_a_manifest"])
def test_resume_of_a_bad_target_is_one_error_line_and_moves_nothing(target, tmp_path, capsys):
    folder = tmp_path / "suite"
    if target != "missing":
        folder.mkdir()
    if target == "not_json":
        (folder / MANIFEST).write_text("{not json")
    if target == "not_a_manifest":
        (folder / MANIFEST).write_text(json.dumps({"runs": "none"}))
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    assert main(["suite", "resume", str(folder)]) == 2
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and out[0].startswith("error: ") and str(folder) in out[0], out
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_a_suite_whose_runner_on_another_host_wrote_lately_is_refused(queued, capsys):
    """A second login node may not run a suite whose runner elsewhere still writes its heartbeat."""
    manifest = SuiteManifest.load(queued)
    manifest.runner_pid, manifest.runner_host, manifest.runner_seen = 4242, "login2", time.time() - 5
    manifest.save(queued)
    before = (queued / MANIFEST).read_bytes()
    assert main(["suite", "resume", str(queued), "--devices", "0"]) == 2
    (line,) = capsys.readouterr().out.splitlines()
    assert re.fullmatch(
        rf"error: suite {re.escape(str(queued))} is being run by process 4242 on login2 "
        r"\(it wrote [5-9] s ago\)",
        line,
    ), line
    assert (queued / MANIFEST).read_bytes() == before
