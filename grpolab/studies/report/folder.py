"""The report's own folder, DIR/report: marked by a file inside it, so that a report replaces only what an
earlier report wrote, never a run directory, a user's folder or a file that happens to be named ``report``.
It is written by ``grpolab.common.atomic``'s folder writer: concurrent reports on one folder each write their
own temporary folder and all succeed (the last one's stays); a killed report's temporary goes with the next
report, a running one's never."""

from __future__ import annotations

import json
import os
from pathlib import Path


class ReportError(ValueError):
    """The directory holds nothing a report can be made of, or its report folder is not the report's own."""


def read_json(path: Path):
    """The JSON document in ``path``; ReportError naming the file when it cannot be read or parsed (an empty
    or torn file included)."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise ReportError(f"{path}: cannot read it as JSON ({err})") from None


REPORT_DIR = "report"
MARKER = ".grpolab-report"
MARKER_KIND = "grpolab report"


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
        raise ReportError(
            f"{target} exists and is not a grpolab report (no {MARKER}); not replaced: move it or "
            "report into another folder"
        )


def mark(folder: Path) -> None:
    """Mark ``folder`` as the report's own (first, before anything else is written into it)."""
    (folder / MARKER).write_text(json.dumps({"kind": MARKER_KIND}) + "\n")
