"""Calling a function in a killable child process, with a deadline: for graders that must never hang.

``WorkerPool("package.module:function")`` (or a callable pickled by value, ``pickled_callable``) starts ``python -c ...`` children (no ``multiprocessing``,
so no ``__main__`` guard is needed and nothing of the parent, torch threads included, is forked)
that import the function once and then serve calls as JSON lines. A call:

* sends ``[args, kwargs, soft_s]``; inside the child an interval timer raises at ``soft_s``
  (this ends Python-level work and sleeps without a restart);
* waits at most ``timeout_s`` for the reply; past that the child is killed and replaced lazily
  (this ends work stuck in C code, e.g. a regular expression that backtracks forever).

Replies never raise in the parent: ``Reply(ok, value, error)`` with the child's traceback, ``"timed
out after ..."`` or ``"worker died"`` in ``error``. Values travel as JSON (NaN and infinities
included); a value JSON cannot hold arrives as the string ``"<TypeName object>"``. Workers inherit
the parent's import path (``sys.path`` plus the working directory), so a function importable in
the parent is importable in the child. Works from any thread; at most ``max_workers`` children run
at once per pool.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import select
import signal
import subprocess
import sys
import threading
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

STARTUP_TIMEOUT_S = 60.0
SOFT_FRACTION = 0.8  # the child stops itself at this fraction of timeout_s; the parent kills at 1.0
MAX_WORKERS = max(1, min(4, os.cpu_count() or 1))


@dataclass(frozen=True)
class Reply:
    """What one call gave: ``ok`` with ``value``, or not ok with ``error`` (traceback or reason)."""

    ok: bool
    value: Any = None
    error: str | None = None


class WorkerStartError(RuntimeError):
    """The child could not import its function (the message holds the child's traceback)."""


class _SoftTimeout(BaseException):
    """Raised in the child by its interval timer; a BaseException so library code cannot swallow it."""


IMPORT_PATH = re.compile(r"[\w.]+:[\w.]+")  # "package.module:attribute"
PICKLED = "pickle:"  # "pickle:QUALNAME:BASE64": a callable pickled by value (``pickled_callable``)
MAX_PICKLED_BYTES = 8 * 2**20


def is_pickled(target: str) -> bool:
    return target.startswith(PICKLED)


def target_label(target: str) -> str:
    """A short name for a target: the function's name (``module:function`` -> ``function``; a pickled lambda:
    ``lambda``)."""
    name = target.split(":")[1] if is_pickled(target) else target.rpartition(":")[2]
    return name.rpartition(".")[2].strip("<>") or "function"


def pickled_callable(function: Any) -> str:
    """``function`` as a target string that worker processes can load: pickled by value with cloudpickle, so a
    function of a script's ``__main__``, a notebook cell or a lambda travels with the code it closes over
    (functions of importable modules travel by reference). Raises ValueError, with why, for one that cannot be
    pickled (it closes over a lock, a file, a model ...) or is larger than ``MAX_PICKLED_BYTES``."""
    import base64

    import cloudpickle

    qualname = getattr(function, "__qualname__", type(function).__qualname__)
    name = f"{getattr(function, '__module__', None) or '?'}.{qualname}".replace(":", ".")
    try:
        data = cloudpickle.dumps(function)
    except Exception as err:
        raise ValueError(
            f"function {name} cannot be sent to the worker processes it runs in: pickling it failed "
            f"({type(err).__name__}: {err}); define what it needs inside it or at a module's top level"
        ) from None
    if len(data) > MAX_PICKLED_BYTES:
        raise ValueError(
            f"function {name} pickles to {len(data) / 2**20:.1f} MiB (it closes over large objects): load them "
            f"inside the function, or from a module, instead (at most {MAX_PICKLED_BYTES // 2**20} MiB)"
        )
    return f"{PICKLED}{name}:{base64.b64encode(data).decode('ascii')}"


def resolve(target: str) -> Any:
    """The object named ``"package.module:attribute"`` (imported with the working directory on the path), or a
    callable pickled by ``pickled_callable``."""
    import importlib

    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    if is_pickled(target):
        import base64

        import cloudpickle

        return cloudpickle.loads(base64.b64decode(target.rpartition(":")[2], validate=True))
    module_name, _, attribute = target.partition(":")
    module = importlib.import_module(module_name)
    for part in attribute.split("."):
        module = getattr(module, part)
    return module


def _encode(value: Any) -> bytes:
    return json.dumps(value, default=lambda o: f"<{type(o).__name__} object>").encode("utf-8") + b"\n"


def serve(target: str) -> None:
    """Child loop: import ``target`` (``-``: the first line of standard input names it), then answer ``[args,
    kwargs, soft_s]`` lines with reply lines."""

    def on_alarm(signum: int, frame: object) -> None:
        raise _SoftTimeout

    channel = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)  # stray prints must not corrupt the protocol
    try:
        function = resolve(sys.stdin.buffer.readline().decode().strip() if target == "-" else target)
    except BaseException:
        channel.write(_encode({"start_error": traceback.format_exc()}))
        return
    signal.signal(signal.SIGALRM, on_alarm)
    channel.write(b'"ready"\n')
    for line in sys.stdin.buffer:
        try:
            args, kwargs, soft_s = json.loads(line)
            signal.setitimer(signal.ITIMER_REAL, max(float(soft_s), 0.01))
            try:
                reply = {"ok": True, "value": function(*args, **kwargs)}
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        except _SoftTimeout:
            reply = {"ok": False, "error": f"timed out after {soft_s:g} s"}
        except BaseException:
            reply = {"ok": False, "error": traceback.format_exc()}
        try:
            data = _encode(reply)
        except ValueError:  # e.g. a circular structure
            data = _encode({"ok": True, "value": f"<{type(reply.get('value')).__name__} object>"})
        channel.write(data)


