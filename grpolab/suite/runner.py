"""Running a suite: its runs one at a time, each in its own process started from the snapshot; the first
run that does not complete stops the queue. Nothing is retried automatically and no setting changes;
``resume`` continues at the first unfinished run (from its newest complete checkpoint when it has one).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from grpolab.config import RunConfig, load_config
from grpolab.models import absolute_model_spec, check_model_spec
from grpolab.progress import Reporter, format_seconds
from grpolab.run_state import STATE_FILE
from grpolab.rundir import RunDirError, latest_resumable_checkpoint, read_metrics
from grpolab.suite.manifest import RunRecord, SuiteManifest, now, pid_alive
from grpolab.suite.snapshot import file_sha256, snapshot_code, snapshot_data, task_key
from grpolab.suite.spec import final_checkpoint, load_suite, resolve_runs

POLL_SECONDS = 0.5


def config_sha256(cfg: RunConfig) -> str:
    return hashlib.sha256(json.dumps(cfg.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()


def train_command(config_file: Path) -> list[str]:
    return [sys.executable, "-m", "grpolab.cli", "train", "--config", str(config_file)]


def resume_command(run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "grpolab.cli", "train", "--resume", str(run_dir)]


def completion_problems(run_dir: Path, cfg: RunConfig) -> list[str]:
    """What a completed run must have and this one lacks: the final training record, the final
    validation record and the final model checkpoint."""
    path = run_dir / "metrics.jsonl"
    records = read_metrics(path) if path.is_file() else []
    last = [r for r in records if r.get("step") == cfg.steps]
    missing = []
    if not any("reward_mean" in r for r in last):
        missing.append(f"the training record of step {cfg.steps}")
    if not any("val/accuracy" in r for r in last):
        missing.append(f"the validation record of step {cfg.steps}")
    checkpoint = final_checkpoint(run_dir, cfg)
    if not (checkpoint / "config.json").is_file() or not any(checkpoint.glob("model*.safetensors")):
        missing.append(f"the final checkpoint {checkpoint.name}")
    return missing


def weights_sha256(checkpoint: Path) -> str:
    """SHA-256 over a checkpoint's weight files (names and contents), the part that defines the model."""
    h = hashlib.sha256()
    for path in sorted(checkpoint.glob("model*.safetensors")):
        h.update(f"{path.name}\0{file_sha256(path)}\0".encode())
    return h.hexdigest()


def progress_of(run_dir: Path) -> tuple[int, float | None]:
    """(last step with a training record, last validation accuracy) of a run so far."""
    path = run_dir / "metrics.jsonl"
    try:
        records = read_metrics(path) if path.is_file() else []
    except json.JSONDecodeError:  # a line being written
        return 0, None
    steps = [r["step"] for r in records if "reward_mean" in r]
    vals = [r["val/accuracy"] for r in records if "val/accuracy" in r]
    return (steps[-1] if steps else 0), (vals[-1] if vals else None)


def last_error(log: Path) -> str | None:
    """The reason in a run's log: its last 'error:' line (the one-line reason grpolab gives), else the last
    line of a traceback ('SomeError: ...')."""
    lines = log.read_text(errors="replace").splitlines() if log.is_file() else []
    errors = [line.removeprefix("error:").strip() for line in lines if line.startswith("error:")]
    raised = [line for line in lines if re.match(r"^[A-Za-z_.]*(Error|Exception|Interrupt)\b", line)]
    return (errors or raised or [None])[-1]


