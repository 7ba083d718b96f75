"""Stopping a run at a step boundary (Ctrl-C / SIGTERM) so that it can be resumed exactly."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StopRequest:
    """A graceful stop: while ``armed`` (the training loop runs), a signal handler sets ``requested``
    instead of raising, and the loop ends the current step, writes a resumable checkpoint and raises
    ``RunStopped``; ``requested_at``: when (``time.monotonic``)."""

    armed: bool = False
    requested: bool = False
    requested_at: float = 0.0


class RunStopped(Exception):
    """The run stopped at a step boundary on request; the message says how to resume."""
