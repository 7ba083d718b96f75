"""Untrusted Python, run in a real sandbox: bubblewrap (``bwrap``) with new user, pid, ipc, uts, cgroup and network
namespaces (no network at all, loopback included), a read-only view of ``/usr`` and the interpreter, nothing
else of the host's filesystem (no run directory, cache, home directory or ``/etc``; a ``/proc`` of its own
processes only), a fresh tmpfs as its working directory, an unprivileged user inside (uid 65534, never 0), every
capability dropped, no nested user namespaces, and a cleared environment (the trainer's API keys and tracker
tokens never enter).

Limits, per call (``SandboxLimits``): CPU seconds, address space, processes, file size and open files as
rlimits; a wall-clock limit that kills the whole sandbox (bwrap is started in a session of its own and killed
with its group; its process inside dies with it, and with that pid namespace's first process every process
of the namespace); stdout and stderr capped while they are read (a call that prints past the cap is killed).
When the trainer runs as root (as in CI), bwrap runs under a uid of its own per call, taken in turn from
``SANDBOX_UIDS``, so that the process limit counts that call's processes only (root is exempt from it; and a
call's exited processes may wait a few seconds for the host's init to reap them, still counted against their
uid, so a uid comes back only thousands of calls later).

A call's outcome is a ``CodeRun``: ``ok`` (exit 0), ``error`` (the code raised or exited non-zero),
``timeout`` (the wall-clock or CPU limit), ``killed`` (a signal: the memory limit, ...), ``output_limit``:
all the code's own doing, which a task grades and a tool reports; and ``sandbox_failed``, when the sandbox
itself could not run the call (bwrap could not start): an infrastructure failure, never a verdict on the code.

Where bubblewrap cannot run (not installed, no user namespaces, macOS), ``CodeSandbox`` refuses in one line
(``SandboxUnavailable``) unless ``unsafe`` is set: then the code runs as a plain subprocess with the same
rlimits, environment and temporary directory but no isolation, for trusted code only, and says so loudly.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import resource
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

SANDBOX_UIDS = range(1_500_000_000, 1_500_004_096)  # host uids bwrap runs under when the trainer is root, in turn
INSIDE_UID = 65534  # the user the code runs as, inside (nobody)
WORKDIR = "/sandbox"
STATUSES = ("ok", "error", "timeout", "killed", "output_limit", "sandbox_failed")
BWRAP_MISSING = (
    "the code sandbox needs bubblewrap (Debian/Ubuntu: apt-get install bubblewrap) with user namespaces; "
    "for trusted code only, set task.tools.sandbox.unsafe = true to run it without isolation"
)


class SandboxUnavailable(ValueError):
    """bubblewrap cannot run here: a config that asks for the sandbox cannot run (one line: what is missing and
    what to do)."""


@dataclass(frozen=True)
class SandboxLimits:
    """What one call may use. ``memory_bytes`` bounds the address space (an interpreter needs about 30 MB);
    ``processes`` the processes and threads of the sandbox's user; ``output_bytes`` each of stdout and stderr."""

    wall_seconds: float = 10.0
    cpu_seconds: int = 5
    memory_bytes: int = 512 << 20
    processes: int = 32
    file_bytes: int = 8 << 20
    open_files: int = 64
    output_bytes: int = 64 << 10
    tmpfs_bytes: int = 64 << 20


@dataclass(frozen=True)
class CodeRun:
    """One call's outcome (``status`` one of ``STATUSES``), its output (capped; bytes that are not UTF-8
    replaced), its exit code (None when killed or not started) and its wall-clock seconds."""

    status: str
    stdout: str
    stderr: str
    exit_code: int | None
    seconds: float

    @property
    def failed(self) -> bool:
        """The sandbox, not the code, failed: the call says nothing about the code."""
        return self.status == "sandbox_failed"


