"""Folders built once and cached (the demo's warm start, ``like:`` and ``gguf:`` models): written by
``grpolab.common.atomic`` to a temporary sibling and renamed into place, so a half-written folder is never
used, and the temporaries a killed build left are removed by the next build."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from grpolab.common.atomic import atomic_folder


def cached_folder(target: Path, marker: str, write: Callable[[Path], None]) -> Path:
    """``target``, complete once it holds ``marker``: built on first use by ``write(folder)`` (which must
    write ``marker`` last) in a temporary folder beside it, then renamed. When another process finished
    the same folder first, theirs is kept."""
    if (target / marker).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        with atomic_folder(target) as tmp:
            write(tmp)
    except OSError:
        if not (target / marker).is_file():
            raise
    return target
