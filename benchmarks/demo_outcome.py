"""Outcome of `grpolab demo` per algorithm: step-0 vs final greedy validation accuracy and wall time.

    python benchmarks/demo_outcome.py                 # grpo, dr_grpo, maxrl with a cold warm-start cache
    python benchmarks/demo_outcome.py --algos grpo --extra "--steps 40"
    python benchmarks/demo_outcome.py --algos grpo --engines hf vllm   # same demo on both rollout engines

Runs each algorithm as its own `grpolab demo` process (exactly what a user runs) into a temporary
directory; the first run pays the supervised warm start (a fresh cache), later runs reuse it.
Target (issue): final accuracy >= start + 0.20, RL part <= 8 min on 2 CPU cores.
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
    cmd = [sys.executable, "-m", "grpolab.cli", "demo", "--algo", algo, "--engine", engine, "--output-dir", str(out),
           *extra]
    started = time.perf_counter()
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    return json.loads((out / "summary.json").read_text()), time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algos", nargs="+", default=["grpo", "dr_grpo", "maxrl"])
    parser.add_argument("--engines", nargs="+", default=["hf"], help="rollout engines (vllm needs vLLM installed)")
    parser.add_argument("--extra", default="", help="extra demo arguments, e.g. '--steps 40 --seed 1'")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "GRPOLAB_CACHE": os.path.join(tmp, "cache")}
        print(f"{'algorithm':<12} {'engine':<6} {'start':>6} {'final':>6} {'gain':>6} {'RL s':>7} {'process s':>10}")
        for algo in args.algos:
            for engine in args.engines:
                summary, seconds = run_demo(algo, engine, Path(tmp) / f"{algo}-{engine}", env, shlex.split(args.extra))
                acc = summary["val_accuracy"]
                print(f"{algo:<12} {engine:<6} {acc['start']:6.3f} {acc['final']:6.3f} {acc['final'] - acc['start']:+6.3f} "
                      f"{summary['wall_seconds']:7.0f} {seconds:10.0f}", flush=True)


if __name__ == "__main__":
    main()
