"""SHA-256 of a folder: each file's SHA-256 by relative path (``tree_files``) and one SHA-256 over them
(``tree_sha256``), which changes when any file is changed, added, removed or renamed. A suite's code
snapshot is hashed so, and so is a reward model's folder (``model_files``: what a loader reads, without
hidden entries such as ``.git`` or ``.cache``, which hold copies and download notes, not the model)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

from grpolab.tasks.datasets import file_sha256

Skip = Callable[[Path], bool]


def is_bytecode(path: Path) -> bool:
    """Python's compiled files, which importing the snapshot writes beside its sources (never hashed)."""
    return "__pycache__" in path.parts or path.suffix == ".pyc"


def is_hidden_or_bytecode(path: Path) -> bool:
    """A path (relative to the folder) under a hidden entry, or bytecode."""
    return any(part.startswith(".") for part in path.parts) or is_bytecode(path)


def listed_files(root: Path, skip: Skip = is_bytecode) -> list[Path]:
    """The files under ``root`` that ``skip`` (given the path relative to ``root``) keeps, in sorted order."""
    root = Path(root)
    return sorted(p for p in root.rglob("*") if p.is_file() and not skip(p.relative_to(root)))


def tree_files(root: Path, skip: Skip = is_bytecode, on_file: Callable[[int], None] | None = None) -> dict[str, str]:
    """SHA-256 of every file under ``root`` but those ``skip`` drops, by relative path, in sorted order;
    ``on_file(bytes)`` after each file (a progress bar's feed)."""
    root = Path(root)
    files = {}
    for path in listed_files(root, skip):
        files[path.relative_to(root).as_posix()] = file_sha256(path)
        if on_file is not None:
            on_file(path.stat().st_size)
    return files


def tree_sha256(files: dict[str, str]) -> str:
    """One SHA-256 over ``tree_files``' relative paths and contents, in their order."""
    h = hashlib.sha256()
    for name, digest in files.items():
        h.update(f"{name}\0{digest}\0".encode())
    return h.hexdigest()


def model_bytes(folder: Path) -> int:
    """The size of the files ``model_files`` hashes (for a progress bar's total)."""
    return sum(p.stat().st_size for p in listed_files(folder, is_hidden_or_bytecode))


def model_files(folder: Path, on_file: Callable[[int], None] | None = None) -> dict[str, str]:
    """A model folder's ``tree_files``, hidden entries left out."""
    return tree_files(folder, is_hidden_or_bytecode, on_file)


def model_sha256(folder: Path) -> str:
    """One SHA-256 of a model folder: ``tree_sha256`` of its ``model_files``."""
    return tree_sha256(model_files(folder))
