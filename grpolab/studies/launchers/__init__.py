"""Where a suite's runs execute: ``local`` (child processes of the runner, each in its own session) or
``slurm`` (one batch job per run, written as an sbatch script the suite keeps). A launcher starts a run's
command and hands back a job the runner polls, stops at a step boundary or kills."""

from __future__ import annotations

from typing import Protocol


class LaunchError(RuntimeError):
    """A launcher could not start, stop or follow a job; the message is its one-line reason."""


class Job(Protocol):
    """A started run: ``ident`` is a pid or a Slurm job id."""

    ident: str
    note: str | None  # why the job ended, when its launcher knows more than the exit code says

    def poll(self) -> int | None:
        """The exit code once the run's command ended (negative: killed by that signal), else None."""

    def stop(self) -> None:
        """Ask the run to stop after its current step with a checkpoint (SIGTERM to its trainer)."""

    def kill(self) -> None:
        """End the run at once."""

    def where(self) -> dict[str, str | None]:
        """What the launcher knows of where the job runs (host; Slurm: job id, state)."""
