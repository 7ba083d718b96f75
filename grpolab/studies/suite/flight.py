"""A run in flight: the job a launcher started for it, or a process an earlier runner left training it
(followed, never signalled), with the devices it holds; and how a run that ended is judged from disk."""

from __future__ import annotations

import signal
from dataclasses import dataclass
from pathlib import Path

from grpolab.config import RunConfig
from grpolab.run.checkpoints import weights_sha256
from grpolab.studies.launchers import Job
from grpolab.studies.manifest import RunRecord, now
from grpolab.studies.suite.completion import completion_problems, last_error, stop_reason
from grpolab.studies.suite.holder import run_holder
from grpolab.studies.suite.spec import final_checkpoint

STOP_EXIT_CODES = (130, -signal.SIGTERM, -signal.SIGINT)  # a trainer stopped by a signal, or killed by one


@dataclass
class Flight:
    """``job`` is None for an orphan: a process still training the run that an earlier runner left, whose
    end is waited for (``run_holder``) before the run is judged."""

    record: RunRecord
    cfg: RunConfig
    job: Job | None
    since: float = 0.0  # time.monotonic() when this runner started or adopted it
    wait: dict | None = None
    stop_asked: str | None = None  # why this runner asked the run to stop

    @property
    def run_dir(self) -> Path:
        return Path(self.record.run_dir)

    def poll(self) -> int | None:
        """The job's exit code once it ended; for an orphan 0 once no process holds the run."""
        if self.job is None:
            return None if run_holder(self.record) is not None else 0
        return self.job.poll()


def complete(record: RunRecord, cfg: RunConfig) -> None:
    """Mark a run completed, with its final checkpoint and that checkpoint's weights' SHA-256 (from its
    checkpoint.json: the weights are not read again)."""
    checkpoint = final_checkpoint(Path(record.run_dir), cfg)
    record.state, record.final_checkpoint, record.reason = "completed", str(checkpoint), None
    record.final_checkpoint_sha256 = weights_sha256(checkpoint)


def classify(flight: Flight, log: Path, exit_code: int, note: str | None = None) -> None:
    """Completed (exit 0 and complete on disk); stopped (asked by this runner, or ended by a signal from
    outside: a Ctrl-C, a kill, a Slurm cancel or time limit), resumable from its newest checkpoint; or
    failed, with the reason from its log."""
    record, run_dir = flight.record, flight.run_dir
    record.exit_code, record.ended, record.pid = exit_code, now(), None
    missing = completion_problems(run_dir, flight.cfg)
    if exit_code == 0 and not missing:
        complete(record, flight.cfg)
    elif flight.stop_asked or exit_code in STOP_EXIT_CODES:
        why = flight.stop_asked or note or "a signal from outside the suite"
        record.state, record.reason = "stopped", f"{why}: {stop_reason(run_dir, exit_code)}"
    else:
        record.state = "failed"
        if exit_code == 0:
            record.reason = "exited 0 but lacks " + ", ".join(missing)
        elif exit_code < 0:
            record.reason = f"killed by signal {signal.Signals(-exit_code).name}"
        else:
            record.reason = last_error(log) or note or f"exit code {exit_code}"
