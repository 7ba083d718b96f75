"""TensorBoard: scalars and the completion tables (as Markdown text) in RUN_DIR/tensorboard."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from grpolab.common.tracker_names import import_package
from grpolab.config import LogConfig
from grpolab.run.trackers.registry import TrackerStart, register_tracker


def markdown_table(columns: list[str], rows: list[list[Any]]) -> str:
    """``rows`` as a Markdown table (TensorBoard's text tab renders it); cell pipes and newlines escaped."""

    def cell(value: Any) -> str:
        text = f"{value:.4g}" if isinstance(value, float) else "" if value is None else str(value)
        return text.replace("|", "\\|").replace("\n", "<br>")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows])


class TensorBoardTracker:
    """Event files in ``folder``. A resume purges the events from ``first_step`` on and writes the redone
    steps again, so each step shows once (None: a new run)."""

    name, resends, mode = "tensorboard", True, "local"

    def __init__(self, folder: Path, first_step: int | None = None):
        import_package(self.name)
        from torch.utils.tensorboard import SummaryWriter

        self.folder = folder
        self.writer = SummaryWriter(str(folder), purge_step=first_step)

    def describe(self) -> str:
        return f"tensorboard {self.folder} (tensorboard --logdir {self.folder})"

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def table(self, step: int, key: str, columns: list[str], rows: list[list[Any]]) -> None:
        self.writer.add_text(key, markdown_table(columns, rows), step)
        self.writer.flush()

    def close(self, finished: bool) -> None:
        self.writer.close()


def event_folder(settings: LogConfig, run_name: str, previous: dict[str, Any] | None) -> dict[str, Any]:
    """Always RUN_DIR/tensorboard: a resume purges and rewrites the steps it redoes there."""
    return {"dir": "tensorboard"}


@register_tracker(TensorBoardTracker.name, identity=event_folder)
def start_tensorboard(start: TrackerStart) -> TensorBoardTracker:
    return TensorBoardTracker(Path(start.run_dir) / start.run["dir"], start.first_step)