class SuiteRunner:
    """Executes the manifest of the suite in ``root``."""

    def __init__(self, root: Path, console: Console):
        self.root, self.console = root, console
        self.reporter = Reporter(console)
        self.signals = 0
        self.child: subprocess.Popen | None = None

    # ---- signals: the first stops the current run at a step boundary, the second kills it -------
    def _on_signal(self, signum: int, frame: Any) -> None:
        self.signals += 1
        if self.child is None:
            raise KeyboardInterrupt
        if self.signals == 1:
            self.reporter.line(f"{signal.Signals(signum).name}: stopping the current run after its step "
                               "(with a checkpoint); again to kill it")
            self.child.send_signal(signal.SIGTERM)
        else:
            os.killpg(self.child.pid, signal.SIGKILL)

    def execute(self) -> int:
        manifest = SuiteManifest.load(self.root)
        if manifest.runner_pid != os.getpid() and pid_alive(manifest.runner_pid):
            raise RunDirError(f"suite {self.root} is being run by process {manifest.runner_pid}")
        manifest.runner_pid = os.getpid()
        manifest.save(self.root)
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            for record in manifest.runs:
                if record.state == "completed":
                    continue
                self._run(manifest, record)
                if record.state != "completed":
                    how = "continue with: grpolab suite resume " + str(self.root)
                    self.reporter.line(f"suite stopped at run {record.name} ({record.state}): {record.reason}; {how}")
                    return 130 if record.state == "stopped" else 1
            self.reporter.line(f"suite {manifest.suite}: all {len(manifest.runs)} runs completed; "
                               f"grpolab suite status {self.root}")
            self._report()
            return 0
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _report(self) -> None:
        """The suite's report (``grpolab report``), written once every run completed; a failure to write
        it is said, never a failed suite."""
        from grpolab.report import write_report

        try:
            self.reporter.line(f"report: {write_report(self.root, self.reporter)}")
        except Exception as err:  # the runs are done and safe; the report can be redone by hand
            self.reporter.line(f"report not written ({type(err).__name__}: {err}); grpolab report {self.root}")

    def _command(self, record: RunRecord) -> list[str]:
        """Resume from a complete checkpoint; otherwise start afresh, moving an earlier attempt's
        directory aside (kept, never reused or deleted)."""
        run_dir = Path(record.run_dir)
        if latest_resumable_checkpoint(run_dir, STATE_FILE) is not None:
            return resume_command(run_dir)
        if run_dir.exists() and any(run_dir.iterdir()):
            aside = run_dir.with_name(f"{run_dir.name}.attempt-{len(record.attempts) + 1}")
            run_dir.rename(aside)
            record.attempts.append({"moved_to": str(aside), "at": now()})
        return train_command(Path(record.config_file))

    def _run(self, manifest: SuiteManifest, record: RunRecord) -> None:
        cfg = load_config(record.config_file)
        run_dir, log = Path(record.run_dir), self.root / "logs" / f"{record.name}.log"
        if record.command:
            record.attempts.append({"command": record.command, "exit_code": record.exit_code, "state": record.state,
                                    "reason": record.reason, "started": record.started, "ended": record.ended})
        record.command = self._command(record)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [manifest.code["path"],
                                                                         os.environ.get("PYTHONPATH")]))}
        log.parent.mkdir(exist_ok=True)
        with log.open("a") as out:
            out.write(f"# {now()} {' '.join(record.command)}\n")
            out.flush()
            self.child = subprocess.Popen(record.command, stdout=out, stderr=subprocess.STDOUT, env=env,
                                          cwd=self.root, start_new_session=True)
        record.state, record.pid, record.started, record.ended = "running", self.child.pid, now(), None
        record.exit_code = record.reason = None
        manifest.save(self.root)
        self.reporter.line(f"run {record.name}: started (pid {self.child.pid}), log {log}")
        exit_code = self._wait(record, cfg, run_dir)
        self._classify(record, cfg, run_dir, log, exit_code)
        manifest.save(self.root)
        step, acc = progress_of(run_dir)
        self.reporter.line(f"run {record.name}: {record.state} at step {step}/{cfg.steps}"
                           + (f", val acc {acc:.3f}" if acc is not None else "")
                           + (f" ({record.reason})" if record.reason else ""))

    def _wait(self, record: RunRecord, cfg: RunConfig, run_dir: Path) -> int:
        started = last_line = time.monotonic()
        while True:
            try:
                code = self.child.wait(timeout=POLL_SECONDS)
                self.child = None
                return code
            except subprocess.TimeoutExpired:
                pass
            if time.monotonic() - last_line >= self.reporter.interval:
                step, acc = progress_of(run_dir)
                self.reporter.line(f"run {record.name}: step {step}/{cfg.steps}"
                                   + (f", val acc {acc:.3f}" if acc is not None else "")
                                   + f", {format_seconds(time.monotonic() - started)} elapsed")
                last_line = time.monotonic()

    def _classify(self, record: RunRecord, cfg: RunConfig, run_dir: Path, log: Path, exit_code: int) -> None:
        record.exit_code, record.ended, record.pid = exit_code, now(), None
        missing = completion_problems(run_dir, cfg)
        if exit_code == 0 and not missing:
            checkpoint = final_checkpoint(run_dir, cfg)
            record.state, record.final_checkpoint = "completed", str(checkpoint)
            record.final_checkpoint_sha256 = weights_sha256(checkpoint)
        elif self.signals:
            record.state = "stopped"
            record.reason = f"stopped by a signal (exit code {exit_code}); resumable from its newest checkpoint"
        else:
            record.state = "failed"
            if exit_code == 0:
                record.reason = "exited 0 but lacks " + ", ".join(missing)
            elif exit_code < 0:
                record.reason = f"killed by signal {signal.Signals(-exit_code).name}"
            else:
                record.reason = last_error(log) or f"exit code {exit_code}"


