"""A decision suite against the full suite it stands for, side by side in one run, on the demo's task.

    python benchmarks/decision_suite.py --out runs/decision_bench

Six presets on the built-in addition task (the demo's warm-started tiny model), up to four seeds each:

- the full suite runs every preset at every seed (24 runs) and answers "which presets are within delta of the
  best" from the seed means, as a report read at the end would;
- the decision suite (``[decide]``, find the best, the normal sequence at ``--seed-sd``) runs them round by
  round and drops the seeds its verdicts make unneeded.

It prints both answers, the runs and training steps each used and their wall time, and the compute saved. The
runs of the decision suite are the full suite's runs (same configs, same seeds): the script checks that every
run both made has the same final accuracy, so the two answers read the same numbers. Wall times are whole
suites on this machine, each run on ``--threads`` threads, nothing else running.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ARMS = ("grpo", "dapo", "offpolicy_naive", "offpolicy_noclip", "offpolicy_clip", "offpolicy_gspo")


def suite_text(name: str, steps: int, threads: int, seeds: list[int], decide: str) -> str:
    base = f'[suite]\nname = "{name}"\n\n[base]\nsteps = {steps}\nthreads = {threads}\n\n'
    base += f"[base.eval]\nevery = {steps}\n\n[base.checkpoint]\nevery = {steps}\n\n"
    if decide:
        runs = "".join(f'[[runs]]\nname = "{arm}"\nalgo = "{arm}"\n\n' for arm in ARMS)
        return base + decide + "\n" + runs
    runs = "".join(
        f'[[runs]]\nname = "{arm}.s{seed}"\nalgo = "{arm}"\nseed = {seed}\n\n' for seed in seeds for arm in ARMS
    )
    return base + runs


def run_suite(path: Path, root: Path) -> float:
    started = time.perf_counter()
    command = [sys.executable, "-m", "grpolab.commands.cli", "suite", "run", str(path), "--output-root", str(root)]
    with (root.parent / f"{root.name}.log").open("w") as log:
        code = subprocess.call(command, stdout=log, stderr=subprocess.STDOUT)
    if code != 0:
        raise SystemExit(f"suite {path} ended with exit code {code}; see {root.parent / f'{root.name}.log'}")
    return time.perf_counter() - started


def final_accuracy(run_dir: Path) -> float:
    return json.loads((run_dir / "summary.json").read_text())["val_accuracy"]["final"]


def replay(full: Path, seeds: list[int], delta: float, alpha: float, sequence: str, sd: float | None):
    """What a decision suite with these settings decides from the full suite's runs (its runs are those runs):
    (verdicts by arm, seeds run by arm, the largest spread of a comparison's paired differences at the end)."""
    from grpolab.studies.decision import Question, play
    from grpolab.studies.report.runs import Run, outcomes, pair

    def difference(a: str, b: str, r: int) -> float:
        a_run, b_run = (Run(f"{x}.s{seeds[r]}", full / "runs" / f"{x}.s{seeds[r]}", "completed") for x in (a, b))
        paired = pair(outcomes(a_run), outcomes(b_run))
        return float((paired.a - paired.b).mean())

    played = play(Question(ARMS, None, delta, alpha, sequence, sd), difference, len(seeds))
    spread = max(c.spread for c in played.comparisons if c.spread is not None)
    return played.verdicts, played.seeds, spread


def within_best(means: dict[str, float], delta: float) -> list[str]:
    """The full suite's answer: the arms whose seed mean is within ``delta`` of the best's."""
    return sorted(arm for arm in ARMS if means[arm] >= max(means.values()) - delta)


def replay_table(full: Path, seeds: list[int], means: dict[str, float]) -> None:
    """The decisions other settings would have made on the same runs: whether any verdict contradicts the full
    suite's answer, which arms stay open, the compute, and whether the normal sequence's stated sd held."""
    print("\nthe same runs decided at other settings (replayed: the decision suite's runs are the full suite's):")
    print(
        "| sequence | seed_sd | delta | alpha | full suite's answer | verdicts agree | left open | runs | compute "
        "saved | largest observed spread | decided (round) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    budget = len(ARMS) * len(seeds)
    for sequence, sd in (("normal", 0.05), ("normal", 0.1), ("normal", 0.15), ("betting", None)):
        for delta in (0.05, 0.1):
            for alpha in (0.05, 0.1):
                answer = within_best(means, delta)
                verdicts, used, spread = replay(full, seeds, delta, alpha, sequence, sd)
                agree = all(
                    (v.status == "worse") == (a not in answer) for a, v in verdicts.items() if v.status != "open"
                )
                left = ", ".join(a for a, v in verdicts.items() if v.status == "open") or "-"
                runs = sum(used.values())
                decided = ", ".join(f"{a} {v.status} ({v.round})" for a, v in verdicts.items() if v.round is not None)
                print(
                    f"| {sequence} | {sd or '-'} | {delta:g} | {alpha:g} | {', '.join(answer)} | {agree} | {left} | "
                    f"{runs}/{budget} | {1 - runs / budget:.0%} | {spread:.3f} | {decided or '-'} |"
                )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="a new folder for both suites")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seeds", type=int, default=4)
    p.add_argument("--delta", type=float, default=0.05)
    p.add_argument("--alpha", type=float, default=0.05)
    p.add_argument("--seed-sd", type=float, default=0.05)
    p.add_argument(
        "--full-only",
        action="store_true",
        help="run the full suite only and replay the decisions on its runs (a decision suite's runs are the same "
        "runs: the side-by-side run checks that)",
    )
    args = p.parse_args(argv)
    from grpolab.studies.manifest import SuiteManifest

    args.out.mkdir(parents=True, exist_ok=False)
    seeds = list(range(args.seeds))
    decide = (
        f"[decide]\ndelta = {args.delta}\nalpha = {args.alpha}\nseeds = {seeds}\n"
        f'sequence = "normal"\nseed_sd = {args.seed_sd}\n'
    )
    walls = {}
    for kind, text in (("full", ""), ("decide", decide))[: 1 if args.full_only else 2]:
        path = args.out / f"{kind}.toml"
        path.write_text(suite_text(kind, args.steps, args.threads, seeds, text))
        walls[kind] = run_suite(path, args.out / kind)
        print(f"{kind} suite: {walls[kind]:.0f} s", flush=True)

    full = {arm: [final_accuracy(args.out / "full" / "runs" / f"{arm}.s{s}") for s in seeds] for arm in ARMS}
    means = {arm: sum(v) / len(v) for arm, v in full.items()}
    full_answer = within_best(means, args.delta)
    if args.full_only:
        for arm in ARMS:
            print(f"{arm}: seed accuracies {', '.join(f'{a:.3f}' for a in full[arm])}, mean {means[arm]:.3f}")
        replay_table(args.out / "full", seeds, means)
        return

    manifest = SuiteManifest.load(args.out / "decide")
    ran = [r for r in manifest.runs if r.state == "completed"]
    for record in ran:  # the decision suite's runs are the full suite's runs
        same = final_accuracy(Path(record.run_dir)) == final_accuracy(args.out / "full" / "runs" / record.name)
        if not same:
            raise SystemExit(f"run {record.name}: its final accuracy differs between the two suites")
    verdicts = manifest.decisions[-1]["verdicts"]
    decided_answer = sorted(arm for arm, v in verdicts.items() if v["status"] != "worse")

    print(
        f"\n{len(ARMS)} presets x up to {args.seeds} seeds, {args.steps} steps each; delta {args.delta}, alpha "
        f"{args.alpha}, normal sequence at seed_sd {args.seed_sd}\n"
    )
    print("| preset | seed accuracies (full suite) | mean | decision | round | evidence | seeds run |")
    print("|---|---|---|---|---|---|---|")
    for arm in ARMS:
        v = verdicts[arm]
        n = sum(r.arm == arm for r in ran)
        accs = ", ".join(f"{a:.3f}" for a in full[arm])
        print(f"| {arm} | {accs} | {means[arm]:.3f} | {v['status']} | {v['round']} | {v['evidence']} | {n} |")
    warnings = [w for d in manifest.decisions for w in d.get("warnings", [])]
    for w in warnings:
        print(f"warning: {w}")
    steps_full, steps_decide = len(ARMS) * args.seeds * args.steps, len(ran) * args.steps
    print(f"\nfull suite's answer (seed means within {args.delta} of the best): {', '.join(full_answer)}")
    print(f"decision suite's answer (arms not shown worse): {', '.join(decided_answer)}")
    print(f"same answer: {full_answer == decided_answer}")
    print(
        f"runs: {len(ARMS) * args.seeds} vs {len(ran)}; training steps: {steps_full} vs {steps_decide} "
        f"({1 - steps_decide / steps_full:.1%} less)"
    )
    print(
        f"wall time: {walls['full']:.0f} s vs {walls['decide']:.0f} s ({1 - walls['decide'] / walls['full']:.1%} less)"
    )
    replay_table(args.out / "full", seeds, means)


if __name__ == "__main__":
    main()
