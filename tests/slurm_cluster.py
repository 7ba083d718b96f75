"""A real one-node Slurm cluster for tests: the session fixture ``slurm_cluster`` (skips without Slurm).

slurmctld and slurmd run in the foreground (``-D``) as children of pytest, from a slurm.conf in a
tmp dir that also holds their state, spool, pid files and logs; nothing under /etc or /var is
touched. auth/none + cred/none (no munge), no cgroups, no accounting (``sacct`` fails: "Slurm
accounting storage is disabled"), free ports picked at start. Every Slurm command of a test, and of
the code under test, must get ``cluster.env``: its ``SLURM_CONF`` names this cluster.

Use it from a test module with ``pytest_plugins = ["slurm_cluster"]``. Finished jobs stay visible to
``scontrol show job`` for 10 min (MinJobAge=600; plain ``squeue`` hides them); a job whose processes
survive SIGTERM stays COMPLETING for KillWait=60 s.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

_SBIN_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
# Dropped from env: they would change what sbatch/squeue/... do or print (defaults, formats).
_SLURM_VARS = ("SLURM_", "SBATCH_", "SALLOC_", "SRUN_", "SQUEUE_", "SINFO_", "SCANCEL_", "SACCT_")
_HW_KEYS = ("CPUs", "Boards", "SocketsPerBoard", "CoresPerSocket", "ThreadsPerCore", "RealMemory")
_CONF = """\
ClusterName=grpolab-test
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
SchedulerParameters=batch_sched_delay=0
MpiDefault=none
ReturnToService=2
KillWait=60
MinJobAge=600
NodeName={node} NodeAddr=127.0.0.1 {hardware} State=UNKNOWN
PartitionName={partition} Nodes={node} Default=YES MaxTime=INFINITE State=UP
"""


@dataclass
class SlurmCluster:
    """A running cluster: its slurm.conf, the environment for its client commands, its partition."""

    conf: Path
    env: dict[str, str]
    partition: str
    node: str
    root: Path  # the tmp dir with slurm.conf, state/, spool/, slurmctld.log, slurmd.log
    procs: list[subprocess.Popen] = field(default_factory=list, repr=False)

    def run(self, *args: str, timeout: float = 30) -> str:
        """Run a client command (``run("squeue", "-h")``) with ``env``: its stdout; raise with stderr."""
        res = subprocess.run(args, env=self.env, capture_output=True, text=True, timeout=timeout)
        if res.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} failed (rc {res.returncode}): {res.stderr.strip()}")
        return res.stdout

    def logs(self, lines: int = 30) -> str:
        """The last ``lines`` lines of both daemons' logs."""
        paths = [self.root / f"{daemon}.log" for daemon in ("slurmctld", "slurmd")]
        tails = ["\n".join(p.read_text(errors="replace").splitlines()[-lines:]) if p.exists() else "" for p in paths]
        return "\n".join(f"--- {p} ---\n{tail}" for p, tail in zip(paths, tails, strict=True))

    def ready(self) -> bool:
        """The node is idle and the main scheduler has run once: ~3 s after slurmctld starts (no
        job starts before); from then on a submitted job starts within ~1 s."""
        try:
            if self.run("sinfo", "-h", "-o", "%T", timeout=10).strip() != "idle":
                return False
            cycles = re.search(r"Main schedule.*?Total cycles:\s*(\d+)", self.run("sdiag"), re.DOTALL)
            return cycles is None or int(cycles.group(1)) > 0
        except (RuntimeError, subprocess.TimeoutExpired):
            return False


def _write_conf(root: Path, node: str, partition: str, slurmd: str) -> Path:
    """slurm.conf for one node with the hardware ``slurmd -C`` reports, on two free ports."""
    out = subprocess.run([slurmd, "-C"], capture_output=True, text=True, timeout=30).stdout
    hw = dict(kv.split("=", 1) for kv in out.split() if "=" in kv)
    if "CPUs" not in hw:  # a safe fallback: all CPUs, (almost) no memory
        hw = {"CPUs": str(os.cpu_count() or 1), "RealMemory": "1"}
    hardware = " ".join(f"{k}={hw[k]}" for k in _HW_KEYS if k in hw)
    with socket.socket() as s1, socket.socket() as s2:  # bound together: two distinct ports
        s1.bind(("", 0))
        s2.bind(("", 0))
        ctld_port, slurmd_port = s1.getsockname()[1], s2.getsockname()[1]
    (root / "state").mkdir()
    (root / "spool").mkdir()
    conf = root / "slurm.conf"
    conf.write_text(
        _CONF.format(
            root=root, node=node, partition=partition, hardware=hardware, ctld_port=ctld_port, slurmd_port=slurmd_port
        )
    )
    return conf


def _kill_job_processes(conf: Path) -> None:
    """SIGKILL every slurmstepd of this cluster (SLURM_CONF=conf in its environment) and its job,
    i.e. every process of the stepd's session (job processes leave it only by calling setsid)."""
    marker, stepd_sids, sids = f"SLURM_CONF={conf}".encode(), set(), {}
    for proc in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError):  # gone meanwhile
            sids[int(proc.name)] = os.getsid(int(proc.name))
            if (proc / "cmdline").read_bytes().startswith(b"slurmstepd") and marker in (
                proc / "environ"
            ).read_bytes().split(b"\0"):
                stepd_sids.add(sids[int(proc.name)])
    stepd_sids.discard(os.getsid(0))
    for pid, sid in sids.items():
        if sid in stepd_sids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


def _stop(procs: list[subprocess.Popen]) -> None:
    """SIGTERM the daemons, SIGKILL those still alive after 5 s."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory):
    """Start slurmctld + slurmd (one node, partition ``debug``), wait until they schedule, yield a
    ``SlurmCluster``; at the end cancel all jobs, stop the daemons, kill leftover job steps."""
    slurmctld, slurmd = (shutil.which(d, path=_SBIN_PATH) for d in ("slurmctld", "slurmd"))
    if not (slurmctld and slurmd and shutil.which("sbatch")):
        pytest.skip("Slurm is not installed (Debian: apt-get install slurmctld slurmd slurm-client)")
    root = tmp_path_factory.mktemp("slurm")
    node, partition = socket.gethostname().split(".")[0], "debug"
    conf = _write_conf(root, node, partition, slurmd)
    env = {k: v for k, v in os.environ.items() if not k.startswith(_SLURM_VARS)}
    env["SLURM_CONF"] = str(conf)
    cluster = SlurmCluster(conf=conf, env=env, partition=partition, node=node, root=root)
    try:
        for daemon in (slurmctld, slurmd):
            with open(root / f"{Path(daemon).name}.log", "wb") as log:
                cluster.procs.append(
                    subprocess.Popen(
                        [daemon, "-D", "-f", str(conf)],
                        env=env,
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
        deadline = time.monotonic() + 60
        while not cluster.ready():
            exits = [p.poll() for p in cluster.procs]
            if time.monotonic() > deadline or exits != [None, None]:
                raise RuntimeError(f"Slurm not up (60 s, or exit codes {exits}):\n{cluster.logs()}")
            time.sleep(0.2)
        yield cluster
    finally:
        with contextlib.suppress(RuntimeError, OSError, subprocess.TimeoutExpired):
            if ids := cluster.run("squeue", "-h", "-o", "%i", timeout=10).split():
                subprocess.run(["scancel", *ids], env=env, capture_output=True, timeout=10)
                time.sleep(1)  # let the steps deliver SIGTERM before everything is killed
        _kill_job_processes(conf)  # before the daemons: slurmd's shutdown waits for live steps
        _stop(cluster.procs)
        _kill_job_processes(conf)