class CodeSandbox:
    """Runs Python source in a fresh bubblewrap sandbox per call (``run``), or many at once in a pool of
    ``workers`` (``run_many``; default: the machine's cores).

    python: the interpreter inside (default: ``/usr/bin/python3`` where it exists, else this one); it runs with
        ``-I -S`` (isolated: no user site, no ``PYTHON*`` variables, no site-packages): the standard library only.
    unsafe: no isolation (trusted code only; see the module's docstring).
    """

    def __init__(
        self,
        limits: SandboxLimits = SandboxLimits(),
        python: str | None = None,
        unsafe: bool = False,
        workers: int | None = None,
    ):
        self.limits, self.unsafe = limits, unsafe
        self.python = python or ("/usr/bin/python3" if Path("/usr/bin/python3").exists() else sys.executable)
        self.workers = max(1, workers or os.cpu_count() or 1)
        self.calls = itertools.count()  # thread-safe: each call takes the next uid
        self.mounts = [*_system_mounts(), *_interpreter_mounts(self.python)]  # the same for every call
        if unsafe:
            print(
                "WARNING: sandbox.unsafe: the model's code runs WITHOUT isolation (a plain subprocess with "
                "rlimits): it can read and write your files and reach the network; only for trusted code",
                file=sys.stderr,
                flush=True,
            )
            return
        if shutil.which("bwrap") is None:
            raise SandboxUnavailable(f"bwrap not found: {BWRAP_MISSING}")
        probe = self.run("print(6 * 7)")
        if probe.status != "ok" or probe.stdout.strip() != "42":
            last = (probe.stderr.strip().splitlines() or [probe.status])[-1]
            raise SandboxUnavailable(f"bwrap cannot start a sandbox here ({last}): {BWRAP_MISSING}")

    def run(self, code: str) -> CodeRun:
        """Run ``code`` (a Python program: its stdout and stderr are the result) in a sandbox of its own."""
        with _program_file(code) as program:
            command, pass_fds, demote_to = self._command(program, next(self.calls))
            return _execute(command, pass_fds, self.limits, demote_to, sandboxed=not self.unsafe)

    def run_many(self, codes: Sequence[str]) -> list[CodeRun]:
        """``run`` for each of ``codes``, ``workers`` at a time, in their order."""
        with ThreadPoolExecutor(self.workers) as pool:
            return list(pool.map(self.run, codes))

    def _command(self, program, call: int) -> tuple[list[str], tuple[int, ...], int | None]:
        """(the command line, the descriptors it reads, the host uid to run it under or None)."""
        root = os.geteuid() == 0
        if self.unsafe:
            return [self.python, "-I", "-S", f"/dev/fd/{program.fileno()}"], (program.fileno(),), None
        command = [
            "bwrap",
            "--unshare-user",
            "--unshare-pid",
            "--unshare-ipc",
            "--unshare-uts",
            "--unshare-net",
            "--unshare-cgroup-try",
            "--disable-userns",
            "--uid",
            str(INSIDE_UID),
            "--gid",
            str(INSIDE_UID),
            "--cap-drop",
            "ALL",
            "--die-with-parent",
            "--new-session",
            "--clearenv",
            "--setenv",
            "PATH",
            "/usr/bin:/bin",
            "--setenv",
            "HOME",
            WORKDIR,
            "--setenv",
            "PYTHONDONTWRITEBYTECODE",
            "1",
            "--hostname",
            "sandbox",
            *self.mounts,
            "--proc",
            "/proc",
            "--dev",
            "/dev",
            "--size",
            str(self.limits.tmpfs_bytes),
            "--tmpfs",
            WORKDIR,
            "--file",
            str(program.fileno()),
            f"{WORKDIR}/main.py",
            "--size",
            str(self.limits.tmpfs_bytes),
            "--tmpfs",
            "/tmp",
            "--chdir",
            WORKDIR,
            self.python,
            "-I",
            "-S",
            "main.py",
        ]
        return command, (program.fileno(),), SANDBOX_UIDS[call % len(SANDBOX_UIDS)] if root else None


@contextlib.contextmanager
def _program_file(code: str) -> Iterator:
    """The program in an unlinked temporary file, handed to the sandbox as an open descriptor."""
    with tempfile.TemporaryFile() as file:
        file.write(code.encode("utf-8", "surrogatepass"))
        file.seek(0)
        yield file


def _system_mounts() -> list[str]:
    """``/usr`` read-only, and the top-level links into it (``/lib``, ``/lib64``, ``/bin``) as the host has them."""
    mounts = ["--ro-bind", "/usr", "/usr"]
    for name in ("lib", "lib64", "bin", "lib32", "libx32"):
        path = Path("/") / name
        if path.is_symlink():
            mounts += ["--symlink", os.readlink(path), str(path)]
        elif path.is_dir():
            mounts += ["--ro-bind", str(path), str(path)]
    return mounts


def _interpreter_mounts(python: str) -> list[str]:
    """The interpreter's own prefix read-only at its path, where it lives outside ``/usr``."""
    prefix = Path(os.path.realpath(python)).parent.parent
    if prefix == Path("/usr") or Path("/usr") in prefix.parents:
        return []
    return ["--ro-bind", str(prefix), str(prefix)]


