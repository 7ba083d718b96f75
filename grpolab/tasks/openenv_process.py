"""The OpenEnv server subprocess, seen from grpolab: started on 127.0.0.1, health-checked, always stopped.

``ServerProcess.start()`` runs ``python -m grpolab.tasks.openenv_server`` in its own process group, its
output in a log file of a temporary folder; it waits for the server's ready file and for ``GET /health`` to
answer, showing a progress line meanwhile. If the server exits or does not answer within the startup
timeout, the process is stopped and a ValueError says so in one line, followed by the log's last lines.
``stop()`` ends the process group (SIGTERM, then SIGKILL) and removes the temporary folder; it also runs at
interpreter exit, and the server itself exits when its parent is gone.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from rich.console import Console

from grpolab.common.progress import Reporter

LOG_TAIL_LINES = 12
POLL_S = 0.1  # how often start() looks for the ready file and /health
STOP_GRACE_S = 5.0  # SIGTERM to SIGKILL


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> list[str]:
    """The last ``lines`` non-empty lines of a log file (none when it is missing)."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    return [line for line in text.splitlines() if line.strip()][-lines:]


def child_path() -> str:
    """The server's PYTHONPATH: grpolab's own root, the working directory and this process's path, so that it imports
    what this process imports (``task.app``'s module)."""
    root = str(Path(__file__).resolve().parents[2])
    inherited = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    return os.pathsep.join(dict.fromkeys(p for p in (root, os.getcwd(), *sys.path, *inherited) if p))


class ServerProcess:
    """One OpenEnv server subprocess. ``base_url`` (``http://127.0.0.1:PORT``) and ``sessions`` (the episodes it
    serves at once) are known once ``start()`` returns; ``pid`` while it runs."""

    def __init__(self, app: str, action: str | None, observation: str | None, sessions: int, startup_timeout_s: float):
        self.app, self.action, self.observation = app, action, observation
        self.requested_sessions, self.startup_timeout_s = sessions, startup_timeout_s
        self.process: subprocess.Popen | None = None
        self.folder: Path | None = None
        self.base_url = ""
        self.sessions = sessions

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self) -> None:
        """Starts the server and waits until it answers ``/health``; a no-op while it runs."""
        if self.running:
            return
        self.stop()
        self.folder = Path(tempfile.mkdtemp(prefix="grpolab-openenv-"))
        ready, log = self.folder / "ready.json", self.folder / "server.log"
        command = [sys.executable, "-m", "grpolab.tasks.openenv_server", "--app", self.app]
        command += ["--sessions", str(self.requested_sessions), "--ready", str(ready), "--parent", str(os.getpid())]
        command += ["--action", self.action] if self.action else []
        command += ["--observation", self.observation] if self.observation else []
        env = {k: v for k, v in os.environ.items() if k != "ENABLE_WEB_INTERFACE"}  # an API server, no web UI
        env["PYTHONPATH"] = child_path()
        with log.open("wb") as out:
            self.process = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env
            )
        atexit.register(self.stop)
        try:
            self._wait_until_healthy(ready, log)
        except BaseException:
            self.stop()
            raise

    def _wait_until_healthy(self, ready: Path, log: Path) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        reporter = Reporter(Console(stderr=True))
        with reporter.phase(f"start OpenEnv server {self.app}", done_note=None) as phase:
            phase.set_status(f"pid {self.pid}, up to {self.startup_timeout_s:g} s")
            while True:
                code = self.process.poll() if self.process is not None else None
                if code is not None:
                    self._fail(f"exited with code {code} before it answered", log)
                if ready.exists() and not self.base_url:
                    info: dict[str, Any] = json.loads(ready.read_text())
                    self.base_url, self.sessions = f"http://127.0.0.1:{info['port']}", int(info["sessions"])
                if self.base_url and self._healthy():
                    phase.info = f"{self.base_url}, {self.sessions} sessions at once"
                    return
                if time.monotonic() > deadline:
                    self._fail(
                        f"did not answer /health within {self.startup_timeout_s:g} s (task.startup_timeout_s)", log
                    )
                time.sleep(POLL_S)

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.base_url}/health", timeout=2) as reply:
                return reply.status == 200
        except OSError:
            return False

    def _fail(self, why: str, log: Path) -> None:
        tail = log_tail(log)
        self.stop()
        lines = [f"OpenEnv server {self.app} {why}; check task.app and run it by hand to see why"]
        lines += [f"  server log: {line}" for line in tail] or ["  (the server wrote no log)"]
        raise ValueError("\n".join(lines))

    def get_json(self, route: str) -> Any:
        """``GET route`` of the running server, as JSON."""
        with urllib.request.urlopen(f"{self.base_url}{route}", timeout=10) as reply:
            return json.loads(reply.read())

    def stop(self) -> None:
        """Ends the server's process group and removes its temporary folder; may be called more than once."""
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            for sig, wait in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, STOP_GRACE_S)):
                try:
                    os.killpg(process.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    process.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        if process is not None:
            try:
                process.wait(0)
            except subprocess.TimeoutExpired:
                pass
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None
        self.base_url = ""
