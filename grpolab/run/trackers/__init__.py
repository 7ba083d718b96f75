"""The trackers a run also logs to (``log.trackers``): TensorBoard, Weights & Biases, Trackio, one module
each behind ``base.Tracker``; rank 0 opens them once its run directory is ready and closes them at its end."""

from __future__ import annotations

from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

from grpolab.config import LogConfig
from grpolab.run.trackers.base import Tracker, Trackers, require
from grpolab.run.trackers.tensorboard_tracker import TensorBoardTracker
from grpolab.run.trackers.trackio_tracker import TrackioTracker, check_trackio_dir
from grpolab.run.trackers.wandb_tracker import WandbTracker, new_run_id

__all__ = ["Trackers", "check_trackers", "identities", "open_trackers"]


def check_trackers(settings: LogConfig) -> None:
    """One line for a tracker whose package is missing, or whose directory cannot be written (Trackio's), before
    anything on disk moves."""
    for name in settings.trackers:
        require(name)
        if name == "trackio":
            check_trackio_dir()


def identities(settings: LogConfig, run_dir: Path, previous: dict[str, Any] | None) -> dict[str, Any]:
    """Which tracker runs this run logs to: ``previous`` (what its manifest recorded: a resume continues those)
    or new ones (project, name: ``log.run_name`` or the run directory's name; a new W&B run id)."""
    previous = previous or {}
    name = settings.run_name or Path(run_dir).resolve().name
    out: dict[str, Any] = {}
    if "wandb" in settings.trackers:
        out["wandb"] = previous.get("wandb") or {"project": settings.project, "name": name, "id": new_run_id()}
    if "trackio" in settings.trackers:
        out["trackio"] = previous.get("trackio") or {"project": settings.project, "name": name}
    if "tensorboard" in settings.trackers:
        out["tensorboard"] = {"dir": "tensorboard"}
    return out


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
        run = runs.get(name, {})
        try:
            if name == "tensorboard":
                tracker = TensorBoardTracker(Path(run_dir) / run["dir"], first_step)
            elif name == "wandb":
                tracker = WandbTracker(run["project"], run["name"], run["id"], Path(run_dir), config)
            else:
                tracker = TrackioTracker(run["project"], run["name"], config, continued=name in continued)
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
