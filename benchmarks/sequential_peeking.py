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

from grpolab.studies.decision import Question, play  # noqa: E402
from grpolab.studies.sequential import SEQUENCES  # noqa: E402


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


def sequence_of(name: str, stated_sd: float):
    """(differences [T], alpha, arms) -> (lower [T], upper [T]) for the sequence ``name``."""
    options = {"sd": stated_sd} if name == "normal" else {}
    return lambda d, alpha, arms: SEQUENCES[name](d, alpha, arms=arms, **options)


def null_errors(args, rng, sequence, seed_sd: float, bootstrap: bool) -> tuple[float, float | None, float]:
    """(the sequence's family-wise error, the peeked bootstrap's, the sequence's mean half-width at the end)."""
    zero = np.zeros(args.arms)
    cs_errors = boot_errors = 0
    widths = []
    for s in range(args.suites):
        d = suite_differences(rng, args.arms, args.rounds, args.items, zero, seed_sd)
        bounds = [sequence(row, args.alpha, args.arms) for row in d]
        cs_errors += any(bool(((lo > 0) | (up < 0)).any()) for lo, up in bounds)
        widths += [(up[-1] - lo[-1]) / 2 for lo, up in bounds]
        if bootstrap and s < args.bootstrap_suites:
            boot_errors += any(
                bootstrap_excludes_zero(rng, row, args.alpha / args.arms, args.resamples, args.first_peek) for row in d
            )
    shown = max(1, min(args.suites, args.bootstrap_suites))
    return cs_errors / args.suites, boot_errors / shown if bootstrap else None, float(np.mean(widths))


def decisions(args, rng, name: str, delta: float, alpha: float) -> tuple[float, float, float]:
    """(power: share of truly-worse arms shown worse, errors: share of suites showing an equal arm worse, compute
    saved against every arm to the end) with half the arms worse by 2 x delta, the others equal to the baseline,
    run through the decision suites' own verdicts (``grpolab.studies.decision``) against the baseline."""
    worse = args.arms // 2
    effects = np.array([-2 * delta] * worse + [0.0] * (args.arms - worse))
    arms = ("base", *(f"arm{a}" for a in range(args.arms)))
    question = Question(arms, "base", delta, alpha, name, args.stated_sd if name == "normal" else None)
    shown = wrong = used = 0
    for _ in range(args.power_suites):
        d = suite_differences(rng, args.arms, args.rounds, args.items, effects, args.seed_sd)
        played = play(question, lambda arm, _, r, d=d: d[arms.index(arm) - 1, r], args.rounds)
        verdicts = played.verdicts
        used += sum(played.seeds.values())
        shown += sum(verdicts[arms[a + 1]].status == "worse" for a in range(worse))
        wrong += any(verdicts[arms[a + 1]].status == "worse" for a in range(worse, args.arms))
    budget = (args.arms + 1) * args.rounds * args.power_suites
    return shown / (worse * args.power_suites), wrong / args.power_suites, 1 - used / budget


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--suites", type=int, default=10000, help="null suites for each sequence's error")
    p.add_argument("--bootstrap-suites", type=int, default=2000, help="of them, how many the bootstrap peeks at")
    p.add_argument(
        "--power-suites", type=int, default=300, help="suites per (sequence, delta, alpha) cell of the table"
    )
    p.add_argument("--arms", type=int, default=5, help="arms compared with the baseline")
    p.add_argument("--rounds", type=int, default=20, help="seeds per arm (one per round)")
    p.add_argument("--items", type=int, default=500, help="evaluation items per seed")
    p.add_argument("--seed-sd", type=float, default=0.01, help="run-to-run spread of accuracy (the demo's: 0.008)")
    p.add_argument(
        "--stated-sd", type=float, default=0.05, help="the normal sequence's stated spread of one paired difference"
    )
    p.add_argument("--alpha", type=float, default=0.05)
    p.add_argument("--resamples", type=int, default=500)
    p.add_argument("--first-peek", type=int, default=5, help="the first round the bootstrap is looked at")
    p.add_argument("--deltas", type=float, nargs="+", default=[0.05, 0.1])
    p.add_argument("--alphas", type=float, nargs="+", default=[0.05, 0.1])
    p.add_argument("--sequences", nargs="+", default=["betting", "normal"], choices=sorted(SEQUENCES))
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    print(
        f"null: {args.arms} arms x {args.rounds} rounds x {args.items} items, seed sd {args.seed_sd}, "
        f"alpha {args.alpha}, peeking after every round; normal sequence at a stated sd {args.stated_sd}"
    )
    for k, name in enumerate(args.sequences):
        error, boot, width = null_errors(args, rng, sequence_of(name, args.stated_sd), args.seed_sd, k == 0)
        print(
            f"  {name} confidence sequence: family-wise error {error:.4f} over {args.suites} suites; half-width "
            f"after round {args.rounds}: {width:.3f} (mean)"
        )
        if boot is not None:
            shown = min(args.suites, args.bootstrap_suites)
            print(
                f"  bootstrap interval, peeked from round {args.first_peek}: family-wise error {boot:.4f} over "
                f"{shown} suites ({boot / args.alpha:.1f}x alpha)"
            )
    if "normal" in args.sequences:  # stated at the truth: the error approaches alpha from below
        zero = np.zeros(args.arms)
        sample = [suite_differences(rng, args.arms, args.rounds, args.items, zero, args.seed_sd) for _ in range(200)]
        true_sd = float(np.concatenate([d.ravel() for d in sample]).std())
        error, _, _ = null_errors(args, rng, sequence_of("normal", true_sd), args.seed_sd, False)
        print(
            f"  normal sequence stated at the true spread of a paired difference ({true_sd:.3f}): family-wise "
            f"error {error:.4f}"
        )
    if "normal" in args.sequences:  # the assumption broken: seeds spread far more than stated
        broken = args.stated_sd * np.sqrt(2)  # a paired difference then spreads twice the stated sd
        error, _, _ = null_errors(args, rng, sequence_of("normal", args.stated_sd), broken, False)
        print(
            f"  normal sequence when paired differences spread twice its stated sd (seed sd {broken:.3f}): "
            f"family-wise error {error:.4f} ({error / args.alpha:.1f}x alpha)"
        )
    print(
        f"decisions against a baseline: half the arms worse by 2 x delta, the others equal; the suite's own "
        f"verdicts and dropping ({args.power_suites} suites each)"
    )
    print(
        "| sequence | delta | alpha | worse arms shown worse | suites with an equal arm shown worse | compute saved |"
    )
    print("|---|---|---|---|---|---|")
    for name in args.sequences:
        for delta in args.deltas:
            for alpha in args.alphas:
                power, wrong, saved = decisions(args, rng, name, delta, alpha)
                print(f"| {name} | {delta:g} | {alpha:g} | {power:.3f} | {wrong:.3f} | {saved:.3f} |")


if __name__ == "__main__":
    main()
