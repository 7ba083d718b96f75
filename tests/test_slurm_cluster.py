"""The ``slurm_cluster`` fixture runs real jobs: sbatch, squeue / scontrol, scancel."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from slurm_cluster import SlurmCluster

pytest_plugins = ["slurm_cluster"]  # tests/slurm_cluster.py: the slurm_cluster fixture


def job_state(cluster: SlurmCluster, job_id: str) -> str:
    """JobState from ``scontrol show job`` (finished jobs stay visible: MinJobAge=600)."""
    return re.search(r"JobState=(\S+)", cluster.run("scontrol", "show", "job", job_id)).group(1)


def wait_state(cluster: SlurmCluster, job_id: str, states: set[str], timeout: float = 60) -> str:
    """Poll until the job's state is one of ``states``; fail with the last state on timeout."""
    deadline = time.monotonic() + timeout
    while (state := job_state(cluster, job_id)) not in states:
        assert time.monotonic() < deadline, f"job {job_id} still {state} after {timeout} s"
        time.sleep(0.1)
    return state


def submit(cluster: SlurmCluster, tmp_path: Path, body: str) -> str:
    """sbatch a bash script with ``body`` (run in tmp_path, output there); the job id."""
    script = tmp_path / "job.sh"
    script.write_text(f"#!/bin/bash\n{body}\n")
    out = cluster.run("sbatch", "--parsable", f"--chdir={tmp_path}", f"--output={tmp_path}/slurm-%j.out", str(script))
    return out.strip().split(";")[0]


def test_batch_job_runs_and_writes_its_id(slurm_cluster: SlurmCluster, tmp_path: Path):
    out = tmp_path / "out.txt"
    job_id = submit(slurm_cluster, tmp_path, f'echo "$SLURM_JOB_ID $(hostname)" > {out}')
    assert wait_state(slurm_cluster, job_id, {"COMPLETED", "FAILED", "CANCELLED"}) == "COMPLETED"
    written_id, host = out.read_text().split()
    assert written_id == job_id and host.split(".")[0] == slurm_cluster.node
    assert job_id not in slurm_cluster.run("squeue", "-h", "-o", "%i").split()


def test_scancel_ends_a_running_job(slurm_cluster: SlurmCluster, tmp_path: Path):
    job_id = submit(slurm_cluster, tmp_path, "sleep 600")
    wait_state(slurm_cluster, job_id, {"RUNNING"})
    assert job_id in slurm_cluster.run("squeue", "-h", "-o", "%i").split()
    slurm_cluster.run("scancel", job_id)
    # COMPLETING until the step's processes are gone (sleep dies on SIGTERM at once)
    assert wait_state(slurm_cluster, job_id, {"CANCELLED", "COMPLETED", "FAILED"}, 30) == "CANCELLED"
