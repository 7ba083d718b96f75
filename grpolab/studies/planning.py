"""How many seeds a decision suite's question needs (pure functions; ``suite run --dry-run`` prints them).

Two answers, from the question alone and from a pilot:

- ``half_widths``: each comparison's confidence-sequence half-width after 1, 2, ... seeds when one paired
  difference spreads as stated (the normal sequence's closed form; for the betting sequence the width of a
  stream of differences of that spread around 0, drawn with a fixed seed). An arm whose difference to the
  baseline or the best is beyond delta + that half-width is decided by that round.
- ``forecast``: from a pilot's paired differences (one seed per arm, or more), the chance that each arm is
  decided within the budget and the seeds it is expected to use, by simulating the rest of the suite with
  further seeds drawn around the pilot's mean at the stated spread (the assumption the normal sequence makes).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from grpolab.studies.decision import WITHIN, WORSE, Question, play
from grpolab.studies.sequential import SEQUENCES


def half_widths(question: Question, rounds: int, sd: float, draws: int = 200) -> list[float]:
    """Half-width of one comparison's sequence after each of ``rounds`` seeds [rounds], at alpha / comparisons."""
    sequence, k = SEQUENCES[question.sequence], len(question.comparisons())
    if question.sequence == "normal":
        lower, upper = sequence(np.zeros(rounds), question.alpha, arms=k, sd=question.sd)
        return [float(w) for w in (upper - lower) / 2]
    rng = np.random.default_rng(0)
    widths = []
    for _ in range(draws):
        lower, upper = sequence(np.clip(rng.normal(0, sd, rounds), -1, 1), question.alpha, arms=k)
        widths.append((upper - lower) / 2)
    return [float(w) for w in np.median(widths, axis=0)]


@dataclass(frozen=True)
class Forecast:
    arm: str
    pilot_difference: float  # against the baseline, or against the pilot's best arm
    decided: float  # the chance it is decided (worse or within) within the budget
    worse: float  # the chance it is shown worse
    seeds: float  # the seeds it is expected to run


def forecast(
    question: Question, pilot: dict[str, float], rounds: int, sd: float, draws: int = 200, seed: int = 0
) -> list[Forecast]:
    """Each arm's forecast when every seed of arm a scores ``pilot[a]`` plus a seed effect of spread ``sd``
    (independent per arm and seed, so a paired difference spreads sd * sqrt(2)), simulated ``draws`` times
    through the suite's own verdicts and its dropping of decided arms."""
    rng = np.random.default_rng(seed)
    arms = question.arms
    decided, worse, seeds = (dict.fromkeys(arms, 0.0) for _ in range(3))
    for _ in range(draws):
        scores = {a: pilot[a] + rng.normal(0, sd / np.sqrt(2), rounds) for a in arms}
        played = play(question, lambda a, b, r, s=scores: float(np.clip(s[a][r] - s[b][r], -1, 1)), rounds)
        for a in arms:
            seeds[a] += played.seeds[a]
            decided[a] += played.verdicts[a].status in (WORSE, WITHIN)
            worse[a] += played.verdicts[a].status == WORSE
    reference = pilot[question.baseline] if question.baseline else max(pilot.values())
    return [Forecast(a, pilot[a] - reference, decided[a] / draws, worse[a] / draws, seeds[a] / draws) for a in arms]


def plan_lines(question: Question, rounds: int, sd: float, pilot: dict[str, float] | None, steps: int) -> list[str]:
    """What ``suite run --dry-run`` says of a decision suite: the half-widths per round, and with a pilot each
    arm's forecast and the expected compute against the budget of ``steps`` training steps per run."""
    k = len(question.comparisons())
    widths = half_widths(question, rounds, sd)
    lines = [
        f"decision plan: {len(question.arms)} arms, {k} comparisons at alpha {question.alpha:g} / {k} each, "
        f"delta {question.delta:g}, {question.sequence} sequence, one paired difference spreading {sd:g}",
        "  after seed:  " + "  ".join(f"{r + 1:>6}" for r in range(rounds)),
        "  half-width:  " + "  ".join(f"{w:6.3f}" for w in widths),
        "  an arm more than delta + the half-width behind is shown worse by that seed; "
        "within delta needs |difference| < delta - half-width",
    ]
    budget = len(question.arms) * rounds * steps
    if pilot is None:
        return lines + [f"  budget: {budget} training steps; a pilot (--pilot DIR) forecasts what the suite will use"]
    lines.append("  forecast from the pilot (further seeds around its means at that spread, 200 simulated suites):")
    expected = 0.0
    for f in forecast(question, pilot, rounds, sd):
        expected += f.seeds * steps
        lines.append(
            f"    {f.arm}: pilot difference {f.pilot_difference:+.3f}; decided within the budget "
            f"{f.decided:.0%} (worse {f.worse:.0%}); expected seeds {f.seeds:.1f} of {rounds}"
        )
    lines.append(f"  expected compute: {expected:.0f} of {budget} training steps ({1 - expected / budget:.0%} saved)")
    return lines


@dataclass(frozen=True)
class Pilot:
    """A pilot's final accuracies by arm, one per seed run."""

    accuracies: dict[str, list[float]]

    def means(self) -> dict[str, float]:
        return {arm: float(np.mean(v)) for arm, v in self.accuracies.items()}

    def paired_spread(self) -> float | None:
        """The spread of one paired difference, sqrt(2) x the pooled sd of the arms' seed accuracies (None
        without two seeds of some arm)."""
        groups = [np.asarray(v) for v in self.accuracies.values() if len(v) > 1]
        if not groups:
            return None
        pooled = sum(((g - g.mean()) ** 2).sum() for g in groups) / sum(len(g) - 1 for g in groups)
        return float(np.sqrt(2 * pooled))


def pilot_accuracies(directory: Path, arms: tuple[str, ...]) -> Pilot:
    """The final validation accuracies of the runs in ``directory`` named ARM or ARM.sSEED, by arm; one line
    naming the arms the pilot lacks."""
    from grpolab.studies.report.runs import ReportError, find_runs

    try:
        _, runs = find_runs(Path(directory))
    except ReportError as err:
        raise ValueError(f"--pilot {directory}: {err}") from None
    found: dict[str, list[float]] = {}
    for run in runs:
        arm = run.name.rpartition(".s")[0] if run.name.rpartition(".s")[2].isdigit() else run.name
        evaluations = [r["val/accuracy"] for r in run.metrics if "val/accuracy" in r]
        if arm in arms and run.state == "completed" and evaluations:
            found.setdefault(arm, []).append(evaluations[-1])
    missing = [arm for arm in arms if arm not in found]
    if missing:
        raise ValueError(f"--pilot {directory} has no completed run of arm(s) {', '.join(missing)}")
    return Pilot(found)
