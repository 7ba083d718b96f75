"""How many CPU threads torch may use without fighting other work for the cores.

OpenMP threads that outnumber the free cores wait on each other at every parallel region: on a busy
2-core machine the demo's tiny model ran 2.6x slower with 2 threads than with 1 (and such
oversubscription has cost tiny models up to 100x on larger machines). ``choose_threads`` measures
how many cores other processes keep busy and stays within the rest.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ThreadChoice:
    threads: int
    cores: int
    busy: float  # cores kept busy by other processes
    note: str  # one line for the log; a warning when an explicit setting oversubscribes


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _cpu_times() -> tuple[int, int] | None:
    """(busy, total) jiffies of all cores from /proc/stat; None where there is no /proc."""
    try:
        fields = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


def busy_cores(window: float = 0.5) -> float:
    """Cores kept busy by other processes, measured over ``window`` seconds while this one sleeps
    (/proc/stat); elsewhere the 1-minute load average."""
    before = _cpu_times()
    if before is None:
        return os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    time.sleep(window)
    after = _cpu_times()
    total = after[1] - before[1]
    return 0.0 if total <= 0 else (after[0] - before[0]) / total * (os.cpu_count() or 1)


def choose_threads(requested: int | None, busy: float | None = None) -> ThreadChoice:
    """``requested`` threads, with a warning when they outnumber the free cores; None picks the free
    cores (at least 1, at most torch's current setting)."""
    cores = usable_cores()
    busy = busy_cores() if busy is None else busy
    free = max(1, cores - round(busy))
    if requested is None:
        threads = min(torch.get_num_threads(), free)
        note = f"cpu threads: {threads} ({cores} cores, {busy:.1f} busy with other work; --threads N to choose)"
    else:
        threads = requested
        note = f"cpu threads: {threads} ({cores} cores, {busy:.1f} busy with other work)"
        if threads > free:
            note = (
                f"warning: --threads {threads} but only {free} of {cores} cores are free ({busy:.1f} busy with "
                f"other work): oversubscribed threads can slow small models by orders of magnitude; "
                f"--threads {free} avoids it"
            )
    return ThreadChoice(threads, cores, busy, note)
