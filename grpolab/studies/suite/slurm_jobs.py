"""A suite's runs as Slurm batch jobs: each attempt's sbatch script kept at ROOT/slurm/NAME.attempt-N.sbatch,
its output appended to the run's log, its exit code at ROOT/slurm/NAME.JOBID.exit."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from grpolab.studies.launchers.slurm import SlurmJob, batch_script, sbatch_options, submit
from grpolab.studies.manifest import RunRecord

SLURM_DIR = "slurm"


def exit_file(root: Path, name: str, job: str) -> Path:
    return root / SLURM_DIR / f"{name}.{job}.exit"


def submit_run(root: Path, suite: str, record: RunRecord, env: dict[str, str], settings: dict[str, Any]) -> SlurmJob:
    """Write the run's next sbatch script (job name SUITE.RUN) and submit it."""
    folder = root / SLURM_DIR
    folder.mkdir(exist_ok=True)
    n = 1
    while (folder / f"{record.name}.attempt-{n}.sbatch").exists():
        n += 1
    script = folder / f"{record.name}.attempt-{n}.sbatch"
    gpus = record.world_size * settings.get("gpus_per_device", 1)
    options = sbatch_options(settings, f"{suite}.{record.name}", root / "logs" / f"{record.name}.log", gpus)
    script.write_text(
        batch_script(options, record.command, env, root, str(exit_file(root, record.name, "$SLURM_JOB_ID")))
    )
    return submit(script, {**os.environ, **env}, str(exit_file(root, record.name, "{job}")))
