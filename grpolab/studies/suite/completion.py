"""What a run directory says about its run, read from disk alone: whether it is complete, how far it got,
why it failed and what a stop leaves to resume."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import NamedTuple

from grpolab.config import RunConfig
from grpolab.run.checkpoints import newest_verified, problem
from grpolab.run.rundir import read_json_lines
from grpolab.run.state import STATE_FILE
from grpolab.studies.suite.spec import final_checkpoint


def completion_problems(run_dir: Path, cfg: RunConfig) -> list[str]:
    """What a completed run must have and this one lacks: the final training record, the final
    validation record and a final checkpoint whose files match its checkpoint.json (with the run's state).
    Unreadable metrics lines (one torn by a kill) are skipped, never fatal."""
    last = [r for r in read_json_lines(run_dir / "metrics.jsonl").records if r.get("step") == cfg.steps]
    missing = []
    if not any("reward_mean" in r for r in last):
        missing.append(f"the training record of step {cfg.steps}")
    if not any("val/accuracy" in r for r in last):
        missing.append(f"the validation record of step {cfg.steps}")
    checkpoint = final_checkpoint(run_dir, cfg)
    why = problem(checkpoint, (STATE_FILE,)) if checkpoint.is_dir() else "absent"
    if why is not None:
        missing.append(f"the final checkpoint {checkpoint.name} ({why})")
    return missing


class Progress(NamedTuple):
    """How far a run got: its last step with a training record, its last validation accuracy, and how
    many lines of its metrics could not be read."""

    step: int
    accuracy: float | None
    skipped: int

    def describe(self, steps: int) -> str:
        """'step 2/3, val acc 0.250 (1 unreadable metrics line skipped)'."""
        return (
            f"step {self.step}/{steps}"
            + (f", val acc {self.accuracy:.3f}" if self.accuracy is not None else "")
            + self.skipped_note()
        )

    def skipped_note(self) -> str:
        if not self.skipped:
            return ""
        return f" ({self.skipped} unreadable metrics line{'s' if self.skipped > 1 else ''} skipped)"


def progress_of(run_dir: Path) -> Progress:
    """The ``Progress`` of a run so far, from its readable metrics lines."""
    lines = read_json_lines(Path(run_dir) / "metrics.jsonl")
    steps = [r["step"] for r in lines.records if "reward_mean" in r and isinstance(r.get("step"), int)]
    vals = [r["val/accuracy"] for r in lines.records if isinstance(r.get("val/accuracy"), (int, float))]
    return Progress(max(steps, default=0), vals[-1] if vals else None, lines.skipped)


def last_session_where(run_dir: Path) -> dict:
    """Where the run's latest session ran, as its manifest.json recorded it (host, devices, Slurm job,
    world size); empty when unknown."""
    try:
        sessions = json.loads((Path(run_dir) / "manifest.json").read_text()).get("sessions") or [{}]
    except (OSError, ValueError, AttributeError):
        return {}
    where = sessions[-1].get("where") if isinstance(sessions[-1], dict) else None
    return where if isinstance(where, dict) else {}


def last_error(log: Path) -> str | None:
    """The reason in a run's log: its last 'error:' line (the one-line reason grpolab gives), else the last
    line of a traceback ('SomeError: ...')."""
    lines = log.read_text(errors="replace").splitlines() if log.is_file() else []
    errors = [line.removeprefix("error:").strip() for line in lines if line.startswith("error:")]
    raised = [line for line in lines if re.match(r"^[A-Za-z_.]*(Error|Exception|Interrupt)\b", line)]
    return (errors or raised or [None])[-1]


def stop_reason(run_dir: Path, exit_code: int) -> str:
    """Why a run stopped by a signal is resumable, or that it starts afresh: only a verified checkpoint
    is resumed from."""
    checkpoint = newest_verified(run_dir, (STATE_FILE,)).checkpoint
    if checkpoint is None:
        return f"stopped by a signal (exit code {exit_code}) before its first checkpoint; suite resume starts it afresh"
    return f"stopped by a signal (exit code {exit_code}); resumable from its newest checkpoint {checkpoint.name}"
