"""The OpenEnv environment server grpolab starts as a subprocess (``python -m grpolab.tasks.openenv_server``).

It imports ``--app``: an OpenEnv ``Environment`` class (served with openenv-core's own ``create_app``, one
environment per websocket session, at most ``--sessions`` at once; one where the class does not declare
``SUPPORTS_CONCURRENT_SESSIONS``) or an ASGI app already built (e.g. ``create_app``'s result), binds a free
port on 127.0.0.1 itself (no race for the port), writes ``{"port": ..., "sessions": ...}`` to ``--ready``
and serves until stopped. It exits when its parent process is gone (removing the ready file's folder, which
its parent made for it), so that a parent killed without cleaning up never leaves it running.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any, get_args, get_origin

PARENT_POLL_S = 1.0  # how often the server checks that its parent still runs


def _resolve(path: str) -> Any:
    from grpolab.tasks.sandbox import resolve

    return resolve(path)


def action_observation_classes(env_cls: type) -> tuple[type | None, type | None]:
    """The Action and Observation classes an ``Environment[ActT, ObsT, StateT]`` subclass names in its bases
    (None each where it names none)."""
    from openenv.core.env_server.interfaces import Environment

    for klass in env_cls.__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            origin = get_origin(base)
            if isinstance(origin, type) and issubclass(origin, Environment):
                args = [a if isinstance(a, type) else None for a in get_args(base)]
                if len(args) >= 2 and (args[0] or args[1]):
                    return args[0], args[1]
    return None, None


def build_app(app: str, action: str | None, observation: str | None, sessions: int) -> tuple[Any, int]:
    """(the ASGI app, the sessions it serves at once) of ``--app``."""
    from openenv.core.env_server.http_server import create_app
    from openenv.core.env_server.interfaces import Environment

    made = _resolve(app)
    if not (isinstance(made, type) and issubclass(made, Environment)):
        if isinstance(made, type) or not callable(made):
            raise TypeError(f"{app} is neither an OpenEnv Environment class nor an ASGI app")
        return made, sessions  # an app of the user's own making: its concurrency is its own
    found_action, found_observation = action_observation_classes(made)
    action_cls = _resolve(action) if action else found_action
    observation_cls = _resolve(observation) if observation else found_observation
    if action_cls is None or observation_cls is None:
        raise TypeError(
            f"{app} does not name its Action and Observation classes (Environment[Action, Observation, State]); "
            "set task.action and task.observation"
        )
    sessions = sessions if getattr(made, "SUPPORTS_CONCURRENT_SESSIONS", False) else 1
    return create_app(made, action_cls, observation_cls, max_concurrent_envs=sessions), sessions


def _exit_with_parent(parent: int, folder: Path) -> None:
    """Exits once ``parent`` is gone (it was killed before it could stop this server), removing ``folder`` (the
    temporary folder it made for this server's ready file and log)."""
    while True:
        time.sleep(PARENT_POLL_S)
        if os.getppid() != parent:
            shutil.rmtree(folder, ignore_errors=True)
            os._exit(0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m grpolab.tasks.openenv_server")
    parser.add_argument("--app", required=True, help="package.module:EnvironmentClass or package.module:app")
    parser.add_argument("--action", help="package.module:ActionClass (default: the Environment's type argument)")
    parser.add_argument("--observation", help="package.module:ObservationClass (default: its type argument)")
    parser.add_argument("--sessions", type=int, default=1, help="episodes served at once")
    parser.add_argument("--ready", required=True, help="file to write the port to once listening")
    parser.add_argument("--parent", type=int, default=os.getppid(), help="exit when this process is gone")
    args = parser.parse_args(argv)
    ready = Path(args.ready)
    threading.Thread(target=_exit_with_parent, args=(args.parent, ready.parent), daemon=True).start()
    # The server never serves openenv's web UI (its parent unsets ENABLE_WEB_INTERFACE): not importing the module
    # that imports gradio saves seconds at every start (openenv's package __init__ does without it).
    sys.modules.setdefault("openenv.core.env_server.web_interface", None)  # type: ignore[arg-type]

    import uvicorn

    app, sessions = build_app(args.app, args.action, args.observation, args.sessions)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    server = uvicorn.Server(
        uvicorn.Config(app, log_level="warning", ws_ping_interval=None, timeout_graceful_shutdown=1)
    )
    partial = ready.with_suffix(".partial")
    partial.write_text(json.dumps({"port": sock.getsockname()[1], "sessions": sessions}))
    partial.replace(ready)  # whole or absent: the parent never reads half a file
    server.run(sockets=[sock])
    os._exit(0)  # not waiting for an environment call that hangs in a worker thread


if __name__ == "__main__":
    sys.exit(main())
