"""Failed samples as a state of the run: their counts per kind, and the stop when a step has too many.

A sample whose rollout or reward failed (``Grade.ok`` False; its kind in ``Grade.failure``) takes no part in its
group's advantages or the loss (``grpolab.objectives.advantages``); here it is counted every step
(``rollout/failed/<kind>``), and a step in which more than ``rollout.max_failure_rate`` of the samples failed stops
the run before its update (``TooManyFailures``: one line naming the kind and the first error; the trainer adds
the resume command); so does an evaluation in which more than that fraction of the items failed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping

from grpolab.tasks.base import FAILURE_KINDS, Grade

FAILED = "rollout/failed"  # the metrics' prefix: rollout/failed (all kinds), rollout/failed/<kind>


class TooManyFailures(RuntimeError):
    """A step's failed samples passed ``rollout.max_failure_rate``: the run stops, resumably."""


def failure_counts(grades: Iterable[Grade]) -> Counter[str]:
    """How many of ``grades`` failed, by kind."""
    return Counter(g.failure for g in grades if g.failure is not None)


def failure_metrics(grades: list[Grade]) -> dict[str, float]:
    """``rollout/failed`` (how many samples failed), ``rollout/failed/<kind>`` for every kind (0 included, so that
    each is a series from the first step) and ``rollout/failure_rate`` over ``grades``."""
    counts = failure_counts(grades)
    out: dict[str, float] = {FAILED: sum(counts.values())}
    out.update({f"{FAILED}/{kind}": counts.get(kind, 0) for kind in FAILURE_KINDS})
    out["rollout/failure_rate"] = out[FAILED] / len(grades) if grades else 0.0
    return out


def failure_totals(records: Iterable[Mapping[str, float]]) -> dict[str, int]:
    """The failed samples of ``records`` (metrics lines) summed by kind, the kinds that had any."""
    totals: Counter[str] = Counter()
    for record in records:
        totals.update({kind: int(record.get(f"{FAILED}/{kind}", 0)) for kind in FAILURE_KINDS})
    return {kind: n for kind, n in totals.items() if n}


def check_failure_rate(failures: list[tuple[str, str | None]], total: int, max_rate: float, where: str) -> None:
    """Raise ``TooManyFailures`` when more than ``max_rate`` of ``total`` samples failed (``failures``: each failed
    one's kind and error, in order), naming the most frequent kind and its first error; ``where`` begins the line
    ("step 3", "evaluation at step 2")."""
    if not total or len(failures) / total <= max_rate:
        return
    counts = Counter(kind for kind, _ in failures)
    kind, n = counts.most_common(1)[0]
    error = next(e for k, e in failures if k == kind)
    error = error.strip().splitlines()[-1] if error and error.strip() else None  # one line (a traceback's last)
    others = ", ".join(f"{k} {c}" for k, c in counts.items() if k != kind)
    raise TooManyFailures(
        f"{where}: {len(failures)} of {total} samples failed (over rollout.max_failure_rate {max_rate:g}): "
        f"{n} {kind}{f', {others}' if others else ''}; the first {kind} error: {error or 'not said'}"
    )