def _child_env() -> dict[str, str]:
    root = str(Path(__file__).resolve().parents[2])
    path = [root, os.getcwd(), *(p for p in sys.path if p)]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(dict.fromkeys(path))}


class _Worker:
    """One child process serving ``target``, used by one thread at a time."""

    def __init__(self, target: str) -> None:
        pickled = is_pickled(target)  # sent on standard input: a pickle may be longer than an argument can be
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import sys; from grpolab.tasks.sandbox import serve; serve(sys.argv[1])",
                "-" if pickled else target,
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=_child_env(),
            start_new_session=True,
        )
        if pickled:
            assert self.proc.stdin is not None
            try:
                self.proc.stdin.write(target.encode() + b"\n")
                self.proc.stdin.flush()
            except OSError:
                pass  # the child died at once: its reply below says so
        first = self._read(STARTUP_TIMEOUT_S)
        if first != "ready":
            self.close()
            detail = first.get("start_error") if isinstance(first, dict) else "no reply"
            name = target.split(":")[1] if pickled else target
            raise WorkerStartError(f"{name}: could not be loaded in a worker process:\n{detail}")

    def _read(self, timeout_s: float) -> Any:
        """The next JSON line; None past the deadline; "died" when the child's output ended or was garbled."""
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        if not ready:
            return None
        try:
            return json.loads(self.proc.stdout.readline() or b'"died"')
        except ValueError:
            return "died"

    def call(self, args: list, kwargs: dict, timeout_s: float) -> Reply | None:
        """The reply, or None when the child died or missed the deadline (the caller must close it)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(_encode([args, kwargs, SOFT_FRACTION * timeout_s]))
        self.proc.stdin.flush()
        reply = self._read(timeout_s)
        if reply is None:
            return None
        if not isinstance(reply, dict) or "ok" not in reply:
            return Reply(False, error="worker died")
        return Reply(bool(reply["ok"]), reply.get("value"), reply.get("error"))

    def close(self) -> None:
        """Kill the child and reap it."""
        self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()


class WorkerPool:
    """Idle children of one ``target`` shared by threads; at most ``max_workers`` run at once.

    ``call`` never raises, except ``WorkerStartError`` when a child cannot import the target (a
    setup error the caller reports once).
    """

    _shared: dict[str, WorkerPool] = {}

    def __init__(self, target: str, max_workers: int = MAX_WORKERS) -> None:
        self.target = target
        self.idle: list[_Worker] = []
        self.lock = threading.Lock()
        self.slots = threading.BoundedSemaphore(max_workers)

    @classmethod
    def shared(cls, target: str) -> WorkerPool:
        """The process-wide pool of ``target`` (tasks that use the same function share its workers)."""
        if target not in cls._shared:
            cls._shared[target] = cls(target)
        return cls._shared[target]

    def check(self) -> None:
        """Start one child now (kept idle for the first call): raises ``WorkerStartError``, its message one line
        ending with the child's error, when a child cannot load the target."""
        with self.lock:
            if self.idle:
                return
        try:
            worker = _Worker(self.target)
        except WorkerStartError as err:
            head, _, detail = str(err).partition("\n")
            last = detail.strip().splitlines()[-1] if detail.strip() else "no reply"
            raise WorkerStartError(f"{head.rstrip(':')} ({last})") from None
        with self.lock:
            self.idle.append(worker)

    def call(self, args: list, kwargs: dict | None = None, timeout_s: float = 5.0) -> Reply:
        """``target(*args, **kwargs)`` in a child, within ``timeout_s`` (plus a child's start-up when one
        has to start, ~0.1-0.5 s). JSON-able arguments only."""
        with self.slots:
            with self.lock:
                worker = self.idle.pop() if self.idle else None
            if worker is not None and worker.proc.poll() is not None:  # died while idle
                worker.close()
                worker = None
            worker = worker or _Worker(self.target)
            try:
                reply = worker.call(list(args), dict(kwargs or {}), timeout_s)
            except (OSError, ValueError):  # the pipe broke: the child is gone
                reply = Reply(False, error="worker died")
            if reply is None or reply.error == "worker died":
                worker.close()
                return reply or Reply(False, error=f"timed out after {timeout_s:g} s (killed)")
            with self.lock:
                self.idle.append(worker)
            return reply

    def close(self) -> None:
        with self.lock:
            workers, self.idle = self.idle, []
        for worker in workers:
            worker.close()

    def _forget_after_fork(self) -> None:
        for worker in self.idle:
            for stream in (worker.proc.stdin, worker.proc.stdout):
                if stream is not None:
                    stream.close()  # the forked child's copies only; the parent keeps its workers
        self.idle = []
        self.lock = threading.Lock()


def _close_all() -> None:
    for pool in WorkerPool._shared.values():
        pool.close()


def _after_fork_in_child() -> None:
    """A forked child must not share its parent's workers (their pipes would be read twice)."""
    for pool in WorkerPool._shared.values():
        pool._forget_after_fork()


atexit.register(_close_all)
if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_after_fork_in_child)