def _limit(limits: SandboxLimits, demote_to: int | None):
    """The child's set-up before it executes bwrap: the rlimits, and (as root) the call's own uid."""

    def set_up() -> None:
        for which, value in (
            (resource.RLIMIT_CPU, (limits.cpu_seconds, limits.cpu_seconds + 1)),
            (resource.RLIMIT_AS, (limits.memory_bytes,) * 2),
            (resource.RLIMIT_FSIZE, (limits.file_bytes,) * 2),
            (resource.RLIMIT_NOFILE, (limits.open_files,) * 2),
            (resource.RLIMIT_CORE, (0, 0)),
        ):
            resource.setrlimit(which, value)
        if demote_to is not None:
            os.setgroups([])
            os.setgid(demote_to)
            os.setuid(demote_to)
            resource.setrlimit(resource.RLIMIT_NPROC, (limits.processes, limits.processes))

    return set_up


def _execute(
    command: list[str], pass_fds: tuple[int, ...], limits: SandboxLimits, demote_to: int | None, sandboxed: bool
) -> CodeRun:
    """Run ``command`` under ``limits``. A sandboxed command (bwrap) reports on a status pipe: its code's exit
    code there means the sandbox ran it; none means bwrap itself failed (not what the code printed, which a
    program could fake)."""
    start = time.monotonic()
    status_read, status_write = os.pipe() if sandboxed else (None, None)
    if sandboxed:  # bwrap closes every other descriptor before the code runs: the code cannot write there
        command = [command[0], "--json-status-fd", str(status_write), *command[1:]]
        pass_fds = (*pass_fds, status_write)
    with tempfile.TemporaryDirectory(prefix="grpolab-code-") as scratch:
        os.chmod(scratch, 0o777)  # the call's own uid starts bwrap there
        try:
            process = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=pass_fds,
                env={"PATH": "/usr/bin:/bin", "HOME": scratch, "TMPDIR": scratch},
                cwd=scratch,
                start_new_session=True,
                preexec_fn=_limit(limits, demote_to),
            )
        except OSError as err:
            _close(status_read)
            return CodeRun("sandbox_failed", "", f"the sandbox could not start: {err}", None, 0.0)
        finally:
            _close(status_write)
        out, verdict = _read_capped(process, limits, start)
    report = ""
    if sandboxed:
        with os.fdopen(status_read, "rb") as reports:
            report = reports.read().decode("utf-8", "replace")
    seconds = time.monotonic() - start
    stdout, stderr = (b.decode("utf-8", "replace") for b in out)
    code = process.returncode
    if verdict is not None:
        return CodeRun(verdict, stdout, stderr, None, seconds)
    if sandboxed:
        match = re.search(r'"exit-code": (-?[0-9]+)', report)
        if match is None:
            return CodeRun("sandbox_failed", stdout, stderr, None, seconds)
        code = int(match.group(1))
    signal_number = -code if code < 0 else code - 128 if sandboxed and code > 128 else None
    if code == 0:
        status = "ok"
    elif signal_number == signal.SIGXCPU:
        status = "timeout"
    elif signal_number is not None:
        status = "killed"
    else:
        status = "error"
    return CodeRun(status, stdout, stderr, code, seconds)


def _close(fd: int | None) -> None:
    if fd is not None:
        os.close(fd)


def _read_capped(process: subprocess.Popen, limits: SandboxLimits, start: float) -> tuple[list[bytes], str | None]:
    """Read stdout and stderr until both close, each up to ``output_bytes``; kill the sandbox's process group at
    the wall-clock limit or when an output passes its cap. Returns (the outputs, "timeout" / "output_limit" or
    None)."""
    chunks: list[list[bytes]] = [[], []]
    sizes = [0, 0]
    verdict = None
    with selectors.DefaultSelector() as selector:
        for index, stream in enumerate((process.stdout, process.stderr)):
            selector.register(stream, selectors.EVENT_READ, index)
        while selector.get_map():
            left = start + limits.wall_seconds - time.monotonic()
            if left <= 0:
                verdict = "timeout"
                break
            for key, _ in selector.select(timeout=left):
                data = os.read(key.fileobj.fileno(), 65536)
                if not data:
                    selector.unregister(key.fileobj)
                    continue
                index = key.data
                room = limits.output_bytes - sizes[index]
                chunks[index].append(data[: max(room, 0)])
                sizes[index] += len(data)
                if sizes[index] > limits.output_bytes:
                    verdict = "output_limit"
            if verdict:
                break
    if verdict:
        _kill(process)
    left = max(0.1, start + limits.wall_seconds - time.monotonic())
    try:
        process.wait(timeout=left if verdict is None else 5)
    except subprocess.TimeoutExpired:  # its outputs closed early (the code closed them) but it runs on
        verdict = "timeout"
        _kill(process)
        process.wait()
    process.stdout.close()
    process.stderr.close()
    return [b"".join(c) for c in chunks], verdict


def _kill(process: subprocess.Popen) -> None:
    """SIGKILL to the sandbox's process group (bwrap outside; inside, every process dies with its first)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        process.kill()
