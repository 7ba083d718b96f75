"""The run directory: refuse to overwrite, metrics as JSON lines, per-item evaluation records, rewinding
them for a resume (checkpoints: ``grpolab.run.checkpoints``)."""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grpolab.common.atomic import atomic_file, named, write_file

if TYPE_CHECKING:
    from grpolab.run.trackers import Trackers


class RunDirError(FileExistsError):
    """The output directory already holds something; nothing was written."""


LOCK_FILE = ".grpolab.lock"  # the file grpolab.run.lock locks
CONFIG_FILE = "config.json"
MANIFEST_FILE = "manifest.json"  # grpolab.run.journal's
INPUTS_DIR = "inputs"  # what the Python API was given as objects (rows, a loaded model), written before the start


def wall_seconds(run_dir: Path) -> float | None:
    """A run's wall time, as summary.json's ``wall_seconds``, ``grpolab report`` and ``grpolab suite status``
    all give it: over the run's sessions, the seconds from the start of each session's training loop (its
    step-0 evaluation included; loading the model and starting the engine not) to its last completed step
    (that step's evaluation and checkpoint included). None when the run has no readable manifest yet."""
    try:
        sessions = json.loads((Path(run_dir) / MANIFEST_FILE).read_text())["sessions"]
        return float(sum(s["seconds"] for s in sessions))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def said_warnings(run_dir: Path) -> list[dict[str, Any]]:
    """The warnings summary.json lists (``grpolab.run.health``; [] without a readable one)."""
    try:
        found = json.loads((Path(run_dir) / "summary.json").read_text()).get("warnings", [])
    except (OSError, ValueError, AttributeError):
        return []
    return found if isinstance(found, list) else []


def start_leftovers(run_dir: Path) -> list[Path] | None:
    """What a new run stopped before it wrote its config leaves in ``run_dir``: its lock file and a temp file of
    config.json (an empty list for an empty directory); None when ``run_dir`` holds anything else. Such a
    directory takes a new run (the lock decides whether its first start is still alive). The ``inputs`` folder
    the Python API writes before a start (``grpolab.commands.api``) is the run's own, not a leftover."""
    found = [p for p in run_dir.iterdir() if p.name != INPUTS_DIR]
    if all(p.name == LOCK_FILE or p.name.startswith(f".{CONFIG_FILE}-") for p in found):
        return found
    return None


def resolve_run_dir(output_dir: str | None, label: str, root: str = "runs") -> Path:
    """Where a new run goes (not created yet): ``output_dir``, which may exist only if empty (or holding what a
    start stopped before its config leaves, ``start_leftovers``), or runs/<time>-<label>. Raises RunDirError
    for a directory that already holds something (a run: how to continue it)."""
    run_dir = Path(output_dir) if output_dir else Path(root) / f"{time.strftime('%Y%m%d-%H%M%S')}-{label}"
    if run_dir.exists() and (not run_dir.is_dir() or start_leftovers(run_dir) is None):
        if (run_dir / CONFIG_FILE).is_file():
            raise RunDirError(
                f"output directory {run_dir} holds a run (its {CONFIG_FILE}): continue it with "
                f"grpolab train --resume {run_dir}, or choose another --output-dir"
            )
        raise RunDirError(f"output directory already exists and is not empty: {run_dir} (choose another --output-dir)")
    return run_dir


def _clean(value: Any) -> Any:
    """JSON-safe: non-finite floats become null (json would write NaN, which is not JSON)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` atomically (temp file in the same folder, fsynced, renamed; the folder fsynced)."""
    with atomic_file(path) as f:
        json.dump({k: _clean(v) for k, v in data.items()}, f, indent=2, default=str)


class MetricsLog:
    """Appends one JSON object per line to ``metrics.jsonl``; with ``trackers`` (``grpolab.run.trackers``) each
    record then goes to them too (a tracker's failure never loses a line of the file: it is written first)."""

    def __init__(self, path: Path, trackers: Trackers | None = None):
        self.path, self.trackers = path, trackers

    def write(self, record: dict[str, Any]) -> None:
        try:
            with self.path.open("a") as f:
                f.write(json.dumps({k: _clean(v) for k, v in record.items()}) + "\n")
        except OSError as err:
            raise named(err, self.path) from None
        if self.trackers is not None:
            self.trackers.log(record)

    def table(self, step: int, key: str, columns: list[str], rows: list[list[Any]]) -> None:
        """A table for the trackers only (metrics.jsonl holds numbers; the eval records hold completions)."""
        if self.trackers is not None:
            self.trackers.table(step, key, columns, rows)

    def close(self, finished: bool = False) -> None:
        """Close the trackers: ``finished`` marks their runs finished, else they stay resumable."""
        if self.trackers is not None:
            self.trackers.close(finished)


