"""The training phase of one RL step, before and after shared prompts and token budgets, side by side.

    python benchmarks/training_phase.py --threads 1                       # the demo's shapes
    python benchmarks/training_phase.py --threads 1 --gsm8k-like          # like:qwen3-0.6b, 2 layers, GSM8K

One rollout batch (``rollout.prompts_per_step`` real prompts of the task x ``group_size`` completions)
and one optimizer step's forward and backward over it (``accumulate_gradients``, advantages +-1, no
pruning), timed for each way of computing it, after one warm-up:
  previous       the path before shared prompts: ``token_logprobs`` on right-padded rows, micro-batches
                 of ``optim.micro_batch_size`` rows, the output layer on every position
  rows           one sequence per row, the output layer on completion tokens only
  shared         each prompt computed once for its group (``grpolab.learning.shared_prefix``)
  shared+tokens  the same, micro-batches by a token budget (``--micro-batch-tokens``)
For each: seconds (median), speed-up over ``previous``, and the largest differences from it: of the
log-probs of completion tokens (absolute) and of the gradient (relative to its largest entry).

Completions: the demo's are sampled by the model; ``--gsm8k-like`` ones are random tokens of uniform
random length in [max_new_tokens / 4, max_new_tokens] (a random-weight model never stops, so sampling
would make every completion the longest), after real GSM8K prompts in the r1_zero format.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.console import Console

from grpolab.commands.cli import parse_overrides
from grpolab.config import load_config
from grpolab.learning.batching import collate
from grpolab.learning.update import StepContext, UpdateData, UpdateSchedule, accumulate_gradients
from grpolab.models.logprobs import token_logprobs
from grpolab.rollout.base import Completion
from grpolab.run.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
GSM8K_LIKE = {
    "model.path": "like:qwen3-0.6b",
    "model.like_overrides": {"num_hidden_layers": 2},
    "task.name": "gsm8k",
    "task.train_path": str(ROOT / "data/gsm8k/train.jsonl"),
    "task.test_path": str(ROOT / "data/gsm8k/test.jsonl"),
    "task.n_val": 8,
    "rollout.prompts_per_step": 2,
    "rollout.group_size": 8,
    "rollout.max_new_tokens": 128,
    "optim.micro_batch_size": 16,
}


def rollout_batch(trainer: Trainer, gsm8k_like: bool):
    cfg = trainer.cfg.rollout
    prompts = [trainer.parts.prompt_ids[e.id] for e in trainer.parts.prompts.take(cfg.prompts_per_step)]
    if not gsm8k_like:
        groups = trainer.parts.engine.generate(prompts, cfg.group_size, trainer.parts.collector.sampling_params(0, 0))
        return collate([c for g in groups for c in g], trainer.parts.tokenizer.pad_token_id)
    gen = torch.Generator().manual_seed(0)
    vocab = trainer.parts.model.get_output_embeddings().weight.shape[0]
    rows = []
    for prompt in prompts:
        for _ in range(cfg.group_size):
            length = int(torch.randint(cfg.max_new_tokens // 4, cfg.max_new_tokens + 1, (1,), generator=gen))
            tokens = torch.randint(0, vocab, (length,), generator=gen).tolist()
            rows.append(Completion(prompt, tokens, [0.0] * length, "length", ""))
    return collate(rows, trainer.parts.tokenizer.pad_token_id)


def previous_logprobs(trainer: Trainer, batch):
    """The training forward before shared prompts (kept here as the baseline)."""
    cfg = trainer.cfg

    def logprobs(indices):
        sub = batch.select(indices)
        stats = token_logprobs(
            trainer.parts.model,
            sub.input_ids,
            sub.attention_mask,
            temperature=cfg.rollout.temperature,
            chunk_size=cfg.model.logprob_chunk_size,
            with_entropy=True,
        )
        pad = (0, batch.input_ids.shape[1] - sub.input_ids.shape[1])
        return F.pad(stats.logprobs, pad), F.pad(stats.entropy, pad)

    return logprobs, None


def variant(trainer: Trainer, batch, share: bool, tokens: int | None):
    learner = trainer.parts.learner
    learner.share_prompts = share
    learner.cfg = trainer.cfg.model_copy(
        update={"optim": trainer.cfg.optim.model_copy(update={"micro_batch_tokens": tokens})}
    )
    forward = learner.forward(batch)
    return (lambda idx: forward.logprobs(trainer.parts.learner.train_forward, idx, True)), forward.planner.plan


def measure(trainer: Trainer, batch, advantages, logprobs, plan, repeats: int):
    cfg, model = trainer.cfg, trainer.parts.model
    spec = trainer.spec.override(epochs=1, steps_per_epoch=1, prune_zero_advantage=False)
    data = UpdateData(advantages=advantages, response_mask=batch.response_mask, old_logprobs=None)
    rows = torch.arange(len(batch))
    seconds = []
    for _ in range(repeats + 1):
        model.zero_grad(set_to_none=True)
        started = time.perf_counter()
        schedule = UpdateSchedule(cfg.optim.micro_batch_size, cfg.rollout.max_new_tokens, full_metrics=False, plan=plan)
        accumulate_gradients(StepContext(spec, data, rows, schedule), logprobs)
        seconds.append(time.perf_counter() - started)
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    with torch.no_grad():
        micros = plan(rows) if plan else list(rows.split(cfg.optim.micro_batch_size))
        values = torch.cat([logprobs(micro)[0] for micro in micros])
        restored = torch.zeros_like(values)
        restored[torch.cat(micros)] = values  # back to row order
    return statistics.median(seconds[1:]), restored * batch.response_mask, grads


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gsm8k-like", action="store_true", help="like:qwen3-0.6b (2 layers), GSM8K r1_zero prompts")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--micro-batch-tokens",
        type=int,
        default=None,
        help="token budget of shared+tokens (default: the micro-batch count x the longest sequence)",
    )
    args, rest = parser.parse_known_args(argv)
    torch.set_num_threads(args.threads)
    overrides = {**(GSM8K_LIKE if args.gsm8k_like else {}), **parse_overrides(rest), "threads": args.threads}
    console = Console()
    with tempfile.TemporaryDirectory(prefix="grpolab-training-phase-") as root:
        cfg = load_config(None, {**overrides, "output_dir": f"{root}/run", "rollout.engine": "hf"})
        trainer = Trainer(cfg, Console(quiet=True))
        try:
            batch = rollout_batch(trainer, args.gsm8k_like)
            n, width = batch.input_ids.shape
            tokens = args.micro_batch_tokens or cfg.optim.micro_batch_size * width
            advantages = torch.tensor([1.0, -1.0]).repeat((n + 1) // 2)[:n]
            trainer.parts.model.train()
            console.print(
                f"{n} sequences of <= {width} tokens ({int(batch.attention_mask.sum())} real, "
                f"{int(batch.prompt_lens.sum())} of them prompt), {args.threads} thread(s), "
                f"{sum(p.numel() for p in trainer.parts.model.parameters()) / 1e6:.1f}M parameters"
            )
            ways = {
                "previous": previous_logprobs(trainer, batch),
                "rows": variant(trainer, batch, False, None),
                "shared": variant(trainer, batch, True, None),
                "shared+tokens": variant(trainer, batch, True, tokens),
            }
            results = {name: measure(trainer, batch, advantages, *way, args.repeats) for name, way in ways.items()}
        finally:
            trainer.close()
    base_s, base_lp, base_g = results["previous"]
    console.print(f"{'way':<14} {'seconds':>8} {'speed-up':>9} {'max|dlogp|':>11} {'grad rel diff':>14}")
    for name, (s, lp, g) in results.items():
        console.print(
            f"{name:<14} {s:8.3f} {base_s / s:8.2f}x {(lp - base_lp).abs().max():11.1e} "
            f"{((g - base_g).abs().max() / base_g.abs().max()):14.1e}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
