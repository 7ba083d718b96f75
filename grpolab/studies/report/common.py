"""Runs made comparable before they are pooled (seed groups, the 2x2): each run's per-item outcomes at one
common evaluation step, on the items every run evaluated with the same prompt, and which runs stopped
before the others or before their configured steps."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from grpolab.studies.report.runs import Outcomes, Run, outcomes


@dataclass(frozen=True)
class Common:
    """Runs' correctness at ``step`` (the latest step every run has evaluation records of; None when there
    is none) over the items all of them evaluated with the same prompt: ``correct`` [runs, items];
    ``items_per_run``: how many items each run evaluated at that step; ``note`` says why there are no numbers."""

    step: int | None
    correct: np.ndarray
    items_per_run: list[int]
    note: str | None = None

    @property
    def items(self) -> int:
        return int(self.correct.shape[1])


def align(all_outcomes: list[Outcomes]) -> np.ndarray:
    """Correctness [runs, items] over the items every run evaluated with the same prompt."""
    by_id = [dict(zip(o.ids, zip(o.prompt_hashes, o.correct))) for o in all_outcomes]
    ids = [i for i in all_outcomes[0].ids if all(i in m and m[i][0] == by_id[0][i][0] for m in by_id[1:])]
    return np.array([[m[i][1] for i in ids] for m in by_id]).reshape(len(by_id), len(ids))


def last_eval_step(run: Run) -> int | None:
    """The run's last step with per-item evaluation records."""
    return run.eval_steps[-1] if run.eval_steps else None


def steps_done(run: Run) -> int:
    """The last training step in the run's metrics (0 before the first)."""
    train = run.train
    return train[-1]["step"] if train else 0


def common_step(runs: list[Run]) -> int | None:
    """The latest step at which every run has evaluation records, or None."""
    shared = set.intersection(*(set(r.eval_steps) for r in runs)) if runs else set()
    return max(shared) if shared else None


def stopped_early(runs: list[Run]) -> list[str]:
    """The runs whose last evaluation is earlier than their configured steps or than another run's."""
    lasts = {r.name: last_eval_step(r) for r in runs}
    latest = max((s for s in lasts.values() if s is not None), default=None)
    return [
        r.name
        for r in runs
        if lasts[r.name] is None
        or (latest is not None and lasts[r.name] < latest)
        or (r.total_steps is not None and lasts[r.name] < r.total_steps)
    ]


def _steps(steps: list[int]) -> str:
    """A short list of steps: all of them, or the first two and the last."""
    if not steps:
        return "no steps"
    return ", ".join(map(str, steps)) if len(steps) <= 4 else f"{steps[0]}, {steps[1]}, ..., {steps[-1]}"


def at_common_step(runs: list[Run]) -> Common:
    """The runs' outcomes at their common step on their shared items (see ``Common``)."""
    step = common_step(runs)
    if step is None:
        return Common(
            None,
            np.zeros((len(runs), 0)),
            [],
            "no evaluation step common to all runs (evaluated at "
            + "; ".join(f"{r.name}: {_steps(r.eval_steps)}" for r in runs)
            + "): not comparable",
        )
    found = [outcomes(r, step) for r in runs]
    matrix = align(found)
    note = None if matrix.shape[1] else f"no items every run evaluated with the same prompt at step {step}"
    return Common(step, matrix, [len(o.ids) for o in found], note)


def progress(runs: list[Run]) -> dict[str, Any]:
    """Per run (lists in the order of ``runs``): last evaluation step, training steps done, configured
    steps; and the runs that stopped early."""
    return {
        "last_eval_step": [last_eval_step(r) for r in runs],
        "steps_done": [steps_done(r) for r in runs],
        "configured_steps": [r.total_steps for r in runs],
        "stopped_early": stopped_early(runs),
    }
