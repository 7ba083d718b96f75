"""The trackers a run also logs to (``log.trackers``): TensorBoard, Weights & Biases, Trackio, one module
each behind ``base.Tracker``, each registered by name in its module (``registry``); rank 0 opens them once its
run directory is ready and closes them at its end."""

from __future__ import annotations

from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

from grpolab.common.tracker_names import import_package
from grpolab.config import LogConfig

# each tracker's module registers it (registry.register_tracker): imported for that
from grpolab.run.trackers import tensorboard_tracker, trackio_tracker, wandb_tracker  # noqa: F401
from grpolab.run.trackers.base import Tracker, Trackers
from grpolab.run.trackers.registry import TrackerStart, tracker_kind

__all__ = ["Trackers", "check_trackers", "identities", "open_trackers"]


def check_trackers(settings: LogConfig) -> None:
    """One line for a tracker whose package is missing, or that would lose its logs (its own check: Trackio's
    directory that cannot be written), before anything on disk moves."""
    for name in settings.trackers:
        import_package(name)
        tracker_kind(name).check()


def identities(settings: LogConfig, run_dir: Path, previous: dict[str, Any] | None) -> dict[str, Any]:
    """Which tracker runs this run logs to: ``previous`` (what its manifest recorded: a resume continues those)
    or new ones (each tracker's ``identity``: project, name: ``log.run_name`` or the run directory's name)."""
    previous = previous or {}
    run_name = settings.run_name or Path(run_dir).resolve().name
    return {name: tracker_kind(name).identity(settings, run_name, previous.get(name)) for name in settings.trackers}


def open_trackers(
    settings: LogConfig,
    run_dir: Path,
    runs: dict[str, Any],
    continued: Collection[str],
    config: dict[str, Any],
    first_step: int | None,
    sent_through: int,
    say: Callable[[str], None],
) -> tuple[Trackers, dict[str, str]]:
    """Open the trackers of ``settings.trackers`` on the runs ``identities`` chose (``continued``: the trackers
    whose runs an earlier session started, which this one continues), each announced in one
    ``say`` line; one that cannot start (W&B unreachable) is a warning line and the run goes on without it.
    ``first_step``: a resume's first step (TensorBoard purges from it); ``sent_through``: the last step a
    previous session may have sent. Returns the trackers and each one's mode (for the manifest)."""
    opened: list[Tracker] = []
    modes: dict[str, str] = {}
    for name in settings.trackers:
        start = TrackerStart(settings, Path(run_dir), runs.get(name, {}), name in continued, config, first_step)
        try:
            tracker = tracker_kind(name).start(start)
        except Exception as err:
            why = (str(err).strip().splitlines() or [type(err).__name__])[0]
            say(
                f"warning: log.trackers {name} could not start ({type(err).__name__}: {why}); the run goes on without it"
            )
            continue
        opened.append(tracker)
        modes[name] = tracker.mode
        say(f"tracker: {tracker.describe()}")
    return Trackers(opened, sent_through, say), modes
