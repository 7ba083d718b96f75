"""Trackio: a local SQLite database (``TRACKIO_DIR``, by default in the Hugging Face cache) or a Space
(``TRACKIO_SPACE_ID``); one Trackio run per grpolab run, named after it and continued by every resume."""

from __future__ import annotations

import contextlib
import io
import tempfile
from pathlib import Path
from typing import Any

from grpolab.common.tracker_names import import_package
from grpolab.config import LogConfig
from grpolab.run.trackers.registry import TrackerStart, register_tracker


def check_trackio_dir() -> None:
    """Refuse, in one line naming it, a Trackio directory this process cannot write (Trackio would only warn
    that it failed to flush, and every Trackio metric of the run would be lost). The directory is Trackio's own
    choice, read once when it is imported: ``TRACKIO_DIR``, else ``trackio`` in the Hugging Face home. Its
    local database is written in Space mode too (the logs waiting to be sent). Creating the directory is what
    Trackio would do first; the probe file goes at once."""
    from trackio.utils import TRACKIO_DIR

    folder = Path(TRACKIO_DIR)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder, prefix=".grpolab-write-check-"):
            pass
    except OSError as err:
        raise ValueError(
            f"log.trackers trackio: its directory {folder} cannot be written ({err.strerror or err}); "
            "set TRACKIO_DIR to a writable folder"
        ) from None


class TrackioTracker:
    """The Trackio run ``name`` in ``project``: with ``continued``, the newest Trackio run of that name (created
    if there is none); otherwise a new one, even where a run of that name exists (Trackio tells them apart by
    an id of its own), so that a new grpolab run never adds to another one's curves."""

    name, resends = "trackio", False

    def __init__(self, project: str, name: str, config: dict[str, Any], continued: bool):
        self.trackio = import_package(self.name)
        resume = "allow" if continued else "never"
        with contextlib.redirect_stdout(io.StringIO()):  # its banner; the start line says where the run is
            self.run = self.trackio.init(project=project, name=name, resume=resume, config=config, embed=False)
        self.project = project
        self.mode = "space" if self.run.url else "local"

    def describe(self) -> str:
        from trackio.utils import TRACKIO_DIR

        where = self.run.url or TRACKIO_DIR
        return (
            f"trackio run {self.run.name} in project {self.project} at {where} (trackio show --project {self.project})"
        )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def table(self, step: int, key: str, columns: list[str], rows: list[list[Any]]) -> None:
        self.run.log({key: self.trackio.Table(columns=columns, data=rows)}, step=step)

    def close(self, finished: bool) -> None:
        with contextlib.redirect_stdout(io.StringIO()):
            try:
                self.trackio.finish()  # the process's current run (this one), cleared: its exit hook has nothing left
            except RuntimeError:  # no current run any more: this one alone
                self.run.finish()


def trackio_run(settings: LogConfig, run_name: str, previous: dict[str, Any] | None) -> dict[str, Any]:
    """The Trackio run an earlier session started, else one named after this run in ``log.project``."""
    return previous or {"project": settings.project, "name": run_name}


@register_tracker(TrackioTracker.name, identity=trackio_run, check=check_trackio_dir)
def start_trackio(start: TrackerStart) -> TrackioTracker:
    return TrackioTracker(start.run["project"], start.run["name"], start.config, continued=start.continued)
