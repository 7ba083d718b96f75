"""What a suite executes, frozen before its first run: the package source, the data rows and the
prompt template. Runs import the package from the snapshot (``PYTHONPATH``), so later edits of the
working tree cannot change a queued run. A task's reward models (``model:DIR``) are snapshotted by hash,
not copied: the runs read DIR, whose files' SHA-256s are recorded (``hash_reward_model``) and checked
before each attempt of a run starts (``grpolab.studies.suite.verify``)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

from grpolab.common.progress import Reporter
from grpolab.common.version import PACKAGE_DIR, VERSION
from grpolab.config import RunConfig
from grpolab.tasks.base import Example
from grpolab.tasks.configs import build_task
from grpolab.tasks.datasets import file_sha256
from grpolab.tasks.folder_hash import model_bytes, model_files, tree_files, tree_sha256


def git_state(folder: Path) -> dict[str, Any] | None:
    """{commit, dirty} of the git checkout holding ``folder``; None when it is not one (or git is absent)."""
    try:
        commit = subprocess.run(
            ["git", "-C", str(folder), "rev-parse", "HEAD"], capture_output=True, text=True, check=True, timeout=30
        ).stdout.strip()
        status = subprocess.run(
            ["git", "-C", str(folder), "status", "--porcelain", "--", "."],
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": commit, "dirty": bool(status.strip())}


def task_key(cfg: RunConfig) -> str:
    """The name of a task's data snapshot folder: runs of the same task share it."""
    return hashlib.sha256(json.dumps(cfg.task.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()[:12]


def _write_rows(path: Path, examples: list[Example]) -> str:
    path.write_text(
        "".join(json.dumps({"id": e.id, "question": e.question, "answer": e.answer}) + "\n" for e in examples)
    )
    return file_sha256(path)


def snapshot_data(cfg: RunConfig, folder: Path) -> dict[str, Any]:
    """The rows a run trains and validates on, and its prompt template, written under ``folder``;
    GSM8K's source files are copied there too (the run reads those copies). Returns their SHA-256s and,
    under ``task_paths``, the config fields that must point at the copies (``files_sha256``: the copies');
    ``reward_models``: the task's reward models, {name, path (absolute)} each, hashed by the caller."""
    folder.mkdir(parents=True, exist_ok=True)
    task_paths: dict[str, str] = {}
    files_sha256: dict[str, str] = {}
    for field, source in cfg.task.file_sources().items():  # the task reads the frozen copies (hub sources: not files)
        if source is not None and Path(source).is_file():
            copy = folder / "files" / f"{field.removesuffix('_path')}{Path(source).suffix}"  # apart from the rows below
            copy.parent.mkdir(exist_ok=True)
            shutil.copyfile(source, copy)
            task_paths[f"task.{field}"] = str(copy)
            files_sha256[str(copy)] = file_sha256(copy)
    task = build_task(cfg.task)
    (folder / "prompt_template.txt").write_text(task.prompt_template())
    return {
        "train_sha256": _write_rows(folder / "train.jsonl", task.train_examples()),
        "validation_sha256": _write_rows(folder / "validation.jsonl", task.validation_examples()),
        "prompt_sha256": file_sha256(folder / "prompt_template.txt"),
        "task_paths": task_paths,
        "files_sha256": files_sha256,
        "reward_models": [{"name": spec.name, "path": str(Path(spec.path).resolve())} for spec in task.reward_models],
    }


def hash_reward_model(path: str | Path, reporter: Reporter) -> dict[str, str]:
    """A reward model folder's ``model_files`` (SHA-256 by relative path), with a progress bar (on a
    terminal) or progress lines (in a log) when hashing takes more than a few seconds."""
    folder = Path(path)
    total, done = model_bytes(folder), [0]
    with reporter.phase(
        f"hash reward model {folder}", total=max(1, -(-total // 2**20)), unit="MiB", done_note=None
    ) as phase:

        def advance(size: int) -> None:
            done[0] += size
            phase.advance(done[0] // 2**20 - phase.done)

        return model_files(folder, on_file=advance)


class SnapshotLinkError(ValueError):
    """The package source holds a link to something outside it."""


def check_package_links(source: Path | None = None) -> None:
    """Refuse (SnapshotLinkError, one line naming the link and its target) a symbolic link under the package
    source that leads out of it: the snapshot would copy in a folder or file that is not the package's, and
    recording it as the package's code would be a lie; skipping it would leave a snapshot unlike the package
    the runs were checked against. Links that stay inside the package are copied as what they point at."""
    source = Path(source or PACKAGE_DIR)
    root = source.resolve()
    for dirpath, dirnames, filenames in os.walk(source):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for name in sorted(dirnames + filenames):
            path = Path(dirpath) / name
            if path.is_symlink() and not path.resolve().is_relative_to(root):
                raise SnapshotLinkError(
                    f"the package source has a link leading out of it: {path} -> {os.readlink(path)} "
                    f"({path.resolve()}); a suite's code snapshot holds only the package's own files "
                    "(replace the link with the files it points at, or remove it)"
                )


def snapshot_code(folder: Path, source: Path | None = None) -> dict[str, Any]:
    """A copy of the installed package's source (``source``: another package folder) under
    ``folder/grpolab`` (PYTHONPATH=folder), with the SHA-256 of each file (``files``) and of the whole tree
    (``sha256``). A link leading out of the package is refused before anything is copied
    (``check_package_links``)."""
    source = Path(source or PACKAGE_DIR)
    check_package_links(source)
    shutil.copytree(source, folder / "grpolab", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    files = tree_files(folder / "grpolab")
    return {
        "version": VERSION,
        "source": str(source),
        "git": git_state(source),
        "sha256": tree_sha256(files),
        "files": files,
        "path": str(folder),
    }
