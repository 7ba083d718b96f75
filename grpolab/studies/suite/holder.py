"""Who is training a run right now: the process holding its run directory's lock or, in the seconds
before a trainer takes the lock, a live ``train`` of this run on this host (the runner's recorded child, or
one a runner killed before it recorded it). A suite never starts a second trainer on a run while one of
them lives."""

from __future__ import annotations

import os
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
    read), or None when none is: the lock's holder, else the recorded pid, else any process of this host
    whose command line trains the run."""
    holder = lock_holder(Path(record.run_dir))
    if holder is not None:
        return holder
    if record.pid is not None and trains(record.pid, record):
        return record.pid
    try:
        pids = sorted(int(entry) for entry in os.listdir("/proc") if entry.isdigit())
    except OSError:  # no /proc here: the lock alone tells
        return None
    return next((pid for pid in pids if trains(pid, record)), None)
