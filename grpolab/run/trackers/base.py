"""The interface every tracker implements, and the fan-out the trainer writes to.

A tracker receives what ``metrics.jsonl`` receives: each record's numbers at its step (a training step's
metrics, an evaluation's ``val/...`` metrics at its step), and now and then a table of sampled completions.
A tracker that fails (a network error, a full disk) is dropped with one warning line: the run and its
``metrics.jsonl`` go on without it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol


def numbers(record: dict[str, Any]) -> dict[str, float]:
    """The numeric metrics of a record (``step`` itself, booleans, strings and nulls left out)."""
    return {k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


class Tracker(Protocol):
    """One tracker's run. ``resends``: whether a step it already holds may be sent again (TensorBoard rewrites
    from a purge step; W&B and Trackio keep what they hold, so a resume does not send those steps again)."""

    name: str
    resends: bool
    mode: str  # how it logs: W&B's online / offline, Trackio's local / space, TensorBoard's local

    def describe(self) -> str:
        """One line: where its run is and how to look at it."""

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """The numbers of one record at ``step``."""

    def table(self, step: int, key: str, columns: list[str], rows: list[list[Any]]) -> None:
        """A table (rows of ``columns``) at ``step`` under ``key``."""

    def close(self, finished: bool) -> None:
        """End this session: ``finished`` marks the tracker's run finished; otherwise it stays resumable."""


class Trackers:
    """The open trackers, written together. ``sent_through``: the last step a previous session of this run may
    have sent (a resume redoes the steps after its checkpoint; trackers that keep what they hold do not get
    those steps again). ``warn`` hears one line when a tracker fails and is dropped."""

    def __init__(self, trackers: list[Tracker], sent_through: int, warn: Callable[[str], None]):
        self.open, self.sent_through, self.warn = list(trackers), sent_through, warn

    def _each(self, step: int, call: Callable[[Tracker], None]) -> None:
        for tracker in list(self.open):
            if step <= self.sent_through and not tracker.resends:
                continue
            try:
                call(tracker)
            except Exception as err:  # never the run's end: metrics.jsonl holds everything
                self.open.remove(tracker)
                why = (str(err).strip().splitlines() or [type(err).__name__])[0]
                self.warn(
                    f"warning: log.trackers {tracker.name} failed ({type(err).__name__}: {why}); it is off for "
                    "the rest of this session, metrics.jsonl stays complete"
                )
                try:
                    tracker.close(finished=False)
                except Exception:
                    pass

    def log(self, record: dict[str, Any]) -> None:
        """A metrics record (``step`` and its values) to every tracker."""
        metrics = numbers(record)
        if metrics:
            self._each(record["step"], lambda t: t.log(record["step"], metrics))

    def table(self, step: int, key: str, columns: list[str], rows: list[list[Any]]) -> None:
        if rows:
            self._each(step, lambda t: t.table(step, key, columns, rows))

    def close(self, finished: bool) -> None:
        """Close every tracker (a failing close is a warning line); safe to call twice."""
        while self.open:
            tracker = self.open.pop(0)
            try:
                tracker.close(finished)
            except Exception as err:
                self.warn(f"warning: log.trackers {tracker.name} did not close cleanly ({type(err).__name__}: {err})")
