"""LoRA adapters against full weights, side by side in one run: seconds per RL step and per phase, trained
parameters, optimizer-state bytes, and what the frozen reference costs.

    python benchmarks/lora_vs_full.py --threads 1 --config configs/smollm2_arithmetic.toml --rank 16
    python benchmarks/lora_vs_full.py --threads 1                          # the demo's settings

Each way builds the run's parts (``grpolab.run.parts.assemble``) from the same config (a KL term on, so
both carry a reference: a frozen copy for full weights, the adapter switched off for LoRA), runs one
warm-up RL step and ``--repeats`` timed ones, and reports the means. The two ways sample different
completions after the first update, so their steps differ in length: the milliseconds per completion
token of generation and of the training phase are the figures that compare like for like.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from rich.console import Console

from grpolab.commands.cli import parse_overrides
from grpolab.commands.probe import optimizer_state_bytes
from grpolab.common.progress import Reporter
from grpolab.config import load_config
from grpolab.run.parts import assemble
from grpolab.run.step import rl_step

PHASES = ("generate", "train", "sync", "step")


def measure(cfg, repeats: int, console: Console) -> dict[str, float]:
    parts = assemble(cfg, lambda ranks: Reporter(Console(quiet=True)))
    try:
        rl_step(parts, 0)  # warm-up: allocations, the optimizer's state
        records = []
        for step in range(1, repeats + 1):
            started = time.perf_counter()
            records.append(rl_step(parts, step))
            console.print(f"  step {step}/{repeats}: {time.perf_counter() - started:.1f} s")
        model = parts.model
        out = {phase: statistics.mean(r[f"time/{phase}"] for r in records) for phase in PHASES}
        out["completion_tokens"] = statistics.mean(r["response_tokens"] for r in records)
        out["sync_diff_max"] = max(r.get("sync/logprob_diff_max", float("nan")) for r in records)
        out["parameters"] = sum(p.numel() for p in model.parameters())
        out["trained"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
        out["optimizer_bytes"] = optimizer_state_bytes(parts.optimizer)
        reference = parts.reference
        out["reference_bytes"] = (
            0
            if reference is None or reference is model
            else sum(p.numel() * p.element_size() for p in reference.parameters())
        )
        return out
    finally:
        parts.close()


def lora_parser(description: str) -> argparse.ArgumentParser:
    """The options the LoRA benchmarks share: config, threads, timed repeats, the adapter's rank."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", help="TOML config (default: the demo's settings)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--rank", type=int, default=16)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = lora_parser(__doc__.splitlines()[0])
    parser.add_argument("--lora-lr", type=float, help="LoRA's learning rate (default: the config's)")
    args, rest = parser.parse_known_args(argv)
    torch.set_num_threads(args.threads)
    overrides = {"threads": args.threads, "algorithm.beta": 0.04, **parse_overrides(rest)}
    console = Console()
    full = load_config(args.config, overrides)
    lora = {"model.lora.rank": args.rank, "model.lora.alpha": 2 * args.rank}
    if args.lora_lr:
        lora["optim.lr"] = args.lora_lr
    ways = {"full": full, "lora": load_config(args.config, {**overrides, **lora})}
    results = {}
    for name, cfg in ways.items():
        console.print(
            f"{name}: {cfg.rollout.prompts_per_step} prompts x {cfg.rollout.group_size}, "
            f"<= {cfg.rollout.max_new_tokens} new tokens, {args.threads} thread(s) ..."
        )
        results[name] = measure(cfg, args.repeats, console)
    console.print(
        f"{'way':<6}{'step s':>8}{'gen s':>7}{'train s':>8}{'tokens':>7}{'gen ms/tok':>11}"
        f"{'train ms/tok':>13}{'trained':>13}{'optimizer MB':>13}{'reference MB':>13}",
        highlight=False,
        soft_wrap=True,
    )
    for name, r in results.items():
        per_token = {k: 1000 * r[k] / r["completion_tokens"] for k in ("generate", "train")}
        r.update({f"{k}_ms_per_token": v for k, v in per_token.items()})
        console.print(
            f"{name:<6}{r['step']:>8.2f}{r['generate']:>7.2f}{r['train']:>8.2f}{r['completion_tokens']:>7.0f}"
            f"{per_token['generate']:>11.2f}{per_token['train']:>13.2f}{r['trained']:>13,}"
            f"{r['optimizer_bytes'] / 2**20:>13.1f}{r['reference_bytes'] / 2**20:>13.1f}",
            highlight=False,
            soft_wrap=True,
        )
    ratio = {
        k: results["lora"][k] / results["full"][k]
        for k in ("generate_ms_per_token", "train_ms_per_token", "trained", "optimizer_bytes")
    }
    console.print(
        f"lora / full: per completion token, generation {ratio['generate_ms_per_token']:.2f}x and training "
        f"phase {ratio['train_ms_per_token']:.2f}x; trained parameters {ratio['trained']:.4f}x, optimizer "
        f"state {ratio['optimizer_bytes']:.4f}x",
        highlight=False,
        soft_wrap=True,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