def last_step(run_dir: Path) -> int:
    """The highest step of any record in the run's metrics.jsonl and metrics.discarded.jsonl (-1: none): the
    last step a tracker of an earlier session may have received."""
    steps = [
        r["step"]
        for name in ("metrics.jsonl", "metrics.discarded.jsonl")
        for r in read_json_lines(Path(run_dir) / name).records
        if isinstance(r.get("step"), int)
    ]
    return max(steps, default=-1)


@dataclass(frozen=True)
class JsonLines:
    """The records of a JSON-lines file and how many of its lines could not be read (a line torn by a
    kill, or one being written)."""

    records: list[dict[str, Any]]
    skipped: int


def read_json_lines(path: Path) -> JsonLines:
    """Every readable JSON object line of ``path`` (none when it does not exist), counting the others."""
    records, skipped = [], 0
    for line in path.read_text(errors="replace").splitlines() if Path(path).is_file() else []:
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        if isinstance(record, dict):
            records.append(record)
        else:
            skipped += 1
    return JsonLines(records, skipped)


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The readable records of a metrics file (``read_json_lines`` says how many were skipped)."""
    return read_json_lines(path).records


EVAL_DIR = "eval"


def eval_records_path(run_dir: Path, step: int) -> Path:
    return run_dir / EVAL_DIR / f"step_{step:06d}.jsonl"


def write_eval_records(run_dir: Path, step: int, records: list[dict[str, Any]]) -> Path:
    """One JSON line per evaluated item in eval/step_NNNNNN.jsonl, written atomically."""
    path = eval_records_path(run_dir, step)
    path.parent.mkdir(exist_ok=True)
    write_file(path, "".join(json.dumps({k: _clean(v) for k, v in r.items()}) + "\n" for r in records))
    return path


def eval_record_steps(run_dir: Path) -> list[int]:
    """The steps that have evaluation records, in order."""
    return sorted(int(p.stem.removeprefix("step_")) for p in (run_dir / EVAL_DIR).glob("step_*.jsonl"))


def _append(path: Path, text: str) -> None:
    """Append ``text`` to ``path``, fsynced (the rewritten metrics.jsonl may only follow it)."""
    data = text.encode()
    try:
        with path.open("ab") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as err:
        raise named(err, path) from None


def rewind_metrics(path: Path, step: int, session: int) -> list[dict[str, Any]]:
    """Keep the records of steps <= ``step`` in ``path`` (rewritten atomically) and return them. Records of
    later steps (written before an interruption, redone on resume) and unreadable lines are appended to
    ``metrics.discarded.jsonl`` beside it, and the later steps' evaluation records move to
    eval/discarded/session_NNN/ (``session``: the session that discards them), so nothing is lost or
    overwritten however often a step is redone."""
    kept, dropped = [], []
    for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        if not line.strip():
            continue
        (kept if isinstance(record, dict) and record.get("step", 0) <= step else dropped).append(line)
    discarded = path.parent / "metrics.discarded.jsonl"
    existed = discarded.is_file()
    size = discarded.stat().st_size if existed else 0
    try:
        if dropped:
            _append(discarded, "".join(line + "\n" for line in dropped))
        write_file(path, "".join(line + "\n" for line in kept))
    except BaseException:  # the discarded file as it was, so that a retry appends these records once
        if existed:
            os.truncate(discarded, size)
        else:
            discarded.unlink(missing_ok=True)
        raise
    later = [eval_records_path(path.parent, s) for s in eval_record_steps(path.parent) if s > step]
    if later:
        aside = path.parent / EVAL_DIR / "discarded" / f"session_{session:03d}"
        aside.mkdir(parents=True, exist_ok=True)
        for record_file in later:
            os.replace(record_file, aside / record_file.name)
    return [json.loads(line) for line in kept]
