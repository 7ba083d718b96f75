"""Runs as child processes of the runner on this machine, each in its own session (a Ctrl-C at the
terminal reaches the runner alone), placed on devices through ``CUDA_VISIBLE_DEVICES``."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from pathlib import Path


class LocalJob:
    """A run's process (``python -m grpolab.commands.cli train`` or the torchrun agent above its ranks)."""

    def __init__(self, proc: subprocess.Popen):
        self.proc, self.ident, self.note = proc, str(proc.pid), None

    def poll(self) -> int | None:
        return self.proc.poll()

    def stop(self) -> None:
        """SIGTERM to the trainer, or to the torchrun agent, which passes it on to every rank once."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL to the run's whole session (the ranks and any engine processes too)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def where(self) -> dict[str, str | None]:
        return {"host": socket.gethostname()}


def start_local(command: list[str], env: dict[str, str], log: Path, cwd: Path) -> LocalJob:
    """``command`` started in its own session, its output appended to ``log``."""
    with log.open("a") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True)
    return LocalJob(proc)
