"""An engine in a process of its own: the one transport for every engine that runs apart from the trainer.

An ``EngineProcess`` is a ``RolloutEngine`` whose engine lives in a child process, built there by a picklable
zero-argument ``build`` (the engine's registered factory, bound to its request). The child is started one of
two ways, and everything after the start is the same:

- ``spawned`` from this interpreter (``multiprocessing`` spawn): the hf engine of async rollouts, generating on
  its own CPU threads while the learner trains; its weights in shared memory (``SharedSlots``).
- ``started`` as ``python -m grpolab.rollout.engine_process ADDRESS`` under any interpreter with grpolab's
  dependencies (vLLM under ``rollout.vllm.python``, or apart for async rollouts): its own process group (a
  terminal's Ctrl-C reaches the trainer alone, and killing the group ends the engine's own processes), an
  authenticated Unix socket in a private folder, weights in checkpoint folders the engine reloads (the
  engine's own slots class, e.g. ``grpolab.rollout.vllm.apart.FolderSlots``).

Both talk over one ``multiprocessing`` connection, one pickled request at a time: ``(op, ticket, payload)`` with
op ``generate`` or ``load``, answered ``("ok", value)`` or ``("error", traceback)``; ``None`` ends the child.
Weights travel by version: the parent writes the policy after step v into slot ``v % len(slots)``
(``publish``) and names that write's ticket in each request; the child loads a ticket it does not hold before
it answers. The rollout pipeline (``grpolab.rollout.pipeline``) only asks for a version once it is written and
only overwrites a slot whose previous version no batch still needs, so a slot never changes under a generation;
``sync_weights`` (sync rollouts) writes the current version and loads it at once.

A child that dies is noticed within a second of the parent waiting on it; a child whose engine fails answers
with the error: both are ``EngineDied`` (one line; the run stops with its last checkpoint, resumable). The
child ignores SIGINT (the parent decides how a Ctrl-C stops the run) and ends, quietly, when its connection
closes or its parent is gone (even killed outright, even before it connects).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import itertools
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.multiprocessing as mp
from torch import nn

from grpolab.models.weights import ModelWeights, PolicyWeights
from grpolab.rollout.base import Completion, EngineCapabilities, RolloutEngine, SamplingParams, let_an_interrupt_land

__all__ = ["EngineDied", "EngineProcess", "SharedSlots", "WeightSlots"]

POLL_SECONDS = 1.0  # how often a parent waiting on the engine checks that it is alive
_AUTHKEY_ENV = "GRPOLAB_ENGINE_AUTHKEY"


class EngineDied(RuntimeError):
    """The engine process ended (killed, out of memory) or its engine failed."""


class WeightSlots(Protocol):
    """Where the parent writes weight versions and the child loads them from."""

    def __len__(self) -> int: ...

    def write(self, weights: PolicyWeights, version: int) -> Any:
        """(parent) Write ``weights`` as ``version``; return the ticket the child loads them by (picklable)."""

    def load(self, engine: RolloutEngine, ticket: Any) -> None:
        """(child, this object pickled into it) Put the weights of ``ticket`` into ``engine``."""


class SharedSlots:
    """``count`` versions of a model's parameters (tied ones once) in shared memory, over a frozen copy of the
    model (``model``: its dtype, its device; CPU: shared memory, CUDA: torch's IPC handles) that the child's
    engine is built on. Slot 0 is the copy's own parameters. A child loads a version by pointing the copy's
    parameters at its slot (no copy) and syncing its engine from the copy (a compute-dtype copy, if the engine
    makes one, is refreshed)."""

    def __init__(self, model: nn.Module, count: int):
        self.model = copy.deepcopy(model).requires_grad_(False).eval().share_memory()
        first = {name: p.data for name, p in self.model.named_parameters()}
        self.slots = [first] + [
            {name: t.clone().share_memory_() for name, t in first.items()} for _ in range(count - 1)
        ]

    def __len__(self) -> int:
        return len(self.slots)

    @torch.no_grad()
    def write(self, weights: PolicyWeights, version: int) -> int:
        """Copy ``weights`` into the slot of ``version``; every parameter must be there by name."""
        index = version % len(self.slots)
        slot = self.slots[index]
        names = set(slot)
        for name, tensor in weights.named_parameters():
            slot[name].copy_(tensor.detach())
            names.discard(name)
        if names:
            raise ValueError(f"the policy's weights lack {len(names)} engine parameters, e.g. {sorted(names)[0]}")
        return index

    def load(self, engine: RolloutEngine, index: int) -> None:
        params = dict(self.model.named_parameters())
        for name, tensor in self.slots[index].items():
            params[name].data = tensor
        engine.sync_weights(ModelWeights(self.model))


# ---- the child ------------------------------------------------------------------------------------------
def _answer(conn: Connection, reply: tuple[str, Any]) -> bool:
    """Send ``reply``; False if the parent is gone (killed): no one to answer."""
    try:
        conn.send(reply)
        return True
    except OSError:  # a broken pipe or reset connection
        return False


def _serve(conn: Connection, build: Callable[[], RolloutEngine], load: Callable[[RolloutEngine, Any], None]) -> None:
    """The child's loop: build the engine (answering with its EOS ids or the error), then answer requests until
    the connection closes or says None; the engine is closed on the way out."""
    try:
        engine = build()
    except Exception:  # noqa: BLE001 - any failure goes back to the parent
        _answer(conn, ("error", traceback.format_exc()))
        return
    try:
        if not _answer(conn, ("ok", list(getattr(engine, "eos_token_ids", None) or []))):
            return
        loaded = None  # the ticket the engine holds (None: the weights it was built with)
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                return
            if message is None:
                return
            op, ticket, payload = message
            try:
                if ticket is not None and ticket != loaded:
                    loaded = None  # a load that fails leaves no version held
                    load(engine, ticket[0])
                    loaded = ticket
                reply = ("ok", engine.generate(*payload) if op == "generate" else None)
            except Exception:  # noqa: BLE001 - any failure goes back to the parent
                reply = ("error", traceback.format_exc())
            if not _answer(conn, reply):
                return
    finally:
        engine.close()


def _exit_with_parent(interval: float = 1.0) -> None:
    """Daemon thread: end this process, and its process group where it leads one (an engine's own processes
    outlive their parent otherwise), once its parent is gone."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval)
        if os.getpgrp() == os.getpid():
            os.killpg(0, signal.SIGKILL)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def _spawned_main(conn: Connection, build, load, threads: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(threads)
    _exit_with_parent()
    _serve(conn, build, load)


def _started_main(address: str) -> None:
    """``python -m grpolab.rollout.engine_process ADDRESS``: accept the parent (its key in the environment, then
    removed), take ``(build, load)`` as its first message, serve."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _exit_with_parent()
    with Listener(address, family="AF_UNIX", authkey=bytes.fromhex(os.environ.pop(_AUTHKEY_ENV))) as listener:
        conn = listener.accept()
    try:
        build, load = conn.recv()
    except (EOFError, OSError):
        return
    _serve(conn, build, load)
    conn.close()


# ---- how a child starts ---------------------------------------------------------------------------------
class _Spawned:
    """A child spawned from this interpreter, its connection a pipe."""

    def __init__(self, build, load, threads: int):
        context = mp.get_context("spawn")
        self.conn, child = context.Pipe()
        self.process = context.Process(
            target=_spawned_main, args=(child, build, load, threads), daemon=True, name="grpolab-engine"
        )
        self.process.start()
        child.close()
        self.pid = self.process.pid

    def alive(self) -> bool:
        return self.process.is_alive()

    def exitcode(self) -> int | None:
        return self.process.exitcode

    def stop(self, timeout: float) -> None:
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


class _Started:
    """A child started as ``python -m grpolab.rollout.engine_process`` in its own process group (grpolab put on
    its path), its connection an authenticated Unix socket in ``folder``."""

    def __init__(self, python: str, build, load, folder: Path, timeout: float):
        address, authkey = str(folder / "socket"), secrets.token_bytes(32)
        package_root = str(Path(__file__).resolve().parents[2])
        env = {
            **os.environ,
            _AUTHKEY_ENV: authkey.hex(),
            "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])),
        }
        self.process = subprocess.Popen(
            [python, "-m", "grpolab.rollout.engine_process", address], env=env, process_group=0
        )
        self.pid = self.process.pid
        try:
            self.conn = self._connect(address, authkey, timeout)
            self.conn.send((build, load))
        except BaseException:
            self.stop(0)
            raise

    def _connect(self, address: str, authkey: bytes, timeout: float) -> Connection:
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise EngineDied(f"the engine process exited with code {self.process.returncode} before connecting")
            try:
                return Client(address, family="AF_UNIX", authkey=authkey)
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() > deadline:
                    raise EngineDied(f"the engine process did not listen within {timeout:g} s") from None
                time.sleep(0.1)

    def alive(self) -> bool:
        return self.process.poll() is None

    def exitcode(self) -> int | None:
        return self.process.poll()

    def stop(self, timeout: float) -> None:
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.pid, signal.SIGKILL)
            self.process.wait()


# ---- the parent's handle --------------------------------------------------------------------------------
class EngineProcess:
    """A ``RolloutEngine`` whose engine runs in a child process (``spawned`` or ``started``, see the module).

    ``generate`` samples with the weights of ``version`` (set by the rollout pipeline; the last synced, in sync
    rollouts); ``publish`` writes a version; ``capabilities`` are its engine's, for the copy it samples from.
    """

    def __init__(
        self,
        slots_in: Callable[[Path], WeightSlots],
        start: Callable[[Path, WeightSlots], _Spawned | _Started],
        can: EngineCapabilities,
    ):
        """``slots_in(folder)``: the weight slots (``folder``: this handle's private folder, removed at ``close``);
        ``start(folder, slots)``: the child."""
        self.capabilities = dataclasses.replace(can, shares_training_model=False)
        self.version = 0
        self.tickets: dict[int, tuple[Any, int]] = {}  # version -> (its slot's ticket, which write)
        self.writes = itertools.count()
        self.busy = False  # a request is in flight
        self.closed = False
        self.folder = Path(tempfile.mkdtemp(prefix="grpolab-engine-"))
        try:
            self.slots = slots_in(self.folder)
            self.child = start(self.folder, self.slots)
            self.eos_token_ids: list[int] = self._reply("starting")
        except BaseException:
            self.close()
            raise

    @classmethod
    def spawned(
        cls,
        build: Callable[[nn.Module], RolloutEngine],
        model: nn.Module,
        can: EngineCapabilities,
        slots: int,
        threads: int,
    ) -> EngineProcess:
        """``build(model_copy)`` in a process spawned from this interpreter, on ``threads`` CPU threads, its
        weights in ``slots`` shared-memory versions over a copy of ``model``."""
        shared = SharedSlots(model, slots)
        return cls(
            lambda folder: shared,
            lambda folder, slots: _Spawned(functools.partial(build, shared.model), slots.load, threads),
            can,
        )

    @classmethod
    def started(
        cls,
        python: str,
        build: Callable[[], RolloutEngine],
        slots_in: Callable[[Path], WeightSlots],
        can: EngineCapabilities,
        timeout: float = 120.0,
    ) -> EngineProcess:
        """``build()`` in a process started under ``python``, its weights in ``slots_in(folder)``; ``timeout``:
        seconds to wait for its socket (the engine's start is not counted)."""
        return cls(slots_in, lambda folder, slots: _Started(python, build, slots.load, folder, timeout), can)

    @property
    def pid(self) -> int | None:
        return self.child.pid

    def _reply(self, doing: str) -> Any:
        """The child's answer to the request just sent (waiting, and checking every second that it lives)."""
        self.busy = True
        try:
            while not self.child.conn.poll(POLL_SECONDS):
                if not self.child.alive():
                    raise EOFError
            status, value = self.child.conn.recv()
        except (EOFError, OSError):
            let_an_interrupt_land()
            raise EngineDied(
                f"the rollout engine process (pid {self.pid}) ended while {doing} (exit code {self.child.exitcode()})"
            ) from None
        finally:
            self.busy = False
        if status != "ok":
            let_an_interrupt_land()
            last = value.strip().splitlines()[-1]
            raise EngineDied(f"the rollout engine process failed while {doing}: {last}")
        return value

    def _call(self, op: str, payload: Any, doing: str) -> Any:
        if self.closed:
            raise EngineDied("the rollout engine process is closed")
        try:
            self.child.conn.send((op, self.tickets.get(self.version), payload))
        except OSError:
            pass  # a child that is gone: the reply says so
        return self._reply(doing)

    def publish(self, weights: PolicyWeights, version: int) -> None:
        """Write the policy after step ``version`` into its slot (the pipeline knows no batch still reads it)."""
        self.tickets[version] = (self.slots.write(weights, version), next(self.writes))

    def generate(self, prompts: Sequence[list[int]], n: int, params: SamplingParams) -> list[list[Completion]]:
        """``n`` completions per prompt from the policy of ``self.version``."""
        return self._call("generate", ([list(p) for p in prompts], n, params), "generating")

    def sync_weights(self, weights: PolicyWeights) -> None:
        """Write ``weights`` as the version ``generate`` samples with, and load them now."""
        self.publish(weights, self.version)
        self._call("load", None, "loading weights")

    def close(self, timeout: float = 30.0) -> None:
        """Stop the child within ``timeout`` s (a generation in flight is abandoned; a child that does not end
        is killed, with its process group where it leads one). Safe to call twice."""
        if self.closed:
            return
        self.closed = True
        child = getattr(self, "child", None)
        if child is not None:
            if not self.busy:
                try:
                    child.conn.send(None)
                except OSError:
                    pass
            child.stop(0 if self.busy else timeout)
            child.conn.close()
        shutil.rmtree(self.folder, ignore_errors=True)


if __name__ == "__main__":
    _started_main(sys.argv[1])
