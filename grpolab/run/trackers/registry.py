"""The trackers by ``log.trackers`` name, each registered once in its own module with what a run does with it:
the checks before anything on disk moves, the tracker run a new run logs to (or the one a resume continues), and
the factory that starts it. Every name is one ``grpolab.common.tracker_names`` declares (the config's choices)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpolab.common.tracker_names import TRACKER_NAMES
from grpolab.config import LogConfig
from grpolab.run.trackers.base import Tracker


@dataclass(frozen=True)
class TrackerStart:
    """What a tracker starts from: the ``[log]`` settings, the run directory, ``run`` (the tracker run its
    ``identity`` chose, as the manifest records it), whether an earlier session started that run (``continued``:
    this one continues it), the run's recorded config, and a resume's first step (None: a new run)."""

    settings: LogConfig
    run_dir: Path
    run: dict[str, Any]
    continued: bool
    config: dict[str, Any]
    first_step: int | None


Identity = Callable[[LogConfig, str, dict[str, Any] | None], dict[str, Any]]
"""(settings, the run's name, the record an earlier session left or None) -> the tracker run to log to."""


def nothing_to_check() -> None:
    return None


@dataclass(frozen=True)
class TrackerKind:
    """A registered tracker: ``start`` builds it, ``identity`` names its run (for the manifest, before it starts),
    ``check`` refuses in one line what would lose its logs (its package is checked for every tracker)."""

    name: str
    start: Callable[[TrackerStart], Tracker]
    identity: Identity
    check: Callable[[], None] = nothing_to_check


TRACKERS: dict[str, TrackerKind] = {}
"""The trackers by name, each registered with its factory (``register_tracker``)."""


def register_tracker(name: str, *, identity: Identity, check: Callable[[], None] = nothing_to_check):
    """Register ``start(TrackerStart) -> Tracker`` as the tracker called ``name`` (a declared name)."""
    if name not in TRACKER_NAMES:
        raise ValueError(f"tracker {name!r} is not declared in grpolab.common.tracker_names (declare_tracker)")

    def register(start: Callable[[TrackerStart], Tracker]) -> Callable[[TrackerStart], Tracker]:
        TRACKERS[name] = TrackerKind(name, start, identity, check)
        return start

    return register


def tracker_kind(name: str) -> TrackerKind:
    """The registered tracker ``name``; a declared name without a factory is a ValueError naming it."""
    if name not in TRACKERS:
        raise ValueError(f"log.trackers {name}: no tracker is registered under that name (grpolab.run.trackers)")
    return TRACKERS[name]
