"""The training phase of an RL step against the matmul roofline of its dtype, at 1 and 2 threads, side by side.

    python benchmarks/training_roofline.py                    # SmolLM2-135M-Instruct, 8 prompts x 8, <= 64 tokens
    python benchmarks/training_roofline.py --threads 1 --dtypes bfloat16 --repeats 3
    python benchmarks/training_roofline.py --config demo       # the demo's tiny model: checks that it runs
    python benchmarks/training_roofline.py --rollout.max_new_tokens 128   # overrides of the config

One rollout batch of the config (default ``configs/smollm2_arithmetic.toml`` with 8 prompts x 8 samples, at most
64 new tokens, temperature 1, hf engine; the sync check off, as the same batch is learned again) and, for each
dtype and thread count, its training phase timed as ``grpolab.run.step.rl_step`` times it
(``PolicyLearner.learn``: the old log-prob pass, the reference pass when the objective has one, the forwards and
backwards of every optimizer step, the optimizer), median of ``--repeats`` after one warm-up.

FLOPs: counted once over one ``learn`` by torch's ``FlopCounterMode`` (matmuls, attention, their backwards: the
work a roofline bounds; elementwise work, the log-softmax over the vocabulary and the optimizer are not counted,
so the share below is of the matmul work alone). Roofline: the fastest of the model's own training matmul shapes
(a micro-batch's tokens x each linear layer's weight, the output layer included) timed as ``F.linear`` in the
dtype at the thread count, best of 5. Printed per variant: seconds, achieved FLOP/s, the roofline's FLOP/s and
the share (achieved / roofline). Needs an idle machine for meaningful figures.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from rich import box
from rich.console import Console
from rich.table import Table
from torch.utils.flop_counter import FlopCounterMode

from grpolab.commands.cli import parse_overrides
from grpolab.common.progress import Reporter
from grpolab.common.provenance import cpu_description, describe_cpu
from grpolab.config import load_config
from grpolab.run.parts import assemble

sys.path.insert(0, str(Path(__file__).resolve().parent))
from precision_step import SETTINGS as STEP_SETTINGS  # noqa: E402
from precision_step import SMOLLM2  # noqa: E402

SETTINGS = {**STEP_SETTINGS, "rollout.sync_check": False}  # precision_step's, the same batch learned again


def matmul_roofline(model: torch.nn.Module, rows: int, dtype: torch.dtype, repeats: int = 5) -> float:
    """FLOP/s of the fastest ``F.linear`` over the model's distinct linear weight shapes at ``rows`` rows, in
    ``dtype``, at the current thread count (best of ``repeats`` per shape)."""
    shapes = {tuple(m.weight.shape) for m in model.modules() if isinstance(m, torch.nn.Linear)}
    best = 0.0
    for out_features, in_features in sorted(shapes):
        x = torch.randn(rows, in_features, dtype=dtype)
        w = torch.randn(out_features, in_features, dtype=dtype)
        F.linear(x, w)  # warm-up
        seconds = min(_timed(lambda x=x, w=w: F.linear(x, w)) for _ in range(repeats))
        best = max(best, 2 * rows * in_features * out_features / seconds)
    return best


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(
    config: str | None, overrides: dict, dtype: str, threads: list[int], repeats: int, console: Console
) -> list[dict]:
    """One rollout batch of the config (with ``overrides``) in ``dtype``; its training phase's FLOPs, then per
    thread count its seconds and the roofline."""
    cfg = load_config(config, {**SETTINGS, **overrides, "model.dtype": dtype, "threads": threads[0]})
    parts = assemble(cfg, lambda ranks: Reporter(Console(quiet=True)))
    try:
        rollout = parts.rollouts.batch(1)
        with FlopCounterMode(display=False) as counter:
            parts.learner.learn(rollout)
        flops = counter.get_total_flops()
        tokens = sum(len(c.prompt_ids) + len(c.completion_ids) for c in rollout.flat())
        rows = tokens // max(1, -(-len(rollout.flat()) // cfg.optim.micro_batch_size))  # a micro-batch's tokens
        out = []
        for n in threads:
            torch.set_num_threads(n)
            parts.learner.learn(rollout)  # warm-up at this thread count
            seconds = statistics.median(_timed(lambda: parts.learner.learn(rollout)) for _ in range(repeats))
            roofline = matmul_roofline(parts.model, rows, parts.precision.compute)
            out.append(
                {"dtype": dtype, "threads": n, "seconds": seconds, "flops": flops, "roofline": roofline, "rows": rows}
            )
            console.print(
                f"training_roofline: {dtype}, {n} thread(s): {seconds:.2f} s, {flops / seconds / 1e9:.1f} GFLOP/s "
                f"of {roofline / 1e9:.1f}",
                highlight=False,
            )
        return out
    finally:
        parts.close()


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(SMOLLM2), help="a config file, or 'demo' (the demo's tiny model)")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2], help="torch CPU thread counts")
    parser.add_argument("--repeats", type=int, default=2, help="timed training phases per variant")
    args, rest = parser.parse_known_args(argv)
    if args.repeats < 1 or min(args.threads) < 1:
        parser.error("--repeats and --threads must be >= 1")
    console = Console()
    config = None if args.config == "demo" else args.config
    overrides = parse_overrides(rest)
    results = [
        r for dtype in args.dtypes for r in measure(config, overrides, dtype, args.threads, args.repeats, console)
    ]
    table = Table(
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        title=f"Training phase against its dtype's matmul roofline; {describe_cpu(cpu_description())}",
    )
    for column in ("dtype", "threads", "seconds", "GFLOP", "GFLOP/s", "roofline GFLOP/s", "share"):
        table.add_column(column, justify="left" if column == "dtype" else "right")
    for r in results:
        achieved = r["flops"] / r["seconds"]
        table.add_row(
            r["dtype"],
            str(r["threads"]),
            f"{r['seconds']:.2f}",
            f"{r['flops'] / 1e9:.1f}",
            f"{achieved / 1e9:.1f}",
            f"{r['roofline'] / 1e9:.1f}",
            f"{achieved / r['roofline']:.0%}",
        )
    console.print(table)
    return results


if __name__ == "__main__":
    main()
