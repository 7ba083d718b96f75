"""Folders built once and cached (the demo's warm start, ``like:`` and ``gguf:`` models): written to a
temporary sibling and renamed into place, so a half-written folder is never used."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def cached_folder(target: Path, marker: str, write: Callable[[Path], None]) -> Path:
    """``target``, complete once it holds ``marker``: built on first use by ``write(folder)`` (which must
    write ``marker`` last) in a temporary folder beside it, then renamed. When another process finished
    the same folder first, theirs is kept."""
    if (target / marker).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        write(tmp)
        os.replace(tmp, target)
    except OSError:
        if not (target / marker).is_file():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
