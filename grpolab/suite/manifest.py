"""``suite_manifest.json``: the state of every run of a suite, rewritten atomically at every change."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field

from grpolab.rundir import write_json

MANIFEST = "suite_manifest.json"
RunState = Literal["queued", "running", "completed", "failed", "stopped"]


def pid_alive(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


class RunRecord(BaseModel):
    name: str
    state: RunState = "queued"
    run_dir: str
    config_file: str
    config_sha256: str
    data_sha256: dict[str, str] = Field(default_factory=dict, description="train, validation rows; prompt template")
    init_from: str | None = None
    factors: dict[str, str] = Field(default_factory=dict)
    pid: int | None = None
    command: list[str] = Field(default_factory=list)
    exit_code: int | None = None
    started: str | None = None
    ended: str | None = None
    attempts: list[dict[str, Any]] = Field(default_factory=list, description="earlier attempts: command, exit, reason")
    final_checkpoint: str | None = None
    final_checkpoint_sha256: str | None = None
    reason: str | None = None


class SuiteManifest(BaseModel):
    suite: str
    source_file: str
    created: str = Field(default_factory=now)
    code: dict[str, Any] = Field(default_factory=dict, description="version, git commit and dirty flag, sha256, path")
    runner_pid: int | None = None
    runs: list[RunRecord]

    def save(self, root: Path) -> None:
        write_json(root / MANIFEST, self.model_dump(mode="json"))

    @classmethod
    def load(cls, root: Path) -> "SuiteManifest":
        path = root / MANIFEST
        if not path.is_file():
            raise FileNotFoundError(f"not a suite directory (no {MANIFEST}): {root}")
        return cls.model_validate(json.loads(path.read_text()))
