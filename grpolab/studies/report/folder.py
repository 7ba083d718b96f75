"""The report's own folder, DIR/report: marked by a file inside it, so that a report replaces only what an
earlier report wrote, never a run directory, a user's folder or a file that happens to be named ``report``."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import tempfile
from pathlib import Path


class ReportError(ValueError):
    """The directory holds nothing a report can be made of, or its report folder is not the report's own."""


REPORT_DIR = "report"
MARKER = ".grpolab-report"
MARKER_KIND = "grpolab report"
TEMP_PREFIX = f".{REPORT_DIR}-"  # temporary folders being written, and an earlier report moved aside


def is_report(path: Path) -> bool:
    """Whether ``path`` is a real folder (not a link) holding the report marker."""
    path = Path(path)
    marker = path / MARKER
    if path.is_symlink() or not path.is_dir() or marker.is_symlink() or not marker.is_file():
        return False
    try:
        return json.loads(marker.read_text()).get("kind") == MARKER_KIND
    except (OSError, ValueError, AttributeError):
        return False


def check_replaceable(target: Path) -> None:
    """Raise ReportError when ``target`` exists (a link included) and is not a report's own folder."""
    if os.path.lexists(target) and not is_report(target):
        raise ReportError(f"{target} exists and is not a grpolab report (no {MARKER}); not replaced: move it or "
                          "report into another folder")


def new_report_folder(directory: Path) -> Path:
    """A fresh temporary folder in ``directory``, marked as the report's before anything else is written."""
    tmp = Path(tempfile.mkdtemp(dir=directory, prefix=TEMP_PREFIX))
    (tmp / MARKER).write_text(json.dumps({"kind": MARKER_KIND}) + "\n")
    return tmp


def remove_leftovers(directory: Path, keep: Path) -> None:
    """Remove the marked temporary folders of an earlier report that was killed (all but ``keep``);
    unmarked ones are someone else's and stay."""
    for path in Path(directory).glob(f"{TEMP_PREFIX}*"):
        if path != keep and is_report(path):
            shutil.rmtree(path, ignore_errors=True)


def put_in_place(tmp: Path, target: Path) -> None:
    """Move the finished folder ``tmp`` to ``target``, replacing an earlier report there (checked again
    here: something may have appeared at ``target`` while the report was being made)."""
    check_replaceable(target)
    old = None
    if os.path.lexists(target):
        old = target.parent / f"{TEMP_PREFIX}old-{secrets.token_hex(8)}"  # a name nobody else uses
        os.rename(target, old)
    os.rename(tmp, target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
