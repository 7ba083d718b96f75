"""One writer per run directory, enforced by the operating system: an advisory ``flock`` on
RUN_DIR/.grpolab.lock, held for the trainer's whole lifetime and released by the kernel when its process
dies (however it dies). The file holds the holder's pid, so that whoever finds the lock taken can say
which process holds it."""

from __future__ import annotations

import errno
import fcntl
import os
import time
from pathlib import Path

from grpolab.run.rundir import LOCK_FILE, RunDirError


class RunLocked(RunDirError):
    """Another live process holds the run directory's lock; nothing was written."""

    def __init__(self, run_dir: Path, pid: int | None):
        self.pid = pid
        holder = f"process {pid}" if pid else "another process"
        super().__init__(
            f"run directory {run_dir} is in use by {holder} (a trainer holds its lock); "
            "wait for it to end or stop it, then retry"
        )


def _read_pid(fd: int) -> int | None:
    text = os.pread(fd, 32, 0).decode(errors="replace").strip()
    return int(text) if text.isdigit() else None


class RunLock:
    """The exclusive lock of ``run_dir`` (which must exist). ``acquire`` refuses with ``RunLocked`` naming
    the holder's pid; a brief hold by ``lock_holder`` (a probe) is waited out for ``patience`` seconds."""

    def __init__(self, run_dir: Path):
        self.run_dir, self.fd = Path(run_dir), None

    def acquire(self, patience: float = 1.0) -> RunLock:
        fd = os.open(self.run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + patience
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as err:
                if err.errno not in (errno.EAGAIN, errno.EACCES) or time.monotonic() > deadline:
                    pid = _read_pid(fd)
                    os.close(fd)
                    raise RunLocked(self.run_dir, pid) from None
                time.sleep(0.05)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the last descriptor releases the flock
            self.fd = None


def lock_holder(run_dir: Path) -> int | None:
    """The pid holding ``run_dir``'s lock (0 when it cannot be read), or None when nobody holds it (or
    the directory has no lock file). Creates nothing."""
    try:
        fd = os.open(Path(run_dir) / LOCK_FILE, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return _read_pid(fd) or 0
    else:
        return None
    finally:
        os.close(fd)
