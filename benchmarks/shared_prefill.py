"""The hf engine's generation with and without the shared prefill, side by side in one run.

    python benchmarks/shared_prefill.py --threads 1                 # the demo's rollout batch
    python benchmarks/shared_prefill.py --threads 1 --gsm8k-like    # like:qwen3-0.6b (2 layers), GSM8K prompts

One rollout batch (``rollout.prompts_per_step`` prompts x ``group_size`` samples, the config's
sampling settings, the same seed), generated alternately with each prefill after one warm-up of each:
median seconds, completion tokens, and whether both produced the same completions. ``--gsm8k-like``
keeps 32 new tokens (a random-weight model never stops, so every row runs to the limit).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console

from grpolab.commands.cli import parse_overrides
from grpolab.config import load_config
from grpolab.run.trainer import Trainer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from training_phase import GSM8K_LIKE  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gsm8k-like", action="store_true")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    args, rest = parser.parse_known_args(argv)
    torch.set_num_threads(args.threads)
    like = {**GSM8K_LIKE, "rollout.max_new_tokens": 32} if args.gsm8k_like else {}
    overrides = {**like, **parse_overrides(rest), "threads": args.threads, "rollout.engine": "hf"}
    console = Console()
    with tempfile.TemporaryDirectory(prefix="grpolab-prefill-") as root:
        trainer = Trainer(load_config(None, {**overrides, "output_dir": f"{root}/run"}), Console(quiet=True))
        try:
            r = trainer.cfg.rollout
            prompts = [trainer.parts.prompt_ids[e.id] for e in trainer.parts.prompts.take(r.prompts_per_step)]
            params = trainer.parts.collector.sampling_params(0, 0)
            seconds: dict[bool, list[float]] = {True: [], False: []}
            outputs = {}
            for repeat in range(args.repeats + 1):
                for shared in (True, False):
                    trainer.parts.engine.shared_prefill = shared
                    started = time.perf_counter()
                    outputs[shared] = trainer.parts.engine.generate(prompts, r.group_size, params)
                    if repeat:  # the first round warms up
                        seconds[shared].append(time.perf_counter() - started)
        finally:
            trainer.close()
    same = [[c.completion_ids for c in g] for g in outputs[True]] == [
        [c.completion_ids for c in g] for g in outputs[False]
    ]
    tokens = sum(len(c.completion_ids) for g in outputs[True] for c in g)
    mean_prompt = statistics.mean(map(len, prompts))
    console.print(
        f"{len(prompts)} prompts (mean {mean_prompt:.0f} tokens) x {r.group_size}, <= {r.max_new_tokens} new "
        f"tokens, {tokens} generated, {args.threads} thread(s); same completions: {same}"
    )
    on, off = statistics.median(seconds[True]), statistics.median(seconds[False])
    console.print(f"shared prefill {on:.3f} s, every row prefilled {off:.3f} s: {off / on:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
