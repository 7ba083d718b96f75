"""Runs as Slurm batch jobs: each attempt of a run is an sbatch script the suite writes and keeps
(ROOT/slurm/NAME.attempt-N.sbatch), submitted with ``sbatch --parsable``. The script runs the run's
command on the node Slurm gives it and records the command's exit code (ROOT/slurm/NAME.JOBID.exit), so
that a runner on any login node that sees the output root can tell, from the job id alone, whether a
job is still queued or running, ended with a code, or was ended by Slurm (cancelled, out of time).

Only the client commands are used (sbatch, squeue, scontrol, scancel): no accounting database is needed.
"""

from __future__ import annotations

import shlex
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from grpolab.studies.launchers import LaunchError

ACTIVE = {
    "PENDING",
    "CONFIGURING",
    "RUNNING",
    "COMPLETING",
    "SUSPENDED",
    "REQUEUED",
    "RESIZING",
    "STAGE_OUT",
    "SIGNALING",
    "REQUEUE_HOLD",
    "REQUEUE_FED",
    "RESV_DEL_HOLD",
    "STOPPED",
}
LOOK_SECONDS = 2.0  # squeue at most this often per job (every poll of many jobs would burden slurmctld)
ENDED_BY_SLURM = {"CANCELLED", "TIMEOUT", "PREEMPTED", "NODE_FAIL", "DEADLINE", "BOOT_FAIL"}


class SlurmError(LaunchError):
    """A Slurm client command failed; the message is its one-line reason."""


def slurm(*args: str, env: dict[str, str] | None = None) -> str:
    """Run a Slurm client command; its stdout, or ``SlurmError`` with its stderr's last line."""
    try:
        done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=120)
    except FileNotFoundError:
        raise SlurmError(f"{args[0]} not found: the slurm launcher needs Slurm's client commands on PATH") from None
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines()
        raise SlurmError(f"{' '.join(args[:2])} failed: {lines[-1] if lines else f'exit code {done.returncode}'}")
    return done.stdout


def sbatch_options(settings: dict[str, Any], job_name: str, log: Path, gpus: int) -> list[str]:
    """The ``#SBATCH`` options of a run: one node, one task, the suite's partition, time, account, CPUs and
    memory, ``gpus`` GPUs (none when 0), and the suite's extra options verbatim."""
    options = [f"--job-name={job_name}", f"--output={log}", "--open-mode=append", "--nodes=1", "--ntasks=1"]
    for key in ("partition", "time", "account", "mem", "qos"):
        if settings.get(key):
            options.append(f"--{key}={settings[key]}")
    if settings.get("cpus_per_run"):
        options.append(f"--cpus-per-task={settings['cpus_per_run']}")
    if gpus:
        options.append(f"--gpus={gpus}")
    return options + list(settings.get("extra", []))


def batch_script(options: list[str], command: list[str], env: dict[str, str], cwd: Path, exit_file: str) -> str:
    """The sbatch script: options, the environment the run needs, the command, and its exit code written
    atomically to ``exit_file`` (which may name ``$SLURM_JOB_ID``). A SIGTERM to the shell waits for the
    command (which got its own) instead of ending the shell first."""
    lines = [
        "#!/bin/bash",
        *(f"#SBATCH {option}" for option in options),
        "# written by grpolab suite",
        "trap 'echo \"grpolab: $(date) signal received, waiting for the run to stop\"' TERM INT",
        f"cd {shlex.quote(str(cwd))}",
    ]
    lines += [f"export {key}={shlex.quote(value)}" for key, value in sorted(env.items())]
    lines += [
        'echo "# $(date +%Y-%m-%dT%H:%M:%S%z) job $SLURM_JOB_ID on $(hostname), devices '
        "${CUDA_VISIBLE_DEVICES:-none}: " + shlex.join(command).replace('"', '\\"') + '"',
        shlex.join(command),
        "code=$?",
        f'echo "$code" > "{exit_file}.tmp" && mv "{exit_file}.tmp" "{exit_file}"',
        'exit "$code"',
    ]
    return "\n".join(lines) + "\n"


class SlurmJob:
    """One submitted job, followed by its id."""

    def __init__(self, ident: str, exit_file: Path, env: dict[str, str] | None = None):
        self.ident, self.exit_file, self.env = ident, exit_file, env
        self.state: str | None = None
        self.node: str | None = None
        self.note: str | None = None
        self.looked = float("-inf")

    def _look(self, fresh: bool = False) -> None:
        """The job's state and node from squeue (finished jobs too, while Slurm remembers them); a look
        less than LOOK_SECONDS old is reused unless ``fresh``."""
        if not fresh and time.monotonic() - self.looked < LOOK_SECONDS:
            return
        self.looked = time.monotonic()
        try:
            out = slurm("squeue", "-h", "-j", self.ident, "--states=all", "-o", "%T|%N", env=self.env).strip()
        except SlurmError:  # an id Slurm no longer knows
            out = ""
        state, _, node = out.partition("|")
        self.state = state or None
        self.node = node or self.node

    def poll(self) -> int | None:
        self._look()
        if self.state in ACTIVE:
            return None
        if self.exit_file.is_file():
            if self.state in ENDED_BY_SLURM:
                self.note = f"Slurm job {self.ident} was {self.state}"
            text = self.exit_file.read_text().strip()
            return int(text) if text.lstrip("-").isdigit() else 1
        ended = self.state or "unknown to Slurm now"
        self.note = f"Slurm job {self.ident} ended ({ended}) before its command recorded an exit code"
        return -signal.SIGTERM if self.state in ENDED_BY_SLURM or self.state is None else 1

    def stop(self) -> None:
        """A pending job is cancelled; a running one gets SIGTERM in every process of its batch step."""
        self._look(fresh=True)
        if self.state == "PENDING":
            slurm("scancel", self.ident, env=self.env)
        elif self.state in ACTIVE:
            slurm("scancel", "--signal=TERM", "--full", self.ident, env=self.env)

    def kill(self) -> None:
        try:
            slurm("scancel", self.ident, env=self.env)
        except SlurmError:
            pass

    def where(self) -> dict[str, str | None]:
        return {"host": self.node, "job_id": self.ident, "job_state": self.state}


def submit(script: Path, env: dict[str, str], exit_file_of: str) -> SlurmJob:
    """``sbatch --parsable script``; ``exit_file_of`` names the exit file with ``{job}`` for the job id."""
    out = slurm("sbatch", "--parsable", str(script), env=env).strip()
    ident = out.split(";")[0]
    if not ident.isdigit():
        raise SlurmError(f"sbatch answered {out!r}, not a job id")
    return SlurmJob(ident, Path(exit_file_of.format(job=ident)), env)
