"""The sync check's margins over a run: in sync, and with an engine whose weight sync breaks, per calibration window.

    python benchmarks/sync_margins.py                                  # the tests' tiny model, bf16, 14 steps
    python benchmarks/sync_margins.py --windows 3 --model.dtype float32 --model.path DIR

The engine holds its own copy of the weights, into which every weight sync copies the trainer's: with
float32 masters of a bf16 compute dtype (``optim.precision fp32_master``, the default) the hf engine's own bf16
copy (``grpolab.rollout.hf.engine_weights``), else a copy in the trainer's dtype (as vLLM does). From step
``--stale-from`` on the copy is no longer refreshed (a broken sync).
For each calibration window (``rollout.sync_calibration_steps``) one run in sync and one with the broken
sync, from the same start: per step the mean |engine - trainer| log-prob and its margin (``sync/margin``,
1 = the run stops), the noise floor, and where the run stopped.
"""

from __future__ import annotations

import argparse
import copy
import tempfile

import torch
from rich.console import Console

from grpolab.commands.cli import parse_overrides
from grpolab.config import load_config
from grpolab.rollout.hf.engine import HFEngine
from grpolab.rollout.sync_check import WeightSyncError
from grpolab.run.trainer import Trainer

# the tests' warm-started tiny model and task (tests/conftest.py: TASK, QUICK_WARM_START)
TESTS_MODEL = {
    "task.n_train": 60,
    "task.n_val": 16,
    "task.digits": 1,
    "rollout.prompts_per_step": 16,
    "rollout.group_size": 8,
    "rollout.max_new_tokens": 40,
    "optim.micro_batch_size": 16,
    "model.warm_start": {
        "steps": 150,
        "hidden_size": 64,
        "num_layers": 2,
        "num_heads": 2,
        "intermediate_size": 128,
        "batch_size": 32,
        "lr": 5e-3,
        "tie_word_embeddings": True,
    },
    "model.dtype": "bfloat16",
    "optim.lr": 1e-5,
    "eval.every": 1000,
    "checkpoint.every": 1000,
}


class StaleEngine:
    """The run's own engine (the hf engine on its compute-dtype copy); ``sync_weights`` passes on unless ``stale``."""

    def __init__(self, engine):
        self.inner, self.stale = engine, False

    def generate(self, prompts, n, params):
        return self.inner.generate(prompts, n, params)

    def sync_weights(self, weights):
        if not self.stale:
            self.inner.sync_weights(weights)

    def close(self):
        self.inner.close()


class CopyEngine:
    """The hf engine on a copy of the policy; ``sync_weights`` copies the trainer's weights in unless ``stale``."""

    def __init__(self, model, tokenizer, max_batch_size: int):
        self.copy = copy.deepcopy(model)
        self.inner = HFEngine(self.copy, tokenizer, max_batch_size=max_batch_size)
        self.stale = False

    def generate(self, prompts, n, params):
        return self.inner.generate(prompts, n, params)

    def sync_weights(self, model):
        if not self.stale:
            with torch.no_grad():
                for mine, theirs in zip(self.copy.parameters(), model.parameters()):
                    mine.copy_(theirs)

    def close(self):
        pass


def run(overrides: dict, root: str, steps: int, stale_from: int | None) -> tuple[list[dict], int | None, float]:
    """The step records until ``steps`` or the stop, the step that stopped (None), and the noise floor."""
    trainer = Trainer(load_config(None, {**overrides, "output_dir": root}), Console(quiet=True))
    own = trainer.parts.collector.engine
    if getattr(own, "copy", None) is not None:
        engine = StaleEngine(own)
    else:
        engine = CopyEngine(trainer.parts.model, trainer.parts.tokenizer, trainer.cfg.rollout.max_batch_size)
    trainer.parts.collector.engine = engine
    records, stopped = [], None
    try:
        for step in range(1, steps + 1):
            engine.stale = stale_from is not None and step >= stale_from
            records.append(trainer.train_step(step))
    except WeightSyncError:
        stopped = step
    finally:
        trainer.close()
    return records, stopped, trainer.parts.sync_monitor.noise_floor


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--windows", type=int, nargs="+", default=[1, 3, 5])
    parser.add_argument("--stale-from", type=int, default=4, help="the first step whose sync is skipped")
    parser.add_argument("--threads", type=int, default=1)
    args, rest = parser.parse_known_args(argv)
    torch.set_num_threads(args.threads)
    console = Console()
    for window in args.windows:
        for stale_from in (None, args.stale_from):
            extra = parse_overrides(rest)
            base = {k: v for k, v in TESTS_MODEL.items() if k != "model.warm_start" or "model.path" not in extra}
            overrides = {**base, **extra, "threads": args.threads, "rollout.sync_calibration_steps": window}
            with tempfile.TemporaryDirectory(prefix="grpolab-sync-") as root:
                records, stopped, floor = run(overrides, f"{root}/run", args.steps, stale_from)
            margins = [r["sync/margin"] for r in records]
            what = "in sync" if stale_from is None else f"stale from {stale_from}"
            end = f"stopped at step {stopped}" if stopped else "no stop"
            console.print(
                f"window {window} {what:>14}: floor {floor:.2e}  margins {min(margins):.2f}-{max(margins):.2f}  {end}",
                highlight=False,
                soft_wrap=True,
            )
            console.print(
                "    mean |diff| / margin: "
                + " ".join(f"{r['sync/logprob_diff_mean']:.2e}/{m:.2f}" for r, m in zip(records, margins)),
                highlight=False,
                soft_wrap=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
