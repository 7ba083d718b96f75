"""The vLLM engine under another interpreter (``--vllm-python``): its server and the trainer's client.

``VLLMSubprocessEngine`` (trainer side) runs a ``VLLMEngine`` in its own process under another
Python (one with vLLM installed), started as ``python -m grpolab.rollout.vllm.server ADDRESS``.
They talk over a local Unix socket (``multiprocessing.connection``, authenticated) in JSON, one
request / one reply; weights go through a safetensors file the trainer writes and the server
reloads. The server exits when asked to, or when the trainer's side of the channel closes.
"""

from __future__ import annotations

import json
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
from dataclasses import asdict
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path
from typing import Any

from grpolab.models.weights import PolicyWeights
from grpolab.rollout.base import Completion, SamplingParams, let_an_interrupt_land
from grpolab.rollout.vllm.engine import VLLM_CAPABILITIES, VLLMEngine, save_weights

__all__ = ["VLLMSubprocessEngine", "serve"]

_AUTHKEY_ENV = "GRPOLAB_VLLM_AUTHKEY"


# ---- the channel -------------------------------------------------------------------------------
def _send(conn: Connection, message: dict[str, Any]) -> None:
    conn.send_bytes(json.dumps(message).encode())


def _recv(conn: Connection) -> dict[str, Any]:
    return json.loads(conn.recv_bytes())


def _handle(engine, message: dict[str, Any]) -> dict[str, Any]:
    op = message["op"]
    if op == "generate":
        params = SamplingParams(**{**message["params"], "stop_strings": tuple(message["params"]["stop_strings"])})
        groups = engine.generate(message["prompts"], message["n"], params)
        return {"completions": [[asdict(c) for c in group] for group in groups]}
    if op == "sync":
        engine.sync_from_folder(message["folder"])
        return {}
    if op == "sync_adapter":
        engine.sync_adapter_from_folder(message["folder"])
        return {}
    raise ValueError(f"unknown op {op!r}")


