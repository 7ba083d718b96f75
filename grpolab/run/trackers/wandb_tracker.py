"""Weights & Biases: one W&B run per grpolab run, continued by every resume (its id is kept in the run's
manifest). Offline unless W&B is set up: ``WANDB_MODE``, ``WANDB_API_KEY`` or a ``wandb login`` decide."""

from __future__ import annotations

import netrc
import os
import secrets
import string
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from grpolab.common.tracker_names import import_package
from grpolab.config import LogConfig
from grpolab.run.trackers.registry import TrackerStart, register_tracker

ID_CHARS = string.ascii_lowercase + string.digits


def new_run_id() -> str:
    """A W&B run id: 8 base-36 characters, as W&B makes them."""
    return "".join(secrets.choice(ID_CHARS) for _ in range(8))


def logged_in(env: dict[str, str]) -> bool:
    """Whether ``wandb login`` stored a key for W&B's host (``WANDB_BASE_URL``) in the netrc file (``NETRC``)."""
    host = urlparse(env.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname
    path = Path(env.get("NETRC") or Path.home() / ".netrc")
    try:
        return path.is_file() and netrc.netrc(path).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def choose_mode(env: dict[str, str] | None = None) -> tuple[str | None, str]:
    """(the mode to ask for, why): ``WANDB_MODE`` when set; None (W&B's own choice: online) with a key or a
    login; "offline" when nothing sets W&B up, so that a run never stops at a login prompt. (Read at each
    start: W&B reads its environment once per process.)"""
    env = dict(os.environ if env is None else env)
    if env.get("WANDB_MODE"):
        return env["WANDB_MODE"], "WANDB_MODE"
    if env.get("WANDB_API_KEY"):
        return None, "WANDB_API_KEY"
    if logged_in(env):
        return None, "wandb login"
    return "offline", "no WANDB_API_KEY, WANDB_MODE or wandb login"


class WandbTracker:
    """A W&B run ``run_id`` in ``project`` named ``name``, its files under ``folder``/wandb (``WANDB_DIR`` wins),
    continued when it exists (resume "allow": an offline run is continued when synced)."""

    name, resends = "wandb", False

    def __init__(self, project: str, name: str, run_id: str, folder: Path, config: dict[str, Any]):
        wandb = import_package(self.name)
        self.wandb = wandb
        mode, self.why = choose_mode()
        self.run = wandb.init(
            project=project,
            name=name,
            id=run_id,
            resume="allow",
            config=config,
            mode=mode,
            dir=os.environ.get("WANDB_DIR") or str(folder),
            # the run's own terminal output stays as it is (progress bars, plain log lines)
            settings=wandb.Settings(silent=True, console="off"),
        )
        self.mode = self.run.settings.mode
        self.files = Path(self.run.dir).parent  # this session's folder (offline-run-TIME-ID, or run-TIME-ID)

    def describe(self) -> str:
        where = f"wandb {self.mode} ({self.why}): run {self.run.id} in project {self.run.project}"
        if self.mode == "offline":
            return f"{where}; upload with: wandb sync {self.files}"
        return f"{where} {self.run.url or ''}".rstrip()

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def table(self, step: int, key: str, columns: list[str], rows: list[list[Any]]) -> None:
        self.run.log({key: self.wandb.Table(columns=columns, data=rows)}, step=step)

    def close(self, finished: bool) -> None:
        if not finished:
            self.run.mark_preempting()  # stopped or failed: the W&B run is continued by a resume
        self.run.finish(exit_code=0 if finished else 1)


def wandb_run(settings: LogConfig, run_name: str, previous: dict[str, Any] | None) -> dict[str, Any]:
    """The W&B run an earlier session started, else a new run id in ``log.project`` named after this run."""
    return previous or {"project": settings.project, "name": run_name, "id": new_run_id()}


@register_tracker(WandbTracker.name, identity=wandb_run)
def start_wandb(start: TrackerStart) -> WandbTracker:
    run = start.run
    return WandbTracker(run["project"], run["name"], run["id"], Path(start.run_dir), start.config)
