"""What the suite runner needs of each launcher, one class per launcher: where the runs go (the placement the
manifest records), whether the runner places them on its own device list or the launcher's scheduler does,
how an attempt of a run starts, and whether a job an earlier runner left can still be followed.

``LAUNCHERS`` holds them by the name ``placement["launcher"]`` records; ``suite_launcher`` builds the one of a
placement (no launcher recorded: local).
"""

from __future__ import annotations

import os
import shutil
import socket
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, ClassVar

from rich.console import Console

from grpolab.studies.launchers import Job
from grpolab.studies.launchers.local import start_local
from grpolab.studies.launchers.slurm import SlurmJob
from grpolab.studies.manifest import RunRecord, now
from grpolab.studies.suite.placement import ONE_AT_A_TIME, DevicePool
from grpolab.studies.suite.slurm_jobs import exit_file, submit_run
from grpolab.studies.suite.spec import SuiteSpec


class SuiteLauncher(ABC):
    """A launcher as the suite runner uses it, built from the manifest's ``placement``."""

    name: ClassVar[str]

    def __init__(self, placement: dict[str, Any]):
        self.placement = placement

    @classmethod
    @abstractmethod
    def place(cls, spec: SuiteSpec, devices: list[str] | None, slurm: dict[str, Any] | None) -> dict[str, Any]:
        """The placement of ``spec``'s runs (what the manifest records) on the listed ``devices`` (None: not
        listed) with the command line's Slurm settings; one-line errors."""

    @property
    def devices(self) -> list[str] | None:
        """The devices the runner places runs on; None: one run at a time on what each run sees, or the
        launcher's scheduler places them."""
        return None

    def device_pool(self) -> DevicePool | None:
        """The runner's pool of devices to place runs on; None: the launcher's scheduler places them."""
        return None

    @classmethod
    def refuse_device_list(cls, setting: str = "") -> None:
        """Raise when runs cannot be placed on a list of devices (``setting``: where else the list is given)."""

    @abstractmethod
    def print_placement(self, console: Console) -> None:
        """The dry run's line on where the runs go."""

    @abstractmethod
    def start(self, root: Path, suite: str, record: RunRecord, env: dict[str, str], log: Path) -> tuple[Job, str]:
        """Start ``record.command`` (``env``: what it needs beside this process's environment; its output
        appended to ``log``), record the job's ids in ``record``, and hand back the job and how it started."""

    def follow(self, root: Path, record: RunRecord) -> Job | None:
        """The job an earlier runner started for ``record`` that this launcher still follows; None: none (a
        local process still training the run is waited for by its pid instead)."""
        return None


class LocalLauncher(SuiteLauncher):
    """Child processes of the runner, placed on the listed devices (or one run at a time)."""

    name = "local"

    @classmethod
    def place(cls, spec: SuiteSpec, devices: list[str] | None, slurm: dict[str, Any] | None) -> dict[str, Any]:
        widest = max(spec.runs, key=lambda run: run.devices_per_run or 1)
        if devices is not None and (widest.devices_per_run or 1) > len(devices):
            raise ValueError(
                f"run {widest.name} needs {widest.devices_per_run} devices; only {len(devices)} are "
                f"listed ({','.join(devices)})"
            )
        return {"launcher": cls.name, "devices": devices, "slurm": None}

    @property
    def devices(self) -> list[str] | None:
        return self.placement["devices"] if self.placement.get("devices") else None

    def device_pool(self) -> DevicePool:
        return DevicePool(self.devices or [ONE_AT_A_TIME])

    def print_placement(self, console: Console) -> None:
        console.print(
            "placement: "
            + (
                f"devices {','.join(self.devices)}, as many runs at once as fit"
                if self.devices
                else "one run at a time"
            ),
            highlight=False,
        )

    def start(self, root: Path, suite: str, record: RunRecord, env: dict[str, str], log: Path) -> tuple[Job, str]:
        with log.open("a") as out:
            out.write(f"# {now()} {' '.join(record.command)}\n")
        job = start_local(record.command, {**os.environ, **env}, log, root)
        record.pid, record.host = int(job.ident), socket.gethostname()
        return job, f"started (pid {job.ident})"


class SlurmLauncher(SuiteLauncher):
    """One Slurm batch job per attempt of a run; Slurm places it."""

    name = "slurm"

    @classmethod
    def place(cls, spec: SuiteSpec, devices: list[str] | None, slurm: dict[str, Any] | None) -> dict[str, Any]:
        if devices is not None:
            cls.refuse_device_list(" ([suite] devices)")
        if shutil.which("sbatch") is None:
            raise ValueError("the slurm launcher needs Slurm's client commands (sbatch, squeue, scancel) on PATH")
        settings = spec.slurm.model_copy(update={k: v for k, v in (slurm or {}).items() if v is not None})
        return {"launcher": cls.name, "devices": None, "slurm": settings.model_dump()}

    @classmethod
    def refuse_device_list(cls, setting: str = "") -> None:
        raise ValueError(f"devices are placed by Slurm with the slurm launcher: leave out --devices{setting}")

    def print_placement(self, console: Console) -> None:
        console.print(
            f"placement: one Slurm batch job per run, {self.placement['slurm']}", highlight=False, soft_wrap=True
        )

    def start(self, root: Path, suite: str, record: RunRecord, env: dict[str, str], log: Path) -> tuple[Job, str]:
        job = submit_run(root, suite, record, env, self.placement["slurm"])
        record.job_id = job.ident
        return job, f"submitted as Slurm job {job.ident}"

    def follow(self, root: Path, record: RunRecord) -> Job | None:
        if record.job_id is None:
            return None
        return SlurmJob(record.job_id, exit_file(root, record.name, record.job_id))


LAUNCHERS: dict[str, type[SuiteLauncher]] = {cls.name: cls for cls in (LocalLauncher, SlurmLauncher)}


def suite_launcher(placement: dict[str, Any] | None) -> SuiteLauncher:
    """The launcher of a manifest's ``placement`` (none recorded: local)."""
    placement = placement or {}
    return LAUNCHERS[placement.get("launcher") or LocalLauncher.name](placement)
