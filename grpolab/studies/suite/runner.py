"""Running a suite: its runs one at a time, each in its own process started from the snapshot; the first
run that does not complete stops the queue. Nothing is retried automatically and no setting changes;
``resume`` continues at the first unfinished run (from its newest verified checkpoint when it has one).

Before anything moves, the suite's recorded configs, code and data are verified (``grpolab.studies.suite.verify``).
A run is judged from its directory alone (``grpolab.studies.suite.completion``), and never gets a second trainer:
a process still training it (left by a runner that died) is waited for first (``grpolab.studies.suite.holder``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from grpolab.run.checkpoints import newest_verified, weights_sha256
from grpolab.config import RunConfig, load_config
from grpolab.common.progress import Reporter, format_seconds
from grpolab.run.state import STATE_FILE
from grpolab.run.rundir import RunDirError
from grpolab.studies.suite.completion import completion_problems, last_error, progress_of, stop_reason
from grpolab.studies.suite.holder import run_holder
from grpolab.studies.manifest import RunRecord, SuiteManifest, now, pid_alive
from grpolab.studies.suite.prepare import prepare_suite, resume_command, train_command
from grpolab.studies.suite.spec import final_checkpoint
from grpolab.studies.suite.verify import verify_suite

__all__ = ["SuiteRunner", "completion_problems", "last_error", "prepare_suite", "progress_of", "status_table"]

POLL_SECONDS = 0.5
ATTEMPTS_DIR = "attempts"


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
        """Run (or resume) every run that is not completed, in order; 0 when all completed, 130 when a
        signal stopped the suite, 1 when a run failed."""
        manifest = SuiteManifest.load(self.root)
        if manifest.runner_pid != os.getpid() and pid_alive(manifest.runner_pid):
            raise RunDirError(f"suite {self.root} is being run by process {manifest.runner_pid}")
        verify_suite(self.root, manifest)
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
                    return 130 if record.state == "stopped" or self.signals else 1
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
        from grpolab.studies.report import write_report

        try:
            self.reporter.line(f"report: {write_report(self.root, self.reporter)}")
        except Exception as err:  # the runs are done and safe; the report can be redone by hand
            self.reporter.line(f"report not written ({type(err).__name__}: {err}); grpolab report {self.root}")

    def _run(self, manifest: SuiteManifest, record: RunRecord) -> None:
        """One run: wait for a process still training it, then judge it from disk: complete (nothing is
        started), or started afresh or resumed, waited for and classified."""
        cfg = load_config(record.config_file)
        run_dir = Path(record.run_dir)
        if not self._wait_for_holder(manifest, record, cfg):
            return
        if not completion_problems(run_dir, cfg):
            self._complete(record, cfg, run_dir)
            record.pid, record.ended = None, record.ended or now()
            manifest.save(self.root)
            self.reporter.line(f"run {record.name}: complete on disk ({progress_of(run_dir).describe(cfg.steps)}): "
                               "completed, nothing started")
            return
        log = self.root / "logs" / f"{record.name}.log"
        self._start(manifest, record, log)
        exit_code = self._wait(record, cfg, run_dir)
        self._classify(record, cfg, run_dir, log, exit_code)
        manifest.save(self.root)
        self.reporter.line(f"run {record.name}: {record.state} at {progress_of(run_dir).describe(cfg.steps)}"
                           + (f" ({record.reason})" if record.reason else ""))

    def _wait_for_holder(self, manifest: SuiteManifest, record: RunRecord, cfg: RunConfig) -> bool:
        """Wait for a live process still training the run (one left by a runner that died) to end, with a
        line at the reporter's steady interval, and record the wait; False when a signal stopped this
        runner meanwhile (that process is left alone and goes on)."""
        pid = run_holder(record)
        if pid is None:
            return True
        wait = {"pid": pid, "since": now(), "until": None}
        record.waits.append(wait)
        record.state, record.pid = "running", pid or record.pid
        manifest.save(self.root)
        last_line = float("-inf")
        try:
            while pid is not None:
                if time.monotonic() - last_line >= self.reporter.interval:
                    self.reporter.line(f"run {record.name}: waiting for process {pid or '(pid unreadable)'} "
                                       "(left training by an earlier runner) to end; "
                                       + progress_of(Path(record.run_dir)).describe(cfg.steps))
                    last_line = time.monotonic()
                time.sleep(POLL_SECONDS)
                pid = run_holder(record)
        except KeyboardInterrupt:
            wait["interrupted"] = now()
            record.reason = (f"this runner was stopped while waiting for process {wait['pid']}, which goes on "
                             "training the run; suite resume waits for it again")
            manifest.save(self.root)
            return False
        wait["until"] = now()
        record.pid, record.reason = None, f"process {wait['pid']} was left training by an earlier runner; waited for it"
        manifest.save(self.root)
        return True

    def _start(self, manifest: SuiteManifest, record: RunRecord, log: Path) -> None:
        """Archive the previous attempt, choose the command and start it in its own session from the
        code snapshot, its output appended to the run's log."""
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

    def _command(self, record: RunRecord) -> list[str]:
        """Resume from the newest verified checkpoint; otherwise start afresh, an earlier attempt's
        directory moved aside first."""
        run_dir = Path(record.run_dir)
        if newest_verified(run_dir, (STATE_FILE,)).checkpoint is not None:
            return resume_command(run_dir)
        if run_dir.exists() and any(run_dir.iterdir()):
            record.attempts.append({"moved_to": str(self._move_aside(record)), "at": now()})
        return train_command(Path(record.config_file))

    def _move_aside(self, record: RunRecord) -> Path:
        """The run directory to ROOT/attempts/NAME/attempt-N, the first N not taken (kept, never reused or
        deleted; apart from runs/, so no run name can collide with it)."""
        folder = self.root / ATTEMPTS_DIR / record.name
        folder.mkdir(parents=True, exist_ok=True)
        n = 1
        while (folder / f"attempt-{n}").exists():
            n += 1
        return Path(record.run_dir).rename(folder / f"attempt-{n}")

    def _wait(self, record: RunRecord, cfg: RunConfig, run_dir: Path) -> int:
        """The child's exit code, with a progress line at the reporter's steady interval meanwhile."""
        started = last_line = time.monotonic()
        while True:
            try:
                code = self.child.wait(timeout=POLL_SECONDS)
                self.child = None
                return code
            except subprocess.TimeoutExpired:
                pass
            if time.monotonic() - last_line >= self.reporter.interval:
                self.reporter.line(f"run {record.name}: {progress_of(run_dir).describe(cfg.steps)}, "
                                   f"{format_seconds(time.monotonic() - started)} elapsed")
                last_line = time.monotonic()

    def _complete(self, record: RunRecord, cfg: RunConfig, run_dir: Path) -> None:
        """Mark a run completed, with its final checkpoint and that checkpoint's weights' SHA-256 (from its
        checkpoint.json: the weights are not read again)."""
        checkpoint = final_checkpoint(run_dir, cfg)
        record.state, record.final_checkpoint, record.reason = "completed", str(checkpoint), None
        record.final_checkpoint_sha256 = weights_sha256(checkpoint)

    def _classify(self, record: RunRecord, cfg: RunConfig, run_dir: Path, log: Path, exit_code: int) -> None:
        """Completed (exit 0 and complete on disk), stopped (by a signal to this runner) or failed, with why."""
        record.exit_code, record.ended, record.pid = exit_code, now(), None
        missing = completion_problems(run_dir, cfg)
        if exit_code == 0 and not missing:
            self._complete(record, cfg, run_dir)
        elif self.signals:
            record.state, record.reason = "stopped", stop_reason(run_dir, exit_code)
        else:
            record.state = "failed"
            if exit_code == 0:
                record.reason = "exited 0 but lacks " + ", ".join(missing)
            elif exit_code < 0:
                record.reason = f"killed by signal {signal.Signals(-exit_code).name}"
            else:
                record.reason = last_error(log) or f"exit code {exit_code}"


def status_table(root: Path) -> Table:
    """Each run's state, step (and unreadable metrics lines), last validation accuracy, time and reason."""
    manifest = SuiteManifest.load(root)
    table = Table(title=f"suite {manifest.suite} ({root})")
    for column in ("run", "state", "step", "val acc", "time", "reason"):
        table.add_column(column)
    for record in manifest.runs:
        cfg = load_config(record.config_file)
        progress = progress_of(Path(record.run_dir))
        state = record.state
        if state == "running" and not pid_alive(record.pid):
            state = "running (process gone: resume)"
        seconds = ""
        if record.started:
            end = time.mktime(time.strptime(record.ended, "%Y-%m-%dT%H:%M:%S%z")) if record.ended else time.time()
            seconds = format_seconds(end - time.mktime(time.strptime(record.started, "%Y-%m-%dT%H:%M:%S%z")))
        table.add_row(record.name, state, f"{progress.step}/{cfg.steps}{progress.skipped_note()}",
                      "" if progress.accuracy is None else f"{progress.accuracy:.3f}", seconds, record.reason or "")
    return table
