"""A run's record of itself: ``config.json`` (the resolved config) and ``manifest.json`` (what started the
run, the SHA-256 of its config, every resume and every session's seconds), rewritten atomically."""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from grpolab.common.provenance import code_commit, cpu_description
from grpolab.common.records import config_sha256
from grpolab.config import read_config_json
from grpolab.run.rundir import CONFIG_FILE, MANIFEST_FILE, write_json

CONFIG, MANIFEST = CONFIG_FILE, MANIFEST_FILE


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def where_this_runs() -> dict[str, Any]:
    """Host, its CPU, grpolab's commit, visible devices, Slurm job and world size of this process (torchrun and
    Slurm set them)."""
    return {
        "host": socket.gethostname(),
        "cpu": cpu_description(),
        "grpolab_commit": code_commit(),
        "devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
        "world_size": int(os.environ.get("WORLD_SIZE", "1")),
    }


class RunJournal:
    """The manifest of the run in ``run_dir``; ``session`` is this process's entry in its ``sessions``."""

    def __init__(self, run_dir: Path, data: dict[str, Any]):
        self.run_dir, self.data = Path(run_dir), data

    @classmethod
    def load(cls, run_dir: Path) -> RunJournal:
        """The manifest on disk; one-line errors when it is missing or unreadable."""
        path = Path(run_dir) / MANIFEST
        if not path.is_file():
            raise FileNotFoundError(f"nothing to resume in {run_dir}: no {MANIFEST}")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: not valid JSON ({err}); the run cannot be verified") from None
        if not isinstance(data, dict) or not isinstance(data.get("config"), dict) or "config_sha256" not in data:
            raise ValueError(f"{path}: no recorded config and config_sha256; the run cannot be verified")
        return cls(run_dir, data)

    @classmethod
    def create(cls, run_dir: Path, config: dict[str, Any], record: dict[str, Any]) -> RunJournal:
        """A new run: config.json, then manifest.json with ``record``, the config and its SHA-256."""
        config = json.loads(json.dumps(config))  # as it reads back from config.json
        write_json(Path(run_dir) / CONFIG, config)
        journal = cls(
            run_dir,
            {**record, "config": config, "config_sha256": config_sha256(config), "started": now(), "sessions": []},
        )
        journal.begin_session(0)
        return journal

    def recorded_config(self) -> dict[str, Any]:
        return self.data["config"]

    def config_on_disk(self) -> dict[str, Any]:
        return read_config_json(self.run_dir / CONFIG)

    def record_resume(
        self,
        checkpoint: Path | None,
        step: int,
        changes: dict[str, Any],
        damaged: list[tuple[Path, str]],
        removed_temps: list[Path],
    ) -> None:
        """A resume from ``checkpoint`` (its ``step``; None: a run with no checkpoint yet, started again from step
        0) with top-level config ``changes`` (a grown ``steps``: config.json is rewritten with them), the
        damaged checkpoints set aside and the temp folders removed."""
        entry: dict[str, Any] = {
            "from_checkpoint": None if checkpoint is None else str(checkpoint),
            "step": step,
            "command": sys.argv,
            "at": now(),
        }
        before = self.data["config"]
        changed = {k: {"from": before.get(k), "to": v} for k, v in changes.items() if before.get(k) != v}
        if changed:
            entry["changed"] = changed
            config = {**before, **changes}
            write_json(self.run_dir / CONFIG, config)
            self.data.update(config=config, config_sha256=config_sha256(config))
        if damaged:
            entry["damaged_checkpoints"] = [{"checkpoint": str(p), "problem": why} for p, why in damaged]
        if removed_temps:
            entry["removed_temp_folders"] = [p.name for p in removed_temps]
        self.data.setdefault("resumes", []).append(entry)
        self.begin_session(step)

    def begin_session(self, step: int) -> None:
        self.data["sessions"].append(
            {"started": now(), "from_step": step, "to_step": step, "seconds": 0.0, "where": where_this_runs()}
        )
        self.save()

    def tick(self, step: int, seconds: float) -> None:
        """This session reached ``step`` after ``seconds`` of training."""
        self.data["sessions"][-1].update(to_step=step, seconds=seconds)
        self.save()

    def record_trackers(self, runs: dict[str, Any]) -> None:
        """The tracker runs this run logs to (``log.trackers``: a W&B run id, a Trackio run name), which every
        resume continues."""
        self.data["trackers"] = runs
        self.save()

    def record_tracker_modes(self, modes: dict[str, str]) -> None:
        """How this session's trackers log (W&B online or offline, ...)."""
        self.data["sessions"][-1]["trackers"] = modes
        self.save()

    @property
    def session_number(self) -> int:
        return len(self.data["sessions"])

    def total_seconds(self) -> float:
        """Training seconds over every session (a killed session counts up to its last recorded step): the run's
        wall time (``grpolab.run.rundir.wall_seconds``)."""
        return sum(s["seconds"] for s in self.data["sessions"])

    def save(self) -> None:
        write_json(self.run_dir / MANIFEST, self.data)
