"""Who is training a run right now: the process holding its run directory's lock or, in the seconds
before a trainer takes the lock, the runner's recorded child while it is still a ``train`` of this run.
A suite never starts a second trainer on a run while one of them lives."""

from __future__ import annotations

from pathlib import Path

from grpolab.run.lock import lock_holder
from grpolab.studies.manifest import RunRecord


def command_line(pid: int) -> list[str]:
    """The arguments of a live process (none when it is gone, a zombie, or not readable here)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [arg.decode(errors="replace") for arg in raw.split(b"\0") if arg]


def trains(pid: int, record: RunRecord) -> bool:
    """Whether ``pid`` is a ``grpolab.commands.cli train`` of this run (its config file or its run directory)."""
    args = command_line(pid)
    return "grpolab.commands.cli" in args and "train" in args and (record.config_file in args or record.run_dir in args)


def run_holder(record: RunRecord) -> int | None:
    """The pid of a live process training the run (0 when its lock is held by a process whose pid cannot be
    read), or None when none is."""
    holder = lock_holder(Path(record.run_dir))
    if holder is not None:
        return holder
    if record.state == "running" and record.pid is not None and trains(record.pid, record):
        return record.pid
    return None