def prepare_suite(suite_file: str | Path, root: Path, console: Console, dry_run: bool = False) -> SuiteManifest | None:
    """Resolve and validate every run; with ``dry_run`` print the configs, commands and checkpoint
    footprint and write nothing; otherwise snapshot code and data into the new ``root`` and write the
    manifest of queued runs."""
    spec = load_suite(suite_file)
    root = root.resolve()
    configs = resolve_runs(spec, root)
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        raise RunDirError(f"suite output root already exists and is not empty: {root} (choose a new --output-root)")
    if dry_run:
        print_plan(spec.name, configs, root, console)
        return None
    for run in spec.runs:  # a start model that cannot load is refused now, not hours into the queue
        path = configs[run.name].model.path
        if run.init_from is None:
            check_model_spec(path)
    root.mkdir(parents=True, exist_ok=True)
    code = snapshot_code(root / "snapshot" / "src")
    data: dict[str, dict[str, Any]] = {}
    records = []
    for run in spec.runs:
        cfg = configs[run.name]
        key = task_key(cfg)
        if key not in data:
            data[key] = snapshot_data(cfg, root / "snapshot" / "data" / key)
        updates = {"task": cfg.task.model_copy(update={k.removeprefix("task."): v
                                                       for k, v in data[key]["task_paths"].items()})}
        if cfg.model.path and run.init_from is None:
            updates["model"] = cfg.model.model_copy(update={"path": absolute_model_spec(cfg.model.path)})
        cfg = cfg.model_copy(update=updates)
        config_file = root / "configs" / f"{run.name}.json"
        config_file.parent.mkdir(exist_ok=True)
        config_file.write_text(json.dumps(cfg.model_dump(mode="json"), indent=2))
        records.append(RunRecord(name=run.name, run_dir=str(cfg.output_dir), config_file=str(config_file),
                                 config_sha256=config_sha256(cfg), init_from=run.init_from, factors=run.factors,
                                 data_sha256={k: data[key][f"{k}_sha256"] for k in ("train", "validation", "prompt")}))
    manifest = SuiteManifest(suite=spec.name, source_file=str(Path(suite_file).resolve()), code=code, runs=records)
    manifest.save(root)
    return manifest


def print_plan(name: str, configs: dict[str, RunConfig], root: Path, console: Console) -> None:
    from grpolab.suite.footprint import checkpoint_bytes

    total = 0
    console.print(f"suite {name}: {len(configs)} runs into {root} (dry run: nothing written)", highlight=False,
                  soft_wrap=True)
    for run_name, cfg in configs.items():
        size = checkpoint_bytes(cfg, configs)
        total += size or 0
        console.print(f"\n[bold]{run_name}[/]: {' '.join(train_command(root / 'configs' / f'{run_name}.json'))}",
                      highlight=False, soft_wrap=True)
        console.print(json.dumps(cfg.model_dump(mode="json"), sort_keys=True), highlight=False, soft_wrap=True)
        console.print(f"checkpoints: {cfg.steps // cfg.checkpoint.every + (cfg.steps % cfg.checkpoint.every != 0)}, "
                      f"about {size / 1e6:.1f} MB" if size is not None else "checkpoints: size unknown", highlight=False)
    console.print(f"\nexpected checkpoint footprint: about {total / 1e6:.1f} MB", highlight=False)


def status_table(root: Path) -> Table:
    manifest = SuiteManifest.load(root)
    table = Table(title=f"suite {manifest.suite} ({root})")
    for column in ("run", "state", "step", "val acc", "time", "reason"):
        table.add_column(column)
    for record in manifest.runs:
        cfg = load_config(record.config_file)
        step, acc = progress_of(Path(record.run_dir))
        state = record.state
        if state == "running" and not pid_alive(record.pid):
            state = "running (process gone: resume)"
        seconds = ""
        if record.started:
            end = time.mktime(time.strptime(record.ended, "%Y-%m-%dT%H:%M:%S%z")) if record.ended else time.time()
            seconds = format_seconds(end - time.mktime(time.strptime(record.started, "%Y-%m-%dT%H:%M:%S%z")))
        table.add_row(record.name, state, f"{step}/{cfg.steps}", "" if acc is None else f"{acc:.3f}", seconds,
                      record.reason or "")
    return table
