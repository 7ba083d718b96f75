"""What a resume may continue, decided before anything on disk moves: the run's config as it started
(config.json against the SHA-256 in manifest.json), ``steps`` that only grow, the newest checkpoint whose
checksums hold (newer damaged ones are named), a run not already complete, the same data."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from grpolab.run.checkpoints import newest_verified
from grpolab.config import ConfigError, RunConfig, config_sha256, first_difference
from grpolab.run.journal import CONFIG, MANIFEST, RunJournal
from grpolab.run.state import STATE_FILE
from grpolab.run.rundir import RunDirError


@dataclass(frozen=True)
class ResumePlan:
    """Continue ``journal``'s run from ``checkpoint`` (after ``step``); ``damaged``: newer checkpoints whose
    checksums failed, with why; ``changes``: the top-level config fields the resume changes."""

    journal: RunJournal
    checkpoint: Path
    step: int
    damaged: list[tuple[Path, str]]
    changes: dict[str, Any]


def step_of(checkpoint: Path) -> int:
    return int(checkpoint.name.removeprefix("step_"))


def plan_resume(cfg: RunConfig, on_check: Callable[[Path], None] = lambda _: None) -> ResumePlan:
    """Every check of a resume of the run in ``cfg.output_dir`` (``cfg``: its config with the resume's
    overrides); raises one line for the first that fails."""
    run_dir = Path(cfg.output_dir or "")
    if not (run_dir / CONFIG).is_file():
        raise FileNotFoundError(f"nothing to resume in {run_dir}: no {CONFIG}")
    journal = RunJournal.load(run_dir)
    found = journal.config_on_disk()
    if config_sha256(found) != journal.data["config_sha256"]:
        diff = first_difference(journal.recorded_config(), found) or "its SHA-256 differs"
        raise ConfigError(f"{run_dir / CONFIG} differs from the config the run started with ({MANIFEST}): {diff}; "
                          "a resumed run keeps its config (only --steps and --log_every may change)")
    if cfg.steps < found["steps"]:
        raise ConfigError(f"--steps {cfg.steps}: the run is set to {found['steps']} steps, and --steps may only grow")
    verified = newest_verified(run_dir, (STATE_FILE,), on_check)
    if verified.checkpoint is None:
        problems = "; ".join(f"{p.name}: {why}" for p, why in verified.damaged)
        raise FileNotFoundError(f"nothing to resume in {run_dir}: no complete checkpoint (checkpoints/step_NNNNNN "
                                f"with {STATE_FILE} and a checkpoint.json its files match)"
                                + (f"; {problems}" if problems else ""))
    step = step_of(verified.checkpoint)
    if step >= cfg.steps:
        unfinished = "" if (run_dir / "summary.json").is_file() else \
            " (killed while finishing: no summary.json, but its metrics and final checkpoint are complete)"
        raise RunDirError(f"run {run_dir} is already complete at step {step}{unfinished}; nothing to resume "
                          f"(extend it with --steps N, N > {step})")
    changes = {k: v for k, v in (("steps", cfg.steps), ("log_every", cfg.log_every)) if found.get(k) != v}
    return ResumePlan(journal, verified.checkpoint, step, verified.damaged, changes)


def check_data(journal: RunJournal, fingerprint: dict[str, Any] | None) -> None:
    """The task's rows and prompt (their counts and SHA-256s) must be those the run started with."""
    recorded = journal.data.get("data")
    if recorded is None or fingerprint is None:
        return
    keys = lambda d: {k: v for k, v in d.items() if k.endswith(("_sha256", "_rows"))}  # noqa: E731
    diff = first_difference(keys(recorded), keys(fingerprint))
    if diff is not None:
        raise ConfigError(f"the task's data changed since the run started ({journal.run_dir / MANIFEST}): {diff}; "
                          "a resumed run trains on the same data")
