"""``suite_manifest.json``: the state of every run of a suite, rewritten atomically at every change."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationError

from grpolab.run.rundir import write_json

MANIFEST = "suite_manifest.json"
PREPARING = ".preparing"  # in a suite's root from the start of its preparation until its manifest is written
RunState = Literal["queued", "running", "completed", "failed", "stopped", "dropped"]
DONE = ("completed", "dropped")  # dropped: a decision suite needs it no more (its arm was decided)


def pid_alive(pid: int | None) -> bool:
    """Whether a process with this pid exists (another user's, too)."""
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
    """The local time with its offset, as the manifest records it."""
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


class RunRecord(BaseModel):
    name: str
    state: RunState = "queued"
    run_dir: str
    config_file: str
    config_sha256: str
    config: dict[str, Any] = Field(default_factory=dict, description="the resolved config as written to config_file")
    data_sha256: dict[str, str] = Field(default_factory=dict, description="train, validation rows; prompt template")
    data_dir: str | None = Field(None, description="the data snapshot folder holding those rows and the template")
    data_files_sha256: dict[str, str] = Field(
        default_factory=dict, description="a file-backed task's copied source files, by path"
    )
    reward_models: list[dict[str, Any]] = Field(
        default_factory=list,
        description="the reward model folders the "
        "run reads (not copied): name, path, sha256 (over its files) and "
        "files (each file's SHA-256, by relative path)",
    )
    init_from: str | None = None
    factors: dict[str, str] = Field(default_factory=dict)
    arm: str | None = Field(None, description="a decision suite's arm this run is a seed of")
    round: int | None = Field(None, description="a decision suite's round: the index of the run's seed")
    world_size: int = Field(1, description="processes (devices) of the run: more than 1 runs under torchrun")
    devices: list[str] | None = Field(None, description="CUDA_VISIBLE_DEVICES of its latest attempt, where known")
    host: str | None = None
    job_id: str | None = Field(None, description="the Slurm job of its latest attempt")
    job_state: str | None = Field(None, description="that job's state as the runner last saw it (PENDING, ...)")
    pid: int | None = None
    command: list[str] = Field(default_factory=list)
    exit_code: int | None = None
    started: str | None = None
    ended: str | None = None
    attempts: list[dict[str, Any]] = Field(default_factory=list, description="earlier attempts: command, exit, reason")
    waits: list[dict[str, Any]] = Field(
        default_factory=list,
        description="processes still training this run that a runner waited for before judging it: pid, since, until",
    )
    final_checkpoint: str | None = None
    final_checkpoint_sha256: str | None = None
    reason: str | None = None


class SuiteManifest(BaseModel):
    suite: str
    source_file: str
    created: str = Field(default_factory=now)
    code: dict[str, Any] = Field(default_factory=dict, description="version, git commit and dirty flag, sha256, path")
    placement: dict[str, Any] = Field(
        default_factory=dict,
        description="launcher, devices (None: one run at a time on what each run sees) and the Slurm settings",
    )
    runner_pid: int | None = None
    runner_host: str | None = None
    runner_seen: float | None = Field(None, description="when the runner last wrote (seconds since the epoch)")
    runs: list[RunRecord]
    decide: dict[str, Any] | None = Field(None, description="a decision suite's question ([decide])")
    decisions: list[dict[str, Any]] = Field(
        default_factory=list, description="a decision suite's rounds: comparisons, verdicts and the runs they read"
    )

    def save(self, root: Path) -> None:
        write_json(root / MANIFEST, self.model_dump(mode="json"))

    @classmethod
    def load(cls, root: Path) -> SuiteManifest:
        """The manifest of the suite in ``root``; one-line errors when it is missing or unreadable."""
        path = root / MANIFEST
        if not path.is_file():
            if (root / PREPARING).is_file():
                raise FileNotFoundError(
                    f"{root}: the suite's preparation was stopped before its {MANIFEST} was "
                    "written; run grpolab suite run SUITE.toml --output-root with this folder "
                    "again (it starts over)"
                )
            raise FileNotFoundError(f"not a suite directory (no {MANIFEST}): {root}")
        try:
            return cls.model_validate(json.loads(path.read_text()))
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: not valid JSON ({err}); not a readable suite manifest") from None
        except ValidationError as err:
            first = err.errors()[0]
            raise ValueError(
                f"{path}: not a suite manifest ({first['msg']} at "
                f"{'.'.join(map(str, first['loc'])) or 'the top level'})"
            ) from None