def _exit_with_parent(interval: float = 1.0) -> None:
    """Daemon thread: end this process and its engine's processes (its process group) if its parent (the
    trainer) dies, even before it connects."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval)
        if os.getpgrp() == os.getpid():  # started by VLLMSubprocessEngine, as its group's leader
            os.killpg(0, signal.SIGKILL)  # vLLM's engine-core processes outlive their parent otherwise
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def serve(address: str) -> None:
    """Server loop: build a ``VLLMEngine`` from the first message, then answer until "close"/EOF."""
    _exit_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the trainer decides when the engine stops
    with Listener(address, family="AF_UNIX", authkey=bytes.fromhex(os.environ.pop(_AUTHKEY_ENV))) as listener:
        conn = listener.accept()
    engine = None
    try:
        init = _recv(conn)
        try:
            engine = VLLMEngine(init["model_dir"], **init["kwargs"])
            _send(conn, {"ok": True, "eos_token_ids": engine.eos_token_ids})
        except Exception:  # noqa: BLE001 - any failure goes back to the trainer
            _send(conn, {"ok": False, "error": traceback.format_exc()})
            return
        while True:
            try:
                message = _recv(conn)
            except EOFError:  # the trainer is gone
                return
            if message["op"] == "close":
                break
            try:
                _send(conn, {"ok": True, **_handle(engine, message)})
            except Exception:  # noqa: BLE001 - any failure goes back to the trainer
                _send(conn, {"ok": False, "error": traceback.format_exc()})
    finally:
        if engine is not None:
            engine.close()
    _send(conn, {"ok": True})
    conn.close()


# ---- the trainer side ----------------------------------------------------------------------------
class VLLMSubprocessEngine:
    """``RolloutEngine`` whose ``VLLMEngine`` runs in a child process under ``python``.

    model_dir, tokenizer: as for ``VLLMEngine`` (the tokenizer decodes ``Completion.text`` here).
    python: interpreter with vLLM (and grpolab's dependencies); grpolab itself is put on its path.
    start_timeout: seconds to wait for the server's socket (the engine start is not counted).
    engine_kwargs: keyword arguments of ``VLLMEngine`` (JSON values only).
    """

    capabilities = VLLM_CAPABILITIES

    def __init__(
        self, model_dir: str | Path, tokenizer=None, *, python: str, start_timeout: float = 120.0, **engine_kwargs: Any
    ):
        self._engine_kwargs = engine_kwargs
        self.tokenizer = tokenizer
        self._dir = Path(tempfile.mkdtemp(prefix="grpolab-vllm-proc-"))
        address = str(self._dir / "socket")
        authkey = secrets.token_bytes(32)
        package_root = str(Path(__file__).resolve().parents[3])
        env = {
            **os.environ,
            _AUTHKEY_ENV: authkey.hex(),
            "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])),
        }
        # its own process group: a terminal's Ctrl-C reaches the trainer alone (which closes the engine), and
        # killing the group ends the engine-core processes too
        self._proc = subprocess.Popen([python, "-m", "grpolab.rollout.vllm.server", address], env=env, process_group=0)
        self._conn: Connection | None = None
        try:
            self._conn = self._connect(address, authkey, start_timeout)
            reply = self._call({"model_dir": str(model_dir), "kwargs": engine_kwargs})
        except BaseException:
            self.close()
            raise
        self.eos_token_ids: list[int] = reply["eos_token_ids"]

    def _connect(self, address: str, authkey: bytes, timeout: float) -> Connection:
        deadline = time.monotonic() + timeout
        while True:
            if self._proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited with code {self._proc.returncode} before connecting")
            try:
                return Client(address, family="AF_UNIX", authkey=authkey)
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"vLLM server did not listen on {address} within {timeout} s") from None
                time.sleep(0.1)

    def _call(self, message: dict[str, Any]) -> dict[str, Any]:
        if self._conn is None:
            raise RuntimeError("engine is closed")
        _send(self._conn, message)
        try:
            reply = _recv(self._conn)
        except EOFError:
            let_an_interrupt_land()
            raise RuntimeError(f"vLLM server died (exit code {self._proc.poll()})") from None
        if not reply.pop("ok"):
            let_an_interrupt_land()
            raise RuntimeError(f"vLLM server failed:\n{reply['error']}")
        return reply

    def generate(self, prompts: list[list[int]], n: int, params: SamplingParams) -> list[list[Completion]]:
        """``n`` completions per prompt, ``[len(prompts)][n]``, prompt order kept."""
        reply = self._call({"op": "generate", "prompts": [list(p) for p in prompts], "n": n, "params": asdict(params)})
        groups = [[Completion(**c) for c in group] for group in reply["completions"]]
        if self.tokenizer is not None:
            for c in (c for group in groups for c in group):
                c.text = self.tokenizer.decode(c.completion_ids, skip_special_tokens=True)
        return groups

    def sync_weights(self, weights: PolicyWeights) -> None:
        """Write the policy's ``weights`` (kind ``adapter``: the adapter) to this engine's folder; the server
        reloads them."""
        dtype = self._engine_kwargs.get("dtype")
        if weights.kind == "adapter":
            self._call({"op": "sync_adapter", "folder": str(weights.save(self._dir / "adapter", dtype))})
        else:
            self._call({"op": "sync", "folder": str(save_weights(weights, self._dir, dtype).parent)})

    def close(self, timeout: float = 30.0) -> None:
        """Ask the server to shut its engine down and exit; idempotent. Within ``timeout`` s in all: a
        server that does not answer (its engine stuck in a request, say after its engine-core processes
        took a terminal's Ctrl-C) is killed."""
        deadline = time.monotonic() + timeout
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                _send(conn, {"op": "close"})
                # an interrupted request's reply may come first; the close's own is {"ok": True}
                while conn.poll(max(deadline - time.monotonic(), 0)) and _recv(conn) != {"ok": True}:
                    pass
            except (EOFError, OSError):
                pass
            conn.close()
        try:
            self._proc.wait(max(deadline - time.monotonic(), 0))
        except subprocess.TimeoutExpired:
            os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait()
        shutil.rmtree(self._dir, ignore_errors=True)


if __name__ == "__main__":
    serve(sys.argv[1])
