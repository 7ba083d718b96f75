"""Peeking at a suite after every round: the betting confidence sequence's error against a bootstrap interval's.

    python benchmarks/sequential_peeking.py --suites 10000 --bootstrap-suites 2000

Synthetic suites: ``arms`` arms against a baseline, one seed per arm and round, each evaluated on ``items``
items. An item's correctness is Bernoulli(p_item + seed effect + arm effect): item difficulties drawn once per
suite (shared by every arm, as evaluation items are), a seed effect drawn per run (``--seed-sd``, the run-to-run
spread), and the arm's true difference to the baseline. The unit of replication is the seed: a round adds one
paired difference per arm, the arm's accuracy minus the baseline's over the same items (items pooled within the
seed), so the differences are independent across rounds and bounded in [-1, 1], whatever the seed and item
variances (``grpolab.studies.sequential``).

After every round each arm's interval for its difference is looked at, at alpha / (arms) each (Bonferroni):

- the betting confidence sequence (``paired_difference_cs``), valid at every round at once;
- a percentile bootstrap interval of the mean difference (``--resamples``), recomputed at every round from
  round 2, as a researcher reading the report mid-suite would.

Under the null (every arm equal to the baseline) the family-wise error is the share of suites in which any arm's
interval ever excluded 0. Then, with arms truly worse by 2 x delta, a suite stops an arm once its sequence shows
it worse by more than delta (upper bound < -delta): the table gives how often each such arm was stopped (power)
and the rounds saved against running every arm to the end. Printed, never asserted (tests/test_sequential.py
asserts the guarantee).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from grpolab.studies.sequential import paired_difference_cs  # noqa: E402


def suite_differences(rng, arms: int, rounds: int, items: int, effects: np.ndarray, seed_sd: float) -> np.ndarray:
    """[arms, rounds] paired accuracy differences (arm - baseline over the same items), one seed per round."""
    difficulty = rng.uniform(0.2, 0.8, size=items)  # p_item, shared by every arm and round
    out = np.empty((arms, rounds))
    for r in range(rounds):
        base = rng.random(items) < np.clip(difficulty + rng.normal(0, seed_sd), 0, 1)
        for a in range(arms):
            p = np.clip(difficulty + rng.normal(0, seed_sd) + effects[a], 0, 1)
            out[a, r] = (rng.random(items) < p).mean() - base.mean()
    return out


def bootstrap_excludes_zero(rng, d: np.ndarray, alpha: float, resamples: int, first: int) -> bool:
    """Whether a percentile bootstrap interval of mean(d[:r]) excludes 0 at any round r >= ``first``."""
    for r in range(first, len(d) + 1):
        means = d[:r][rng.integers(0, r, size=(resamples, r))].mean(axis=1)
        low, high = np.quantile(means, [alpha / 2, 1 - alpha / 2])
        if low > 0 or high < 0:
            return True
    return False


def null_errors(args, rng) -> tuple[float, float, float]:
    """(the sequence's family-wise error, the peeked bootstrap's, the sequence's mean half-width at the end)."""
    zero = np.zeros(args.arms)
    cs_errors = boot_errors = 0
    widths = []
    for s in range(args.suites):
        d = suite_differences(rng, args.arms, args.rounds, args.items, zero, args.seed_sd)
        sequences = [paired_difference_cs(row, args.alpha, arms=args.arms) for row in d]
        cs_errors += any(bool(((lo > 0) | (up < 0)).any()) for lo, up in sequences)
        widths += [(up[-1] - lo[-1]) / 2 for lo, up in sequences]
        if s < args.bootstrap_suites:
            boot_errors += any(
                bootstrap_excludes_zero(rng, row, args.alpha / args.arms, args.resamples, args.first_peek) for row in d
            )
    shown = max(1, min(args.suites, args.bootstrap_suites))
    return cs_errors / args.suites, boot_errors / shown, float(np.mean(widths))


def decisions(args, rng, delta: float, alpha: float) -> tuple[float, float]:
    """(power: share of truly-worse arms stopped, share of arm-rounds saved) with half the arms worse by 2 delta."""
    worse = args.arms // 2
    effects = np.array([-2 * delta] * worse + [0.0] * (args.arms - worse))
    stopped = used = 0
    for _ in range(args.power_suites):
        d = suite_differences(rng, args.arms, args.rounds, args.items, effects, args.seed_sd)
        for a, row in enumerate(d):
            _, upper = paired_difference_cs(row, alpha, arms=args.arms)
            below = np.nonzero(upper < -delta)[0]
            used += below[0] + 1 if len(below) else args.rounds
            stopped += bool(len(below)) and a < worse
    return stopped / (worse * args.power_suites), 1 - used / (args.arms * args.rounds * args.power_suites)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--suites", type=int, default=10000, help="null suites for the sequence's error")
    p.add_argument("--bootstrap-suites", type=int, default=2000, help="of them, how many the bootstrap peeks at")
    p.add_argument("--power-suites", type=int, default=500, help="suites per (delta, alpha) cell of the table")
    p.add_argument("--arms", type=int, default=5, help="arms compared with the baseline")
    p.add_argument("--rounds", type=int, default=20, help="seeds per arm (one per round)")
    p.add_argument("--items", type=int, default=200, help="evaluation items per seed")
    p.add_argument("--seed-sd", type=float, default=0.02, help="run-to-run spread of accuracy")
    p.add_argument("--alpha", type=float, default=0.05)
    p.add_argument("--resamples", type=int, default=500)
    p.add_argument("--first-peek", type=int, default=5, help="the first round the bootstrap is looked at")
    p.add_argument("--deltas", type=float, nargs="+", default=[0.05, 0.1])
    p.add_argument("--alphas", type=float, nargs="+", default=[0.05, 0.1])
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    cs, boot, width = null_errors(args, rng)
    print(
        f"null: {args.arms} arms x {args.rounds} rounds x {args.items} items, seed sd {args.seed_sd}, "
        f"alpha {args.alpha}, peeking after every round"
    )
    print(
        f"  betting confidence sequence: family-wise error {cs:.4f} over {args.suites} suites; half-width after "
        f"round {args.rounds}: {width:.3f} (mean)"
    )
    shown = min(args.suites, args.bootstrap_suites)
    print(
        f"  bootstrap interval, peeked from round {args.first_peek}: family-wise error {boot:.4f} over {shown} "
        f"suites ({boot / args.alpha:.1f}x alpha)"
    )
    print(
        f"decisions: half the arms worse by 2 x delta, stopped when the upper bound < -delta ({args.power_suites} suites each)"
    )
    print("| delta | alpha | worse arms stopped | arm-rounds saved |")
    print("|---|---|---|---|")
    for delta in args.deltas:
        for alpha in args.alphas:
            power, saved = decisions(args, rng, delta, alpha)
            print(f"| {delta:g} | {alpha:g} | {power:.3f} | {saved:.3f} |")


if __name__ == "__main__":
    main()
