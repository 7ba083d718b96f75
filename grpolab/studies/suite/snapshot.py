"""What a suite executes, frozen before its first run: the package source, the data rows and the
prompt template. Runs import the package from the snapshot (``PYTHONPATH``), so later edits of the
working tree cannot change a queued run."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import grpolab
from grpolab.config import RunConfig
from grpolab.tasks.base import Example
from grpolab.tasks.configs import build_task
from grpolab.tasks.datasets import file_sha256


def is_bytecode(path: Path) -> bool:
    """Python's compiled files, which importing the snapshot writes beside its sources (never hashed)."""
    return "__pycache__" in path.parts or path.suffix == ".pyc"


def tree_files(root: Path) -> dict[str, str]:
    """SHA-256 of every file under ``root`` but bytecode, by relative path, in sorted order."""
    return {path.relative_to(root).as_posix(): file_sha256(path)
            for path in sorted(p for p in root.rglob("*") if p.is_file() and not is_bytecode(p.relative_to(root)))}


def tree_sha256(files: dict[str, str]) -> str:
    """One SHA-256 over ``tree_files``' relative paths and contents, in their order."""
    h = hashlib.sha256()
    for name, digest in files.items():
        h.update(f"{name}\0{digest}\0".encode())
    return h.hexdigest()


def git_state(folder: Path) -> dict[str, Any] | None:
    """{commit, dirty} of the git checkout holding ``folder``; None when it is not one (or git is absent)."""
    try:
        commit = subprocess.run(["git", "-C", str(folder), "rev-parse", "HEAD"], capture_output=True, text=True,
                                check=True, timeout=30).stdout.strip()
        status = subprocess.run(["git", "-C", str(folder), "status", "--porcelain", "--", "."], capture_output=True,
                                text=True, check=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": commit, "dirty": bool(status.strip())}


def task_key(cfg: RunConfig) -> str:
    """The name of a task's data snapshot folder: runs of the same task share it."""
    return hashlib.sha256(json.dumps(cfg.task.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()[:12]


def _write_rows(path: Path, examples: list[Example]) -> str:
    path.write_text("".join(json.dumps({"id": e.id, "question": e.question, "answer": e.answer}) + "\n"
                            for e in examples))
    return file_sha256(path)


def snapshot_data(cfg: RunConfig, folder: Path) -> dict[str, Any]:
    """The rows a run trains and validates on, and its prompt template, written under ``folder``;
    GSM8K's source files are copied there too (the run reads those copies). Returns their SHA-256s and,
    under ``task_paths``, the config fields that must point at the copies (``files_sha256``: the copies')."""
    folder.mkdir(parents=True, exist_ok=True)
    task_paths: dict[str, str] = {}
    files_sha256: dict[str, str] = {}
    for field in cfg.task.FILES:  # file-backed tasks read the frozen copies (hub sources are not files)
        source = getattr(cfg.task, field, None)
        if source is not None and Path(source).is_file():
            copy = folder / "files" / f"{field.removesuffix('_path')}{Path(source).suffix}"  # apart from the rows below
            copy.parent.mkdir(exist_ok=True)
            shutil.copyfile(source, copy)
            task_paths[f"task.{field}"] = str(copy)
            files_sha256[str(copy)] = file_sha256(copy)
    task = build_task(cfg.task)
    describe = getattr(task, "prompt_template", None)
    template = describe() if describe else task.prompt(Example(id="", question="{question}", answer=""))
    (folder / "prompt_template.txt").write_text(template)
    return {"train_sha256": _write_rows(folder / "train.jsonl", task.train_examples()),
            "validation_sha256": _write_rows(folder / "validation.jsonl", task.validation_examples()),
            "prompt_sha256": file_sha256(folder / "prompt_template.txt"), "task_paths": task_paths,
            "files_sha256": files_sha256}


def snapshot_code(folder: Path) -> dict[str, Any]:
    """A copy of the installed package's source under ``folder/grpolab`` (PYTHONPATH=folder), with the
    SHA-256 of each file (``files``) and of the whole tree (``sha256``)."""
    source = Path(grpolab.__file__).resolve().parent
    shutil.copytree(source, folder / "grpolab", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    files = tree_files(folder / "grpolab")
    return {"version": grpolab.__version__, "source": str(source), "git": git_state(source),
            "sha256": tree_sha256(files), "files": files, "path": str(folder)}
