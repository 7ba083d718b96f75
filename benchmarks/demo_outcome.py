"""Outcome of `grpolab demo`: step-0 vs final greedy validation accuracy and wall time, per algorithm,
run seed and warm-start seed.

    python benchmarks/demo_outcome.py                          # grpo, dr_grpo, maxrl with a cold warm-start cache
    python benchmarks/demo_outcome.py --algos grpo --seeds 0 1 2 --warm-seeds 0 1 2   # how robust the demo is
    python benchmarks/demo_outcome.py --algos grpo --extra "--steps 40"
    python benchmarks/demo_outcome.py --algos grpo --engines hf vllm   # same demo on both rollout engines

Runs each configuration as its own `grpolab demo` process (exactly what a user runs) into a temporary
directory; the first run pays the supervised warm start (a fresh cache), later runs reuse it. A
warm-start seed other than 0 stands in for another machine's floating-point rounding: it builds a
differently initialised warm-started model (same recipe) and passes it as `--model DIR`.
Target: final accuracy >= start + 0.20, RL part <= 8 min on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def run_demo(algo: str, engine: str, out: Path, env: dict[str, str], extra: list[str]) -> tuple[dict, float]:
    cmd = [
        sys.executable,
        "-m",
        "grpolab.commands.cli",
        "demo",
        "--algo",
        algo,
        "--engine",
        engine,
        "--output-dir",
        str(out),
        *extra,
    ]
    started = time.perf_counter()
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    return json.loads((out / "summary.json").read_text()), time.perf_counter() - started


def warm_started(seed: int, cache: Path) -> list[str]:
    """Demo arguments that use the warm start of ``seed`` (0: the demo's own, built by the demo itself)."""
    if seed == 0:
        return []
    from grpolab.models.tinymodel import WarmStartSettings, warm_start_model
    from grpolab.tasks import make_task

    return ["--model", str(warm_start_model(make_task("arithmetic"), WarmStartSettings(seed=seed), cache))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algos", nargs="+", default=["grpo", "dr_grpo", "maxrl"])
    parser.add_argument("--engines", nargs="+", default=["hf"], help="rollout engines (vllm needs vLLM installed)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0], help="run seeds (--seed)")
    parser.add_argument("--warm-seeds", nargs="+", type=int, default=[0], help="warm-start seeds")
    parser.add_argument("--extra", default="", help="extra demo arguments, e.g. '--steps 40 --threads 1'")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "GRPOLAB_CACHE": os.path.join(tmp, "cache")}
        print(
            f"{'algorithm':<12} {'engine':<6} {'warm':>4} {'seed':>4} {'start':>6} {'final':>6} {'gain':>6} "
            f"{'RL s':>7} {'process s':>10}",
            flush=True,
        )
        for warm_seed in args.warm_seeds:
            model = warm_started(warm_seed, Path(tmp) / "warm")
            for algo in args.algos:
                for engine in args.engines:
                    for seed in args.seeds:
                        out = Path(tmp) / f"{algo}-{engine}-w{warm_seed}-s{seed}"
                        extra = [*model, "--seed", str(seed), *shlex.split(args.extra)]
                        summary, seconds = run_demo(algo, engine, out, env, extra)
                        acc = summary["val_accuracy"]
                        print(
                            f"{algo:<12} {engine:<6} {warm_seed:>4} {seed:>4} {acc['start']:6.3f} {acc['final']:6.3f} "
                            f"{acc['final'] - acc['start']:+6.3f} {summary['wall_seconds']:7.0f} {seconds:10.0f}",
                            flush=True,
                        )


if __name__ == "__main__":
    main()
