"""Checkpoints that prove themselves: RUN_DIR/checkpoints/step_NNNNNN holds a Hugging Face model, its
tokenizer, the run's state and ``checkpoint.json``, written last, listing every other file's size and
SHA-256. Each file and the folder are fsynced before the folder is renamed into place (and the parent
after), so a checkpoint folder is complete or absent even across a power cut, and a damaged one is
found by its checksums instead of failing later."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpolab.common.atomic import atomic_folder, fsync_path
from grpolab.run.state import STATE_FILE

MANIFEST = "checkpoint.json"
TEMP_PREFIX = ".step_"
DAMAGED_DIR = "damaged"


def _fsync(path: Path) -> None:
    fsync_path(path)


def _sha256_and_sync(path: Path) -> str:
    """SHA-256 of the file's bytes, read back after fsync: what is on disk, not what was meant."""
    _fsync(path)
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def step_folder(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step_{step:06d}"


def save_checkpoint(
    model,
    tokenizer,
    run_dir: Path,
    step: int,
    state: Callable[[Path], None] | None = None,
    weights: dict[str, Any] | None = None,
) -> Path:
    """Write checkpoints/step_NNNNNN: the model (its ``weights`` when given: a sharded model's, gathered),
    the tokenizer and what ``state(folder)`` writes, into a temp folder; every file fsynced and listed
    with its SHA-256 in checkpoint.json (written last); then renamed into place."""
    target = step_folder(run_dir, step)
    target.parent.mkdir(exist_ok=True)
    with atomic_folder(target, sync=lambda path: _fsync(path), files_synced=True) as tmp:  # _fsync: at each call
        model.save_pretrained(tmp, state_dict=weights)
        tokenizer.save_pretrained(tmp)
        if state is not None:
            state(tmp)
        files = {
            p.relative_to(tmp).as_posix(): {"bytes": p.stat().st_size, "sha256": _sha256_and_sync(p)}
            for p in sorted(tmp.rglob("*"))
            if p.is_file()
        }
        (tmp / MANIFEST).write_text(json.dumps({"step": step, "files": files}, indent=1))
        _fsync(tmp / MANIFEST)
    return target


def listed_files(folder: Path) -> dict[str, dict[str, Any]]:
    """checkpoint.json's file list: name -> {bytes, sha256}. Raises ValueError when it is absent or unreadable."""
    try:
        files = json.loads((folder / MANIFEST).read_text())["files"]
    except FileNotFoundError:
        raise ValueError(f"no {MANIFEST}") from None
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise ValueError(f"{MANIFEST} is unreadable ({type(err).__name__})") from None
    if not isinstance(files, dict):
        raise ValueError(f"{MANIFEST} is unreadable (no file list)")
    for name, entry in files.items():  # it parses, yet an entry may not be one this code wrote
        if not (
            isinstance(entry, dict)
            and type(entry.get("bytes")) is int
            and isinstance(entry.get("sha256"), str)
            and name
            and not name.startswith("/")
            and ".." not in Path(name).parts
        ):
            raise ValueError(f"{MANIFEST} is unreadable (its entry for {name!r} is not a size and a SHA-256)")
    return files


def problem(folder: Path, needs: tuple[str, ...] = ()) -> str | None:
    """Why the checkpoint in ``folder`` cannot be trusted (its manifest, a missing file, a size or checksum
    that differs, a file in ``needs`` it does not list), or None when every listed file checks out."""
    try:
        files = listed_files(folder)
    except ValueError as err:
        return str(err)
    for name in needs:
        if name not in files:
            return f"{MANIFEST} does not list {name}"
    for name, entry in files.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != entry["bytes"]:
            return f"{name} has {path.stat().st_size} bytes, {entry['bytes']} were written"
        h = hashlib.sha256()
        with path.open("rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                h.update(block)
        if h.hexdigest() != entry["sha256"]:
            return f"{name} does not match its SHA-256 (damaged)"
    return None


def is_checkpoint(folder: Path) -> bool:
    """A folder a grpolab run wrote as a checkpoint (its listing, or a trainer state): one ``verify`` must pass
    before anything in it is read, whoever reads it (a resume, ``model.path``, a suite's init_from, export)."""
    return (Path(folder) / MANIFEST).is_file() or (Path(folder) / STATE_FILE).is_file()


def verify(folder: Path, needs: tuple[str, ...] = ()) -> Path:
    """``folder`` when every file its checkpoint.json lists checks out (``problem``); else one line naming it
    and why, before a byte of its weights is loaded."""
    why = problem(Path(folder), needs)
    if why is not None:
        raise ValueError(f"checkpoint {folder}: {why}; not loaded (a damaged or incomplete checkpoint)")
    return Path(folder)


def weights_sha256(folder: Path) -> str:
    """SHA-256 over a checkpoint's weight files (names and SHA-256s, as listed in its checkpoint.json): the
    part that defines the model (a LoRA run's: its adapter), without reading the weights again."""
    h = hashlib.sha256()
    files = listed_files(folder)
    for name in sorted(n for n in files if n.startswith(("model", "adapter_model")) and n.endswith(".safetensors")):
        h.update(f"{name}\0{files[name]['sha256']}\0".encode())
    return h.hexdigest()


def step_folders(run_dir: Path) -> list[Path]:
    """checkpoints/step_NNNNNN folders, oldest first (temp folders start with '.')."""
    return sorted(p for p in (Path(run_dir) / "checkpoints").glob("step_*") if p.is_dir())


@dataclass(frozen=True)
class Resumable:
    """The newest checkpoint that checks out (None when none does) and the newer ones that did not, with why."""

    checkpoint: Path | None
    damaged: list[tuple[Path, str]]


def newest_verified(
    run_dir: Path, needs: tuple[str, ...] = (), on_check: Callable[[Path], None] = lambda _: None
) -> Resumable:
    """Verify checkpoints newest first until one checks out (``on_check`` hears each one it reads)."""
    damaged = []
    for folder in reversed(step_folders(run_dir)):
        on_check(folder)
        why = problem(folder, needs)
        if why is None:
            return Resumable(folder, damaged)
        damaged.append((folder, why))
    return Resumable(None, damaged)


def set_aside(folder: Path) -> Path:
    """Move a damaged checkpoint to checkpoints/damaged/ (kept, never deleted; its step can be written again)."""
    aside_dir = folder.parent / DAMAGED_DIR
    aside_dir.mkdir(exist_ok=True)
    target, n = aside_dir / folder.name, 1
    while target.exists():
        n += 1
        target = aside_dir / f"{folder.name}-{n}"
    os.replace(folder, target)
    return target


def remove_temp_folders(run_dir: Path) -> list[Path]:
    """Remove the temp folders of checkpoint writes that a kill interrupted (call only while holding the
    run's lock: no write of this run can be under way)."""
    stale = [p for p in (Path(run_dir) / "checkpoints").glob(f"{TEMP_PREFIX}*") if p.is_dir()]
    for folder in stale:
        shutil.rmtree(folder)
    return stale


def prune(run_dir: Path, keep_last: int, needs: tuple[str, ...] = ()) -> list[Path]:
    """Remove the oldest checkpoints beyond the newest ``keep_last``, only once the newest verifies (a
    damaged newest removes nothing). Returns the removed folders."""
    folders = step_folders(run_dir)
    if len(folders) <= keep_last or problem(folders[-1], needs) is not None:
        return []
    removed = folders[:-keep_last]
    for folder in removed:
        shutil.rmtree(folder)
    return removed
