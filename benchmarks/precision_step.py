"""Whole RL steps in float32 and in bf16 on a CPU, side by side in one run: generation, training, sync, step.

    python benchmarks/precision_step.py                      # SmolLM2-135M-Instruct, 8 prompts x 8, <= 64 tokens
    python benchmarks/precision_step.py --steps 5 --json precision_step.json
    python benchmarks/precision_step.py --config demo --steps 1   # the demo's tiny model: checks that it runs
    python benchmarks/precision_step.py --rollout.max_new_tokens 32  # overrides of the config

The config (default ``configs/smollm2_arithmetic.toml``: ``gguf:smollm2`` on chat arithmetic) with 8 prompts
x 8 samples, at most 64 new tokens, temperature 1, hf engine, on the CPU, ``--threads`` torch threads (1). Each
variant gets its own run parts (``grpolab.run.parts.assemble``: same config, same seed, no run directory) and
is timed as ``grpolab bench step`` times an engine (``grpolab.commands.bench.time_steps``: one warm-up step,
then ``--steps`` steps; mean seconds per phase):

  float32        model.dtype float32
  bf16 autocast  model.dtype bfloat16 (optim.precision fp32_master) with the hf engine generating on the
                 training model under the trainer's autocast (how it generated before its own copy)
  bf16           the same, the engine on its own copy, linear weights in bf16, refreshed by each sync
                 (``grpolab.rollout.hf.engine_weights``, the default ``matmul`` copy)
  bf16 all       the same, the copy in bf16 throughout, generating without autocast (``all``)

Printed: seconds of generate / train / sync / whole step per variant, each bf16 variant's ratio to float32
(bf16 / fp32 seconds: < 1 is faster), completion tokens/s, milliseconds of a whole step per completion token
(and its ratio), and the largest engine - trainer log-prob difference
of the sync check. Samples differ between variants (bf16 rounding changes what is sampled), so completion
lengths differ too: compare tokens/s beside the seconds. Needs an idle machine for meaningful figures.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
from rich import box
from rich.console import Console
from rich.table import Table

from grpolab.commands.bench import time_steps
from grpolab.commands.cli import parse_overrides
from grpolab.common.progress import Reporter
from grpolab.common.provenance import cpu_description, describe_cpu
from grpolab.config import load_config
from grpolab.rollout.hf.engine_weights import ComputeCopy
from grpolab.run.parts import assemble

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2 = ROOT / "configs" / "smollm2_arithmetic.toml"
SETTINGS = {
    "rollout.engine": "hf",
    "rollout.prompts_per_step": 8,
    "rollout.group_size": 8,
    "rollout.max_new_tokens": 64,
    "rollout.temperature": 1.0,
    "model.device": "cpu",
    "eval.every": 10_000,
    "checkpoint.every": 10_000,
}
VARIANTS = {  # name: (model.dtype, the engine's copy: None = none, else its mode)
    "float32": ("float32", None),
    "bf16 autocast": ("bfloat16", None),
    "bf16": ("bfloat16", "matmul"),
    "bf16 all": ("bfloat16", "all"),
}
PHASES = ("generate", "train", "sync", "step")


def measure(config: str | None, overrides: dict[str, Any], variant: str, steps: int) -> dict[str, Any]:
    """``time_steps`` of one variant, on run parts of its own."""
    dtype, mode = VARIANTS[variant]
    # the all-bf16 copy samples further from the trainer's autocast forward by design (docs/precision.md): timed
    # with the sync check off, so that its calibrated limit cannot stop the comparison
    checked = {} if mode != "all" else {"rollout.sync_check": False}
    cfg = load_config(config, {**overrides, "model.dtype": dtype, **checked})
    parts = assemble(cfg, lambda ranks: Reporter(Console(quiet=True)))
    try:
        engine = parts.engine
        if dtype == "bfloat16":
            # the run's engine made its default copy; this variant swaps in the one it measures
            engine.copy = None if mode is None else ComputeCopy(parts.model, parts.precision.compute, mode)
        return time_steps(parts, steps)
    finally:
        parts.close()


def step_per_token(m: dict[str, Any]) -> float:
    """Seconds of a whole step per completion token it generated (the variants' samples differ in length)."""
    return m["step"] / (m["tokens_per_s"] * m["generate"])


def table(results: dict[str, dict[str, Any]], title: str) -> Table:
    out = Table(box=box.SIMPLE_HEAD, pad_edge=False, title=title)
    base = results.get("float32")
    out.add_column("variant")
    for phase in PHASES:
        out.add_column(f"{phase} s", justify="right")
        if base is not None:
            out.add_column("/fp32", justify="right")
    out.add_column("tok/s", justify="right")
    out.add_column("step ms/tok", justify="right")
    if base is not None:
        out.add_column("/fp32", justify="right")
    out.add_column("max|d|", justify="right")
    for name, m in results.items():
        cells = []
        for phase in PHASES:
            cells.append(f"{m[phase]:.3f}")
            if base is not None:
                # a phase float32 hardly has (the sync: no copy to refresh) has no meaningful ratio
                cells.append(f"{m[phase] / base[phase]:.2f}" if base[phase] > 1e-3 else "-")
        per_token = [f"{step_per_token(m) * 1e3:.3g}"]
        if base is not None:
            per_token.append(f"{step_per_token(m) / step_per_token(base):.2f}")
        diff = m.get("logprob_diff_max")
        out.add_row(
            name,
            *cells,
            f"{m['tokens_per_s']:.0f}",
            *per_token,
            "-" if diff is None or diff != diff else f"{diff:.1e}",
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(SMOLLM2), help="a config file, or 'demo' (the demo's tiny model)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per variant (after one warm-up)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--json", type=Path, help="also write the figures here (never overwritten)")
    args, rest = parser.parse_known_args(argv)
    if args.steps < 1 or args.threads < 1:
        parser.error("--steps and --threads must be >= 1")
    if args.json is not None and args.json.exists():
        parser.error(f"{args.json} exists; choose another --json path or move it away")
    config = None if args.config == "demo" else args.config
    overrides = {**SETTINGS, **parse_overrides(rest), "threads": args.threads}
    torch.set_num_threads(args.threads)
    console = Console(width=max(Console().width, 150))  # the table's 14 columns
    cpu = describe_cpu(cpu_description())
    results: dict[str, dict[str, Any]] = {}
    for variant in args.variants:
        console.print(f"precision_step: {variant} ({args.steps} timed steps after a warm-up) ...", highlight=False)
        results[variant] = measure(config, overrides, variant, args.steps)
        console.print(
            f"precision_step: {variant}: {results[variant]['step']:.2f} s per step", highlight=False, soft_wrap=True
        )
    r = load_config(config, overrides).rollout
    title = (
        f"RL step, float32 vs bf16: {r.prompts_per_step} prompts x {r.group_size}, <= {r.max_new_tokens} new tokens, "
        f"temperature {r.temperature:g}; {args.threads} thread(s); {cpu}"
    )
    console.print(table(results, title))
    if args.json is not None:
        args.json.write_text(json.dumps({"title": title, "cpu": cpu, "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
