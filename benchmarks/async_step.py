"""Async rollouts against sync at the same total CPU threads: samples per second of whole RL steps, side by side.

    python benchmarks/async_step.py                      # SmolLM2-135M-Instruct, 2 threads, k = 1, 6 steps each
    python benchmarks/async_step.py --model tiny --steps 3   # the demo's tiny model: a smoke run
    python benchmarks/async_step.py --model.dtype bfloat16   # any --dotted.name value, for both modes
    python benchmarks/async_step.py --config configs/gsm8k_cpu_check.toml   # r1_zero prompts: 64-token completions

Each mode trains its own run of ``--steps`` steps from the same start (``--config``, default
``configs/smollm2_arithmetic.toml``, whose completions run 8-10 tokens; with 8 prompts x 8, <= 64 new tokens,
temperature 1, evaluation only at the start and end on 8 items):

  sync    ``threads`` threads generate, then learn, then sync, in turn
  async   an engine process with ``threads // 2`` threads generates the next batch (staleness ``--staleness``)
          while the learner trains with the rest

Steps 2.. are timed (step 1 includes starting the engine process and the first generation, which nothing
overlaps); samples per second = completions / mean seconds per step. Printed: each mode's seconds per step, its
generate / train / wait split, samples per second, and async / sync. Run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from rich.console import Console

from grpolab.commands.cli import parse_overrides
from grpolab.config import load_config
from grpolab.run.rundir import read_metrics
from grpolab.run.trainer import train

ROOT = Path(__file__).resolve().parents[1]


def settings(model: str, steps: int, threads: int, out: Path) -> dict:
    base = {
        "output_dir": str(out),
        "steps": steps,
        "threads": threads,
        "eval.every": steps,
        "eval.n_examples": 8,
        "checkpoint.every": steps,
        "rollout.prompts_per_step": 8,
        "rollout.group_size": 8,
        "rollout.max_new_tokens": 64,
        "rollout.temperature": 1.0,
    }
    return base if model == "tiny" else {**base, "model.path": model}  # no path: the demo's tiny model


def run_mode(name: str, overrides: dict, config: Path | None) -> dict:
    cfg = load_config(config, overrides)
    train(cfg, console=Console(quiet=True))
    records = [r for r in read_metrics(Path(cfg.output_dir) / "metrics.jsonl") if "reward_mean" in r]
    timed = records[1:] or records
    step = statistics.mean(r["time/step"] for r in timed)
    return {
        "mode": name,
        "seconds_per_step": step,
        "generate": statistics.mean(r["time/generate"] for r in timed),
        "train": statistics.mean(r["time/train"] for r in timed),
        "wait": statistics.mean(r.get("time/wait_rollout", r["time/generate"] + r["time/reward"]) for r in timed),
        "samples_per_s": len_of(overrides) / step,
        "reward_by_step": [round(r["reward_mean"], 3) for r in records],
    }


def len_of(overrides: dict) -> int:
    return overrides["rollout.prompts_per_step"] * overrides["rollout.group_size"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gguf:smollm2", help="gguf:smollm2 (default) or tiny (smoke run)")
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "smollm2_arithmetic.toml")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2, help="total CPU threads of each mode")
    parser.add_argument("--staleness", type=int, default=1)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args, extra = parser.parse_known_args(argv)
    extra = parse_overrides(extra)  # any --dotted.name value, for both modes
    config = None if args.model == "tiny" else args.config
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, mode in (
            ("sync", {}),
            ("async", {"rollout.mode": "async", "rollout.max_staleness": args.staleness}),
        ):
            overrides = {**settings(args.model, args.steps, args.threads, Path(tmp) / name), **extra, **mode}
            results.append(run_mode(name, overrides, config))
            r = results[-1]
            print(
                f"{name:6s} {r['seconds_per_step']:7.2f} s/step (generate {r['generate']:.2f}, train {r['train']:.2f}, "
                f"waiting for rollouts {r['wait']:.2f})  {r['samples_per_s']:.2f} samples/s  rewards {r['reward_by_step']}",
                flush=True,
            )
    ratio = results[1]["samples_per_s"] / results[0]["samples_per_s"]
    print(f"async / sync samples per second: {ratio:.2f}x ({args.threads} threads each, staleness {args.staleness})")
    if args.json:
        args.json.write_text(json.dumps({"results": results, "ratio": ratio}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
