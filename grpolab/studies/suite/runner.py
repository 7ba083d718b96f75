"""Running a suite: each run in its own process (or torchrun job, or Slurm batch job) started from the
snapshot, as many at once as the placement allows (``grpolab.studies.suite.placement``; without devices,
one at a time). The first run that does not complete stops the queue: runs not started stay queued, runs
already running are asked to stop after their step with a checkpoint. Nothing is retried automatically
and no setting changes; ``resume`` places the unfinished runs again (each from its newest verified
checkpoint when it has one).

Before anything moves, the suite's recorded configs, code and data are verified (``grpolab.studies.suite.verify``);
before each attempt of a run starts, its reward models' folders are (a changed one fails the run).
A run is judged from its directory alone (``grpolab.studies.suite.completion``), and never gets a second trainer:
a process still training it (left by a runner that died) is waited for first (``grpolab.studies.suite.holder``),
and a Slurm job still queued or running for it is followed, never submitted again.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from grpolab.common.progress import Reporter, format_seconds
from grpolab.config import ConfigError, load_config
from grpolab.run.checkpoints import newest_verified
from grpolab.run.rundir import RunDirError
from grpolab.run.state import STATE_FILE
from grpolab.studies.launchers import LaunchError
from grpolab.studies.manifest import DONE, RunRecord, SuiteManifest, now, pid_alive
from grpolab.studies.suite.completion import completion_problems, last_error, last_session_where, progress_of
from grpolab.studies.suite.flight import Flight, classify, complete
from grpolab.studies.suite.holder import run_holder
from grpolab.studies.suite.launch import LocalLauncher, SuiteLauncher, suite_launcher
from grpolab.studies.suite.placement import ONE_AT_A_TIME, DevicePool, next_to_start, parse_devices
from grpolab.studies.suite.prepare import prepare_suite, resume_command, train_command
from grpolab.studies.suite.rounds import Rounds
from grpolab.studies.suite.status import status_table
from grpolab.studies.suite.verify import reward_model_problem, start_checkpoint_problem, verify_suite

__all__ = ["SuiteRunner", "completion_problems", "last_error", "prepare_suite", "progress_of", "status_table"]

POLL_SECONDS = 0.5
ATTEMPTS_DIR = "attempts"


class SuiteRunner:
    """Executes the manifest of the suite in ``root``; ``devices`` (resume) places the runs on another list."""

    def __init__(self, root: Path, console: Console, devices: str | None = None, run_dropped: list[str] | None = None):
        self.root, self.console, self.devices, self.run_dropped = root, console, devices, run_dropped
        self.reporter = Reporter(console)
        self.signals = 0
        self.flights: dict[str, Flight] = {}
        self.stopping: str | None = None
        self.launcher: SuiteLauncher | None = None  # the manifest's, once the loop starts
        self.pool: DevicePool | None = None  # None: the launcher's scheduler (Slurm) places the runs
        self.placed = False  # runs on listed devices (else one at a time on whatever each run sees)
        self.first_stop: str | None = None  # the run whose end stopped the queue
        self.rounds: Rounds | None = None  # a decision suite's rounds ([decide])

    # ---- signals: the first stops every running run at a step boundary, the second kills them --------
    def _on_signal(self, signum: int, frame: Any) -> None:
        self.signals += 1
        name = signal.Signals(signum).name
        if self.signals == 1:
            self.reporter.line(
                f"{name}: stopping every running run after its step (with a checkpoint); again to kill them"
            )
            self._stop_all(f"stopped by {name} to the suite runner")
            return
        for flight in self.flights.values():
            if flight.job is not None:
                flight.job.kill()

    def _stop_all(self, why: str) -> None:
        """Stop the queue: a run this runner started is asked to stop after its step; a process an earlier
        runner left training a run is left alone (resume waits for it again)."""
        self.stopping = self.stopping or why
        for name, flight in list(self.flights.items()):
            if flight.job is None:
                flight.wait["interrupted"] = now()
                flight.record.reason = (
                    f"this runner was stopped while waiting for process {flight.wait['pid']}, "
                    "which goes on training the run; suite resume waits for it again"
                )
                del self.flights[name]
            elif not flight.stop_asked:
                flight.stop_asked = why
                try:
                    flight.job.stop()
                except LaunchError as err:
                    self.reporter.line(f"run {name}: {err}")

    def execute(self) -> int:
        """Run (or resume) every run that is not completed; 0 when all completed, 1 when a run failed, 130
        when a signal (to the runner or to a run) stopped the suite."""
        manifest = SuiteManifest.load(self.root)
        self._claim(manifest)
        verify_suite(self.root, manifest)
        if manifest.decide is not None:
            self.rounds = Rounds(manifest)
            self.rounds.check()
            if self.run_dropped:
                for line in self.rounds.run_dropped(self.run_dropped):
                    self.reporter.line(line)
        elif self.run_dropped:
            raise ValueError("--run-dropped applies to a suite with [decide]; this one runs every run")
        if self.devices is not None:
            self._replace_devices(manifest)
        manifest.runner_pid, manifest.runner_host, manifest.runner_seen = os.getpid(), socket.gethostname(), time.time()
        manifest.save(self.root)
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            self._loop(manifest)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            manifest.runner_seen = None
            manifest.save(self.root)
        return self._outcome(manifest)

    def _claim(self, manifest: SuiteManifest) -> None:
        """Refuse a suite another live runner is running: by pid on this host; on another host (a login
        node), when that runner wrote within the last few heartbeats."""
        here = manifest.runner_host in (None, socket.gethostname())
        if here and manifest.runner_pid != os.getpid() and pid_alive(manifest.runner_pid):
            raise RunDirError(f"suite {self.root} is being run by process {manifest.runner_pid}")
        recent = manifest.runner_seen is not None and time.time() - manifest.runner_seen < 3 * self.reporter.interval
        if not here and recent:
            raise RunDirError(
                f"suite {self.root} is being run by process {manifest.runner_pid} on "
                f"{manifest.runner_host} (it wrote {time.time() - manifest.runner_seen:.0f} s ago)"
            )

    def _replace_devices(self, manifest: SuiteManifest) -> None:
        suite_launcher(manifest.placement).refuse_device_list()
        devices = parse_devices(self.devices)
        widest = max(manifest.runs, key=lambda record: record.world_size)
        if widest.world_size > len(devices):
            raise ValueError(f"run {widest.name} needs {widest.world_size} devices; only {len(devices)} are listed")
        manifest.placement = {**manifest.placement, "launcher": LocalLauncher.name, "devices": devices}

    # ---- the loop: start what fits, land what ended, a progress line per run at a steady interval ------
    def _loop(self, manifest: SuiteManifest) -> None:
        self.launcher = suite_launcher(manifest.placement)
        self.placed = bool(self.launcher.devices)
        self.pool = self.launcher.device_pool()
        for record in manifest.runs:
            if record.state == "running":
                self._adopt(manifest, record)
        last_line = float("-inf")
        while True:
            for flight in list(self.flights.values()):
                code = flight.poll()
                if code is not None and flight.record.name in self.flights:
                    self._land(manifest, flight, code)
                elif flight.job is not None:
                    self._follow(manifest, flight)
            if self.rounds is not None:
                self._decide(manifest)
            if not self.stopping:
                self._start_what_fits(manifest)
            if not self.flights:
                return
            if time.monotonic() - last_line >= self.reporter.interval:
                for flight in self.flights.values():
                    self._progress_line(flight)
                manifest.runner_seen = time.time()
                manifest.save(self.root)
                last_line = time.monotonic()
            time.sleep(POLL_SECONDS)

    def _decide(self, manifest: SuiteManifest) -> None:
        """A decision suite: decide each round whose runs have ended, and drop the runs no longer needed."""
        lines = self.rounds.decide()
        if lines:
            manifest.save(self.root)
            for line in lines:
                self.reporter.line(line)

    def _follow(self, manifest: SuiteManifest, flight: Flight) -> None:
        """A Slurm job's state (PENDING, RUNNING, ...) and node into the manifest as they change."""
        where, record = flight.job.where(), flight.record
        if where.get("job_state") != record.job_state:
            record.job_state, record.host = where.get("job_state"), where.get("host") or record.host
            manifest.save(self.root)

    def _need(self, record: RunRecord) -> int:
        return record.world_size if self.placed else 1

    def _start_what_fits(self, manifest: SuiteManifest) -> None:
        while not self.stopping:
            completed = {r.name for r in manifest.runs if r.state == "completed"}
            waiting = [
                r
                for r in manifest.runs
                if r.state not in DONE
                and r.name not in self.flights
                and (self.rounds is None or self.rounds.may_start(r))
            ]
            record = next_to_start(
                waiting, completed, lambda r: self.pool is None or len(self.pool.free()) >= self._need(r)
            )
            if record is None:
                return
            try:
                cfg = load_config(record.config_file)
            except ConfigError:  # a changed reward model may not validate: said below as what changed
                cfg = None
            holder = run_holder(record) if cfg is not None else None
            if holder is not None:  # trained by a process this runner did not start: waited for, never joined
                self._wait_for(manifest, record, cfg, holder)
                continue
            if cfg is not None and not completion_problems(Path(record.run_dir), cfg):
                complete(record, cfg)
                record.pid, record.ended = None, record.ended or now()
                manifest.save(self.root)
                self.reporter.line(
                    f"run {record.name}: complete on disk "
                    f"({progress_of(Path(record.run_dir)).describe(cfg.steps)}): completed, nothing started"
                )
                continue
            problem = start_checkpoint_problem(record, manifest) or reward_model_problem(record, self.reporter)
            if problem is not None:
                self._refuse(manifest, record, problem)
                return
            cfg = cfg or load_config(record.config_file)
            devices = self.pool.take(record.name, self._need(record)) if self.pool is not None else None
            self._launch(manifest, record, cfg, devices if self.placed else None)

    def _adopt(self, manifest: SuiteManifest, record: RunRecord) -> None:
        """A run an earlier runner left 'running': its Slurm job is followed while Slurm still runs it; a
        local process still training it is waited for (holding its devices); otherwise it is judged when
        placed again."""
        cfg = load_config(record.config_file)
        job = self.launcher.follow(self.root, record)
        if job is not None:
            self.flights[record.name] = Flight(record, cfg, job, since=time.monotonic())
            if job.poll() is None:
                state = job.where().get("job_state")
                self.reporter.line(
                    f"run {record.name}: following Slurm job {job.ident} ({state}), submitted by an earlier runner"
                )
            return
        pid = run_holder(record)
        if pid is not None:
            self._wait_for(manifest, record, cfg, pid)

    def _wait_for(self, manifest: SuiteManifest, record: RunRecord, cfg, pid: int) -> None:
        """Follow process ``pid``, still training the run though no runner of this suite follows it, until no
        process holds the run (its devices held meanwhile); then the run is judged from disk."""
        flight = Flight(record, cfg, None, wait={"pid": pid, "since": now(), "until": None}, since=time.monotonic())
        record.waits.append(flight.wait)
        record.state, record.pid = "running", pid or record.pid
        if self.pool is not None:
            self.pool.hold(record.name, record.devices or [ONE_AT_A_TIME])
        self.flights[record.name] = flight
        manifest.save(self.root)
        self._progress_line(flight)

    @staticmethod
    def _archive_attempt(record: RunRecord) -> None:
        if record.command:
            record.attempts.append(
                {
                    "command": record.command,
                    "exit_code": record.exit_code,
                    "state": record.state,
                    "reason": record.reason,
                    "started": record.started,
                    "ended": record.ended,
                    "devices": record.devices,
                    "host": record.host,
                    "job_id": record.job_id,
                    "job_state": record.job_state,
                }
            )

    def _refuse(self, manifest: SuiteManifest, record: RunRecord, reason: str) -> None:
        """A run that must not start (its reward model changed, or the checkpoint it starts from): failed with
        ``reason``, nothing started or
        moved, and the queue stopped as a failed run stops it."""
        self._archive_attempt(record)
        record.command, record.state, record.reason, record.ended = [], "failed", reason, now()
        record.started = record.exit_code = record.pid = record.job_id = record.job_state = record.host = None
        record.devices = None
        self.reporter.line(f"run {record.name}: failed, not started ({reason})")
        self.first_stop = self.first_stop or record.name
        self._stop_all(f"stopped because run {record.name} failed")
        manifest.save(self.root)

    def _launch(self, manifest: SuiteManifest, record: RunRecord, cfg, devices: list[str] | None) -> None:
        """Archive the previous attempt, choose the command and start it from the code snapshot on its
        devices (or submit it to Slurm), its output appended to the run's log."""
        self._archive_attempt(record)
        record.command = self._command(record)
        env = {"PYTHONPATH": os.pathsep.join(filter(None, [manifest.code["path"], os.environ.get("PYTHONPATH")]))}
        if devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
        log = self.root / "logs" / f"{record.name}.log"
        log.parent.mkdir(exist_ok=True)
        record.state, record.started, record.ended, record.devices = "running", now(), None, devices
        record.exit_code = record.reason = record.pid = record.job_id = record.job_state = record.host = None
        manifest.save(self.root)  # recorded before it starts: a runner killed meanwhile leaves it 'running'
        try:
            job, started = self.launcher.start(self.root, manifest.suite, record, env, log)
        except LaunchError as err:
            if self.pool is not None:
                self.pool.release(record.name)
            record.state, record.reason, record.ended = "failed", str(err), now()
            manifest.save(self.root)
            self.first_stop = self.first_stop or record.name
            self._stop_all(f"stopped because run {record.name} could not be submitted")
            return
        self.flights[record.name] = Flight(record, cfg, job, since=time.monotonic())
        if self.stopping:  # a signal came while it started
            self._stop_all(self.stopping)
        manifest.save(self.root)
        on = f" on devices {','.join(devices)}" if devices else ""
        self.reporter.line(f"run {record.name}: {started}{on}, log {log}")

    def _command(self, record: RunRecord) -> list[str]:
        """Resume from the newest verified checkpoint; otherwise start afresh, an earlier attempt's
        directory moved aside first."""
        run_dir = Path(record.run_dir)
        if newest_verified(run_dir, (STATE_FILE,)).checkpoint is not None:
            return resume_command(run_dir, record.world_size)
        if run_dir.exists() and any(run_dir.iterdir()):
            record.attempts.append({"moved_to": str(self._move_aside(record)), "at": now()})
        return train_command(Path(record.config_file), record.world_size)

    def _move_aside(self, record: RunRecord) -> Path:
        """The run directory to ROOT/attempts/NAME/attempt-N, the first N not taken (kept, never reused or
        deleted; apart from runs/, so no run name can collide with it)."""
        folder = self.root / ATTEMPTS_DIR / record.name
        folder.mkdir(parents=True, exist_ok=True)
        n = 1
        while (folder / f"attempt-{n}").exists():
            n += 1
        return Path(record.run_dir).rename(folder / f"attempt-{n}")

    def _land(self, manifest: SuiteManifest, flight: Flight, code: int) -> None:
        """A run whose job ended (or whose orphan process is gone) is judged from disk and recorded; one
        that did not complete stops the queue."""
        record = flight.record
        del self.flights[record.name]
        if self.pool is not None:
            self.pool.release(record.name)
        progress = progress_of(flight.run_dir).describe(flight.cfg.steps)
        if flight.job is None:
            flight.wait["until"] = now()
            record.pid = None
            record.reason = f"process {flight.wait['pid']} was left training by an earlier runner; waited for it"
            if not completion_problems(flight.run_dir, flight.cfg):
                complete(record, flight.cfg)
                record.ended = record.ended or now()
                self.reporter.line(f"run {record.name}: complete on disk ({progress}): completed, nothing started")
            manifest.save(self.root)
            return
        seen = last_session_where(flight.run_dir)  # what the run itself saw (on a Slurm node: its devices)
        record.host = seen.get("host") or flight.job.where().get("host") or record.host
        record.devices = record.devices or (seen["devices"].split(",") if seen.get("devices") else None)
        record.job_state = flight.job.where().get("job_state")
        classify(flight, self.root / "logs" / f"{record.name}.log", code, flight.job.note)
        manifest.save(self.root)
        self.reporter.line(
            f"run {record.name}: {record.state} at {progress}" + (f" ({record.reason})" if record.reason else "")
        )
        if record.state != "completed" and not self.stopping:
            self.first_stop = record.name
            self._stop_all(f"stopped because run {record.name} {record.state}")
            manifest.save(self.root)

    def _progress_line(self, flight: Flight) -> None:
        progress = progress_of(flight.run_dir).describe(flight.cfg.steps)
        name = flight.record.name
        if flight.job is None:
            self.reporter.line(
                f"run {name}: waiting for process {flight.wait['pid'] or '(pid unreadable)'} "
                f"(left training by an earlier runner) to end; {progress}"
            )
            return
        state = flight.job.where().get("job_state")
        self.reporter.line(
            f"run {name}: {progress}, {format_seconds(time.monotonic() - flight.since)} elapsed"
            + (f" (Slurm job {flight.job.ident} {state})" if state else "")
        )

    def _outcome(self, manifest: SuiteManifest) -> int:
        """The suite's exit code and closing line; the report once every run completed."""
        unfinished = [r for r in manifest.runs if r.state not in DONE]
        if not unfinished:
            ran = sum(r.state == "completed" for r in manifest.runs)
            self.reporter.line(
                f"suite {manifest.suite}: all {len(manifest.runs)} runs completed; grpolab suite status {self.root}"
                if ran == len(manifest.runs)
                else f"suite {manifest.suite}: decided; {ran} of {len(manifest.runs)} runs completed, the others "
                f"dropped; grpolab suite status {self.root}"
            )
            self._report()
            return 0
        first = next(
            (r for r in unfinished if r.name == self.first_stop),
            next((r for r in unfinished if r.state in ("failed", "stopped")), unfinished[0]),
        )
        self.reporter.line(
            f"suite stopped at run {first.name} ({first.state}): {first.reason}; "
            f"continue with: grpolab suite resume {self.root}"
        )
        return 1 if any(r.state == "failed" for r in manifest.runs) else 130

    def _report(self) -> None:
        """The suite's report (``grpolab report``), written once every run completed; a failure to write
        it is said, never a failed suite."""
        from grpolab.studies.report import write_report

        try:
            self.reporter.line(f"report: {write_report(self.root, self.reporter)}")
        except Exception as err:  # the runs are done and safe; the report can be redone by hand
            self.reporter.line(f"report not written ({type(err).__name__}: {err}); grpolab report {self.root}")
