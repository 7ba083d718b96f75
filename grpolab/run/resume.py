"""What a resume may continue, decided before anything on disk moves: the run's config as it started
(config.json against the SHA-256 in manifest.json), ``steps`` that only grow, the newest checkpoint whose
checksums hold (newer damaged ones are named), a run not already complete, the same data.

A run stopped before its first checkpoint (killed while loading, in its first steps, or between its
config.json and its manifest.json) is continued from step 0 in place: its config verified as above (or,
without a manifest, config.json read back as a whole config that nothing followed), what it wrote set
aside as a resume sets aside the records after its checkpoint."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpolab.common.records import config_sha256, first_difference
from grpolab.config import (
    RESUME_OVERRIDES,
    ConfigError,
    RunConfig,
    read_config_json,
    validate_config,
)
from grpolab.models.hub import current_commit, is_hub_id
from grpolab.run.checkpoints import MANIFEST as CHECKPOINT_MANIFEST
from grpolab.run.checkpoints import newest_verified, step_folders
from grpolab.run.journal import CONFIG, MANIFEST, RunJournal
from grpolab.run.rundir import LOCK_FILE, RunDirError, start_leftovers
from grpolab.run.state import STATE_FILE


@dataclass(frozen=True)
class ResumePlan:
    """Continue ``journal``'s run from ``checkpoint`` (after ``step``); ``damaged``: newer checkpoints whose
    checksums failed, with why; ``changes``: the top-level config fields the resume changes. A run with no
    checkpoint yet starts again from step 0 in place: ``checkpoint`` None, and ``journal`` None when it
    was stopped before its manifest (``config``: its config.json, which the new manifest records)."""

    journal: RunJournal | None
    checkpoint: Path | None
    step: int
    damaged: list[tuple[Path, str]]
    changes: dict[str, Any]
    config: dict[str, Any] | None = None
    stale: tuple[Path, ...] = ()  # temp files of that start's config.json and manifest.json writes

    @property
    def kept_step(self) -> int:
        """Records of steps up to this one are kept; later ones (from step 0's evaluation on, without a
        checkpoint) are set aside and redone."""
        return self.step if self.checkpoint is not None else -1


def step_of(checkpoint: Path) -> int:
    return int(checkpoint.name.removeprefix("step_"))


def check_target(run_dir: Path) -> None:
    """One line for a folder that ``--resume`` cannot take: a checkpoint (it takes the run directory), a
    folder without config.json (a run stopped before writing it trained nothing: start it again)."""
    run_dir = Path(run_dir)
    if (run_dir / CHECKPOINT_MANIFEST).is_file() or (
        run_dir.parent.name == "checkpoints" and run_dir.name.startswith("step_")
    ):
        raise ConfigError(
            f"--resume {run_dir} is a checkpoint; give its run directory: grpolab train --resume "
            f"{run_dir.parent.parent} (a run continues from its newest complete checkpoint)"
        )
    if (run_dir / CONFIG).is_file():
        return
    if run_dir.is_dir() and start_leftovers(run_dir) is not None:
        raise FileNotFoundError(
            f"nothing to resume in {run_dir}: no {CONFIG} (a run stopped before writing it "
            "trained nothing); start it again with its own command: a new run takes this folder"
        )
    raise FileNotFoundError(f"nothing to resume in {run_dir}: no {CONFIG}")


def _unfollowed_config(run_dir: Path) -> tuple[dict[str, Any], tuple[Path, ...]]:
    """The config.json of a run stopped between writing it and its manifest: a whole config as a run writes
    it (it reads back to itself), beside nothing but the lock and temp files (returned). One line otherwise."""
    found = read_config_json(run_dir / CONFIG)
    temps = tuple(p for p in run_dir.iterdir() if p.name.startswith((f".{CONFIG}-", f".{MANIFEST}-")))
    others = sorted(p.name for p in run_dir.iterdir() if p.name not in (CONFIG, LOCK_FILE) and p not in temps)
    try:
        whole = json.loads(json.dumps(validate_config(found).model_dump(mode="json"))) == found
    except ConfigError:
        whole = False
    if others or not whole:
        raise FileNotFoundError(
            f"nothing to resume in {run_dir}: no {MANIFEST}, and "
            + (f"it holds {', '.join(others)}" if others else f"its {CONFIG} is not a run's config")
        )
    return found, temps


def plan_resume(cfg: RunConfig, on_check: Callable[[Path], None] = lambda _: None) -> ResumePlan:
    """Every check of a resume of the run in ``cfg.output_dir`` (``cfg``: its config with the resume's
    overrides; ``check_target`` passed before its lock was taken); raises one line for the first that fails."""
    run_dir = Path(cfg.output_dir or "")
    if not (run_dir / MANIFEST).is_file():
        found, temps = _unfollowed_config(run_dir)
        if cfg.steps < found["steps"]:
            raise ConfigError(
                f"--steps {cfg.steps}: the run is set to {found['steps']} steps, and --steps may only grow"
            )
        changes = _changes(cfg, found)
        return ResumePlan(None, None, 0, [], changes, {**found, **changes}, temps)
    journal = RunJournal.load(run_dir)
    found = journal.config_on_disk()
    if config_sha256(found) != journal.data["config_sha256"]:
        diff = first_difference(journal.recorded_config(), found) or "its SHA-256 differs"
        raise ConfigError(
            f"{run_dir / CONFIG} differs from the config the run started with ({MANIFEST}): {diff}; "
            f"a resumed run keeps its config (only {', '.join('--' + k for k in RESUME_OVERRIDES)} may change)"
        )
    if cfg.steps < found["steps"]:
        raise ConfigError(f"--steps {cfg.steps}: the run is set to {found['steps']} steps, and --steps may only grow")
    changes = _changes(cfg, found)
    check_model_commit(cfg, journal)
    if not step_folders(run_dir):  # stopped before its first checkpoint: from step 0, in place
        return ResumePlan(journal, None, 0, [], changes)
    verified = newest_verified(run_dir, (STATE_FILE,), on_check)
    if verified.checkpoint is None:
        problems = "; ".join(f"{p.name}: {why}" for p, why in verified.damaged)
        raise FileNotFoundError(
            f"nothing to resume in {run_dir}: no complete checkpoint (checkpoints/step_NNNNNN "
            f"with {STATE_FILE} and a checkpoint.json its files match)" + (f"; {problems}" if problems else "")
        )
    step = step_of(verified.checkpoint)
    if step >= cfg.steps:
        unfinished = (
            ""
            if (run_dir / "summary.json").is_file()
            else " (killed while finishing: no summary.json, but its metrics and final checkpoint are complete)"
        )
        raise RunDirError(
            f"run {run_dir} is already complete at step {step}{unfinished}; nothing to resume "
            f"(extend it with --steps N, N > {step})"
        )
    return ResumePlan(journal, verified.checkpoint, step, verified.damaged, changes)


def _changes(cfg: RunConfig, found: dict[str, Any]) -> dict[str, Any]:
    """The config fields a resume changes (``RESUME_OVERRIDES``): the top-level ones, and the ``model`` section
    with a pinned ``revision``."""
    top = [k for k in RESUME_OVERRIDES if "." not in k]
    changes = {k: getattr(cfg, k) for k in top if found.get(k) != getattr(cfg, k)}
    if cfg.model.revision != found.get("model", {}).get("revision"):
        changes["model"] = {**found["model"], "revision": cfg.model.revision}
    return changes


def check_model_commit(cfg: RunConfig, journal: RunJournal) -> None:
    """A run started from a hub id resumes from the commit it recorded: refused in one line, naming both
    commits and the pin, when its revision now resolves to another (``refs/main`` moved since), or when a
    ``--model.revision`` names another."""
    recorded = journal.data.get("model") or {}
    started, path = recorded.get("revision"), cfg.model.path
    if not recorded.get("hub_id") or not started or not path or not is_hub_id(path):
        return
    pin = f"grpolab train --resume {journal.run_dir} --model.revision {started}"
    if cfg.model.revision is not None and cfg.model.revision != journal.recorded_config()["model"].get("revision"):
        if cfg.model.revision != started:
            raise ConfigError(
                f"--model.revision {cfg.model.revision}: run {journal.run_dir} started from commit {started} of "
                f"{path} ({MANIFEST}); a resumed run keeps its model: {pin}"
            )
        return
    now = current_commit(path, cfg.model.revision)
    if now != started:
        raise ConfigError(
            f"model {path} (revision {cfg.model.revision or 'main'}) is now commit {now}, but run {journal.run_dir} "
            f"started from commit {started} ({MANIFEST}); a resumed run keeps its model: {pin}"
        )


def check_data(journal: RunJournal, fingerprint: dict[str, Any] | None) -> None:
    """The task's rows and prompt (their counts and SHA-256s), and its environment (name, version, settings), must
    be those the run started with."""
    recorded = journal.data.get("data")
    if recorded is None or fingerprint is None:
        return
    keys = lambda d: {k: v for k, v in d.items() if k.endswith(("_sha256", "_rows")) or k == "environment"}  # noqa: E731
    diff = first_difference(keys(recorded), keys(fingerprint))
    if diff is not None:
        raise ConfigError(
            f"the task's data or environment changed since the run started ({journal.run_dir / MANIFEST}): {diff}; "
            "a resumed run trains on the same data"
        )
