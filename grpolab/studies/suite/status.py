"""``grpolab suite status``: each run's state, step, accuracy, time, where it runs and why it stopped."""

from __future__ import annotations

from pathlib import Path

from rich.table import Table
from rich.text import Text

from grpolab.common.progress import format_seconds
from grpolab.config import load_config
from grpolab.run.rundir import wall_seconds
from grpolab.studies.manifest import SuiteManifest, pid_alive
from grpolab.studies.suite.completion import progress_of


def where_of(record) -> str:
    """'host devices 0,1 (2 processes), job 12 RUNNING' from what the record knows."""
    parts = [record.host or ""]
    if record.devices:
        parts.append(f"devices {','.join(record.devices)}")
    if record.world_size > 1:
        parts.append(f"({record.world_size} processes)")
    if record.job_id:
        parts.append(f"job {record.job_id}" + (f" {record.job_state}" if record.job_state else ""))
    return " ".join(part for part in parts if part)


def status_table(root: Path) -> Table:
    """Each run's state, step (and unreadable metrics lines), last validation accuracy, wall time (as
    ``grpolab.run.rundir.wall_seconds``: up to the run's last completed step), where and reason."""
    manifest = SuiteManifest.load(root)
    table = Table(title=Text(f"suite {manifest.suite} ({root})"))
    for column in ("run", "state", "step", "val acc", "wall time", "where", "reason"):
        table.add_column(column)
    for record in manifest.runs:
        cfg = load_config(record.config_file)
        progress = progress_of(Path(record.run_dir))
        state = record.state
        if state == "running" and record.job_id is None and not pid_alive(record.pid):
            state = "running (process gone: resume)"
        seconds = wall_seconds(Path(record.run_dir))  # the report's and summary.json's definition
        cells = (
            record.name,
            state,
            f"{progress.step}/{cfg.steps}{progress.skipped_note()}",
            "" if progress.accuracy is None else f"{progress.accuracy:.3f}",
            "" if seconds is None else format_seconds(seconds),
            where_of(record),
            record.reason or "",
        )
        table.add_row(*map(Text, cells))  # as written: a reason's [brackets] are not markup
    if manifest.decisions:  # a decision suite: each arm's verdict after the last decided round
        last = manifest.decisions[-1]
        verdicts = "; ".join(
            f"{arm} {v['status']}" + (f" at round {v['round']}" if v["round"] is not None else "")
            for arm, v in last["verdicts"].items()
        )
        table.caption = Text(f"decisions after round {last['round']}: {verdicts}")
    return table
