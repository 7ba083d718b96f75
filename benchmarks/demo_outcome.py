"""Outcome of `grpolab demo`: step-0 vs final greedy validation accuracy per algorithm, run seed and warm-start
seed, with the gain's paired bootstrap CI and McNemar p over the same validation items, in one table.

    python benchmarks/demo_outcome.py                          # grpo, dr_grpo, maxrl with a cold warm-start cache
    python benchmarks/demo_outcome.py --algos all --out runs   # every preset; then `grpolab report runs --runs ...`
    python benchmarks/demo_outcome.py --algos grpo --seeds 0 1 2 --warm-seeds 0 1 2   # how robust the demo is
    python benchmarks/demo_outcome.py --algos grpo --extra "--steps 40"
    python benchmarks/demo_outcome.py --algos grpo --engines hf vllm   # same demo on both rollout engines

Runs each configuration as its own `grpolab demo` process (exactly what a user runs) into one folder (a
temporary one, or --out DIR, kept: `grpolab report DIR --runs 'sapo-*' 'grpo-*'` then compares any subset);
the first run pays the supervised warm start (a fresh cache), later runs reuse it. A warm-start seed other
than 0 stands in for another machine's floating-point rounding: it builds a differently initialised
warm-started model (same recipe) and passes it as `--model DIR`. A preset the demo refuses (one that needs
what the demo task lacks, such as a teacher model or several reward terms) is listed with the demo's one-line
reason. Target: final accuracy >= start + 0.20, RL part <= 8 min on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def run_demo(algo: str, engine: str, out: Path, env: dict[str, str], extra: list[str]) -> tuple[str | None, float]:
    """Run one demo into ``out``: (None, seconds), or (the demo's error line, seconds) when it refused."""
    cmd = [sys.executable, "-m", "grpolab.commands.cli", "demo", "--algo", algo, "--engine", engine]
    cmd += ["--output-dir", str(out), *extra]
    started = time.perf_counter()
    done = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seconds = time.perf_counter() - started
    if done.returncode == 0:
        return None, seconds
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    error = next((line for line in lines if line.startswith("error:")), lines[-1] if lines else "no output")
    if done.returncode != 2:  # not a refusal: a crash, which a benchmark must not hide
        sys.exit(f"{algo} ({engine}) failed with exit code {done.returncode}: {error}")
    return error.strip(), seconds


def warm_started(seed: int, cache: Path) -> list[str]:
    """Demo arguments that use the warm start of ``seed`` (0: the demo's own, built by the demo itself)."""
    if seed == 0:
        return []
    from grpolab.models.tinymodel import WarmStartSettings, warm_start_model
    from grpolab.tasks import make_task

    return ["--model", str(warm_start_model(make_task("arithmetic"), WarmStartSettings(seed=seed), cache))]


HEADER = (
    f"{'algorithm':<16} {'engine':<6} {'warm':>4} {'seed':>4} {'start':>6} {'final':>6} {'gain':>6} "
    f"{'95% CI':>17} {'p':>7} {'RL s':>6} {'process s':>9}"
)


def outcome_row(algo: str, engine: str, warm: int, seed: int, out: Path, seconds: float, resamples: int) -> str:
    """The table row of one finished demo: its last evaluation against its first, paired over the items."""
    from grpolab.studies.report.analysis import learning
    from grpolab.studies.report.runs import find_runs

    run = find_runs(out)[1][0]
    gain = learning(run, resamples, 0)
    if gain is None:
        return f"{algo:<16} {engine:<6} {warm:>4} {seed:>4}  no second evaluation"
    ci = f"[{gain['ci_low']:+.3f}, {gain['ci_high']:+.3f}]"
    return (
        f"{algo:<16} {engine:<6} {warm:>4} {seed:>4} {gain['baseline_accuracy']:6.3f} {gain['accuracy']:6.3f} "
        f"{gain['difference']:+6.3f} {ci:>17} {gain['p_value']:7.3g} {run.summary['wall_seconds']:6.0f} "
        f"{seconds:9.0f}"
    )


def main(argv: list[str] | None = None) -> int:
    from grpolab.objectives.presets import PRESETS

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algos", nargs="+", default=["grpo", "dr_grpo", "maxrl"], help="presets, or all")
    parser.add_argument("--engines", nargs="+", default=["hf"], help="rollout engines (vllm needs vLLM installed)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0], help="run seeds (--seed)")
    parser.add_argument("--warm-seeds", nargs="+", type=int, default=[0], help="warm-start seeds")
    parser.add_argument("--extra", default="", help="extra demo arguments, e.g. '--steps 40 --threads 1'")
    parser.add_argument("--out", type=Path, help="a new folder that keeps the runs (default: a temporary one)")
    parser.add_argument("--resamples", type=int, default=10_000, help="bootstrap resamples of each gain's CI")
    args = parser.parse_args(argv)
    algos = list(PRESETS) if args.algos == ["all"] else args.algos
    unknown = [a for a in algos if a not in PRESETS]
    if unknown:
        sys.exit(f"unknown preset {unknown[0]!r}; choose from: all, {', '.join(PRESETS)}")
    if args.out is not None and args.out.exists():
        sys.exit(f"--out {args.out} exists; give a new folder")
    with tempfile.TemporaryDirectory() as tmp:
        root = args.out or Path(tmp) / "runs"
        root.mkdir(parents=True)
        env = {**os.environ, "GRPOLAB_CACHE": os.path.join(tmp, "cache")}
        print(HEADER, flush=True)
        refused = []
        for warm_seed in args.warm_seeds:
            model = warm_started(warm_seed, Path(tmp) / "warm")
            for algo in algos:
                for engine in args.engines:
                    for seed in args.seeds:
                        out = root / f"{algo}-{engine}-w{warm_seed}-s{seed}"
                        extra = [*model, "--seed", str(seed), *shlex.split(args.extra)]
                        error, seconds = run_demo(algo, engine, out, env, extra)
                        if error is not None:
                            refused.append(f"{algo} ({engine}): {error}")
                            print(f"{algo:<16} {engine:<6} {warm_seed:>4} {seed:>4}  refused", flush=True)
                            continue
                        print(outcome_row(algo, engine, warm_seed, seed, out, seconds, args.resamples), flush=True)
        for line in refused:
            print(f"refused: {line}", flush=True)
        print(
            "gain: final minus start greedy validation accuracy on the same items; 95% CI: paired bootstrap "
            f"({args.resamples:,} resamples); p: McNemar exact",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
