"""A suite's sequential question, decided round by round (pure functions; the suite runner feeds them).

The unit of replication is the seed: round r runs seed r of every arm still in play, and the observation of a
comparison "arm minus other" at round r is their paired accuracy difference on the same evaluation items (items
pooled within the seed: the item-to-item spread and the seed-to-seed spread both move it). Those differences are
independent across rounds and lie in [-1, 1]; each comparison keeps a confidence sequence for their mean
(``grpolab.studies.sequential``), at alpha / (number of comparisons) each (Bonferroni), so all of them cover
their means at every round at once, however often they are looked at.

Two questions:

- against a baseline (``baseline`` set): each other arm is ``worse`` once its sequence's upper bound is below
  -delta, ``within`` once its lower bound is above -delta (it is not worse by more than delta);
- find the best (no baseline): every pair is compared; an arm is ``worse`` once some arm beats it by more than
  delta (an upper bound of arm minus that arm below -delta), ``within`` once no arm can (every lower bound of
  arm minus other above -delta).

Verdicts are final: a sequence covers at every round at once, so what it showed once stays shown. The question
is answered when no arm is ``open``; an arm that is decided gets no further seed (with the baseline or, for the
best, every arm still in play going on while any arm is open).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from grpolab.studies.sequential import SEQUENCES

OPEN, WORSE, WITHIN, BASELINE = "open", "worse", "within", "baseline"


@dataclass(frozen=True)
class Question:
    """Which arms, compared how: ``baseline`` (an arm) or None (find the best), the smallest difference that
    matters (``delta``, in accuracy), the family-wise error rate ``alpha``, the sequence's name and, for the
    normal one, the stated spread ``sd`` of one paired difference."""

    arms: tuple[str, ...]
    baseline: str | None
    delta: float
    alpha: float
    sequence: str = "betting"
    sd: float | None = None

    @classmethod
    def of(cls, arms: tuple[str, ...], settings: dict[str, Any]) -> Question:
        """The question of a suite's ``[decide]`` settings (as the suite file or its manifest holds them)."""
        return cls(
            arms, settings["baseline"], settings["delta"], settings["alpha"], settings["sequence"], settings["seed_sd"]
        )

    def comparisons(self) -> list[tuple[str, str]]:
        """(arm, other) pairs whose mean difference "arm minus other" is followed."""
        if self.baseline is not None:
            return [(arm, self.baseline) for arm in self.arms if arm != self.baseline]
        return [(a, b) for i, a in enumerate(self.arms) for b in self.arms[i + 1 :]]


@dataclass(frozen=True)
class Comparison:
    """One comparison after a round: ``n`` paired differences, their mean, and the sequence's bounds."""

    arm: str
    other: str
    n: int
    mean: float | None  # None before the first round both ran
    lower: float
    upper: float
    spread: float | None  # the differences' sample sd (n >= 2)


@dataclass(frozen=True)
class Verdict:
    arm: str
    status: str  # open, worse, within or baseline
    round: int | None  # the round it was decided at
    evidence: str


def compare(question: Question, differences: dict[tuple[str, str], list[float]]) -> list[Comparison]:
    """Every comparison's bounds from its paired differences so far (one per round both arms ran)."""
    sequence, pairs = SEQUENCES[question.sequence], question.comparisons()
    options = {"sd": question.sd} if question.sequence == "normal" else {}
    out = []
    for arm, other in pairs:
        d = np.asarray(differences.get((arm, other), []), dtype=np.float64)
        if len(d) == 0:
            out.append(Comparison(arm, other, 0, None, -1.0, 1.0, None))
            continue
        lower, upper = sequence(d, question.alpha, arms=len(pairs), **options)
        spread = float(d.std(ddof=1)) if len(d) > 1 else None
        out.append(Comparison(arm, other, len(d), float(d.mean()), float(lower[-1]), float(upper[-1]), spread))
    return out


def _bounds_against(arm: str, comparisons: list[Comparison]) -> list[tuple[str, float, float]]:
    """(other, lower, upper) of "arm minus other" for every comparison that involves ``arm``."""
    out = []
    for c in comparisons:
        if c.arm == arm:
            out.append((c.other, c.lower, c.upper))
        elif c.other == arm:
            out.append((c.arm, -c.upper, -c.lower))
    return out


def judge(
    question: Question, comparisons: list[Comparison], round_: int, before: dict[str, Verdict] | None = None
) -> dict[str, Verdict]:
    """Each arm's verdict after ``round_`` (verdicts in ``before`` that are decided stay as they are)."""
    before = before or {}
    verdicts = {}
    for arm in question.arms:
        if arm in before and before[arm].status != OPEN:
            verdicts[arm] = before[arm]
            continue
        if arm == question.baseline:
            verdicts[arm] = Verdict(arm, BASELINE, None, "the arm the others are compared with")
            continue
        bounds = _bounds_against(arm, comparisons)
        beaten = [(other, upper) for other, _, upper in bounds if upper < -question.delta]
        if beaten:
            other, upper = min(beaten, key=lambda b: b[1])
            evidence = f"{arm} - {other} <= {upper:+.3f} < -{question.delta:g}"
            verdicts[arm] = Verdict(arm, WORSE, round_, evidence)
        elif bounds and all(lower > -question.delta for _, lower, _ in bounds):
            closest = min(bounds, key=lambda b: b[1])
            evidence = f"{arm} - {closest[0]} >= {closest[1]:+.3f} > -{question.delta:g}"
            verdicts[arm] = Verdict(arm, WITHIN, round_, evidence)
        else:
            verdicts[arm] = Verdict(arm, OPEN, None, "not yet decided")
    return verdicts


def answered(verdicts: dict[str, Verdict]) -> bool:
    return all(v.status != OPEN for v in verdicts.values())


def going_on(question: Question, verdicts: dict[str, Verdict]) -> list[str]:
    """The arms that run the next round's seed: none once the question is answered; else the open arms and the
    baseline (against a baseline), or every arm not shown worse (find the best: an open arm's comparisons need
    them all)."""
    if answered(verdicts):
        return []
    if question.baseline is not None:
        return [a for a in question.arms if verdicts[a].status in (OPEN, BASELINE)]
    return [a for a in question.arms if verdicts[a].status != WORSE]


@dataclass(frozen=True)
class Played:
    """A decision suite played through in memory: the final verdicts, the seeds each arm ran, and the last
    round's comparisons."""

    verdicts: dict[str, Verdict]
    seeds: dict[str, int]
    comparisons: list[Comparison]


def play(question: Question, difference: Callable[[str, str, int], float], rounds: int) -> Played:
    """Up to ``rounds`` rounds as the suite runner plays them: round r reads ``difference(arm, other, r)`` for
    every comparison whose two arms are still in play, judges, and drops the arms that go on no further (the
    planner's forecast and the benchmarks use it; the runner does the same from the runs on disk)."""
    running, verdicts, seen = set(question.arms), {}, {}
    seeds, comparisons = dict.fromkeys(question.arms, 0), []
    for r in range(rounds):
        for arm in running:
            seeds[arm] += 1
        for arm, other in question.comparisons():
            if arm in running and other in running:
                seen.setdefault((arm, other), []).append(difference(arm, other, r))
        comparisons = compare(question, seen)
        verdicts = judge(question, comparisons, r, verdicts)
        running = set(going_on(question, verdicts))
        if not running:
            break
    return Played(verdicts, seeds, comparisons)


def spread_warnings(question: Question, comparisons: list[Comparison]) -> list[str]:
    """The normal sequence holds only if one paired difference spreads no more than its stated sd: each
    comparison whose differences' sample sd exceeds it, said in one line."""
    if question.sequence != "normal":
        return []
    return [
        f"{c.arm} - {c.other}: paired differences spread {c.spread:.3f} (sd over {c.n} seeds), more than the stated "
        f"seed_sd {question.sd:g}: the normal sequence's guarantee does not hold; use a larger seed_sd or the "
        "betting sequence"
        for c in comparisons
        if c.spread is not None and c.spread > question.sd
    ]


def as_record(round_: int, comparisons: list[Comparison], verdicts: dict[str, Verdict], runs: list[str]) -> dict:
    """One round's decision as the manifest records it (JSON)."""
    return {
        "round": round_,
        "runs": runs,
        "comparisons": [asdict(c) for c in comparisons],
        "verdicts": {arm: asdict(v) for arm, v in verdicts.items()},
    }


def verdicts_of(record: dict) -> dict[str, Verdict]:
    return {arm: Verdict(**v) for arm, v in record["verdicts"].items()}
