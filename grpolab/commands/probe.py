"""`grpolab probe`: will this config fit? Two real optimizer updates at the worst-case shapes.

Every sequence of the rollout batch is the longest training prompt followed by a full
``max_new_tokens`` completion (random tokens, random +-1 advantages), so the update sees the largest
tensors the run can produce. Update 1, a real generation of the whole rollout batch (``prompts_per_step``
x ``group_size`` samples of the longest prompt, as a step generates them at once), update 2; then a
JSON report of peak memory, the bytes each part holds (the reward models' among them, and their total),
tensor shapes, parameter tensors that received gradient, optimizer state, the rollout's key/value cache
at its largest (counted from the model's shapes: sampled completions may stop before ``max_new_tokens``,
so the measured peak can fall short of it) and seconds per phase.
"""

from __future__ import annotations

import resource
import time
from pathlib import Path
from typing import Any

import torch

from grpolab.config import RunConfig
from grpolab.learning.batching import TrainBatch, collate
from grpolab.learning.learner import PolicyLearner
from grpolab.learning.update import UpdateData
from grpolab.models.loading import model_record
from grpolab.models.precision import memory_table
from grpolab.rollout.base import Completion
from grpolab.rollout.engines import capabilities
from grpolab.run.parts import RunParts, assemble
from grpolab.run.rundir import write_json


def peak_memory_mb(device: torch.device, reset: bool = False) -> float:
    """CUDA: peak allocated by torch (since the last reset; ``reset`` starts a new window);
    CPU: peak resident memory of the process (never reset)."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) / 2**20
        if reset:
            torch.cuda.reset_peak_memory_stats(device)
        return peak
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(
        t.numel() * t.element_size()
        for state in optimizer.state.values()
        for t in state.values()
        if isinstance(t, torch.Tensor)
    )


def bytes_by_part(parts: RunParts) -> dict[str, int | None]:
    """Bytes the run holds for each part: the frozen weights, the trained ones, their gradients (same dtype),
    the optimizer's state, the reference's own weights (0 when it is the policy, adapter off), the reward
    models' weights and buffers (None without a reward model) and ``total``, their sum."""

    def size(params) -> int:
        return sum(p.numel() * p.element_size() for p in params)

    model, reference = parts.model, parts.reference
    trained = size(parts.policy.trainable())
    out = {
        "frozen_weights": size(p for p in model.parameters() if not p.requires_grad),
        "trained_weights": trained,
        "gradients": trained,
        "optimizer_state": optimizer_state_bytes(parts.optimizer),
        "reference_weights": 0 if reference is None or reference is model else size(reference.parameters()),
        "reward_models": parts.reward_models.memory_bytes() if parts.reward_models is not None else None,
    }
    return {**out, "total": sum(v or 0 for v in out.values())}


def worst_case_batch(parts: RunParts, generator: torch.Generator) -> tuple[TrainBatch, str]:
    """N = prompts x group rows of (longest training prompt + max_new_tokens random tokens)."""
    cfg = parts.cfg.rollout
    longest_id = max((e.id for e in parts.task.train_examples()), key=lambda i: len(parts.prompt_ids[i]))
    prompt = parts.prompt_ids[longest_id]
    vocab = parts.model.get_output_embeddings().weight.shape[0]
    rows = []
    for _ in range(cfg.prompts_per_step * cfg.group_size):
        tokens = torch.randint(0, vocab, (cfg.max_new_tokens,), generator=generator).tolist()
        rows.append(Completion(prompt, tokens, [0.0] * len(tokens), "length", ""))
    return collate(rows, parts.tokenizer.pad_token_id).to(parts.device), longest_id


def kv_cache_bytes(config, rows: int, length: int, dtype: torch.dtype) -> int:
    """Bytes of a transformers key/value cache holding ``rows`` sequences of ``length`` tokens: keys and
    values of every layer, [rows, kv_heads, length, head_dim] each, in ``dtype``."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    element = torch.empty(0, dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * rows * kv_heads * length * head_dim * element


def probe_update(learner: PolicyLearner, batch: TrainBatch, advantages: torch.Tensor) -> dict[str, Any]:
    """One optimizer step over the whole batch by the learner's own update; counts the gradients it produced."""
    started = time.perf_counter()
    data = UpdateData(advantages=advantages, response_mask=batch.response_mask, old_logprobs=None)
    with_grad: list[int] = []
    counting = learner.optimizer.register_step_pre_hook(
        lambda *_: with_grad.append(
            sum(1 for p in learner.params if p.grad is not None and bool(p.grad.abs().sum() > 0))
        )
    )
    try:
        result = learner.update(data, learner.forward(batch), spec=learner.spec.override(epochs=1, steps_per_epoch=1))
    finally:
        counting.remove()
    if learner.device.type == "cuda":
        torch.cuda.synchronize()
    return {
        "seconds": time.perf_counter() - started,
        "grad_norm": result.grad_norms[0],
        "parameter_tensors_with_nonzero_grad": with_grad[0],
        "parameter_tensors": len(learner.params),
        "trained_tokens": result.tokens.tokens,
    }


def run_probe(cfg: RunConfig, report_path: Path) -> dict[str, Any]:
    """Run the probe for ``cfg`` and write its JSON report to ``report_path`` (which must not exist)."""
    if report_path.exists():
        raise FileExistsError(f"probe report already exists: {report_path}")
    parts = assemble(cfg)
    try:
        report = _probe(parts)
    finally:
        parts.close()
    report_path.parent.mkdir(parents=True, exist_ok=True)
    write_json(report_path, report)
    return report


def _probe(parts: RunParts) -> dict[str, Any]:
    cfg, device = parts.cfg, parts.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    generator = torch.Generator().manual_seed(cfg.seed)
    batch, longest_id = worst_case_batch(parts, generator)
    signs = torch.randint(0, 2, (len(batch),), generator=generator).float() * 2 - 1
    advantages = signs.to(device)

    phase_peaks = {"setup": peak_memory_mb(device, reset=True)}
    first = probe_update(parts.learner, batch, advantages)
    phase_peaks["update_1"] = peak_memory_mb(device, reset=True)
    started = time.perf_counter()
    prompt = parts.prompt_ids[longest_id]
    r = cfg.rollout
    groups = parts.engine.generate([prompt] * r.prompts_per_step, r.group_size, parts.collector.sampling_params(0, 0))
    parts.engine.sync_weights(parts.sync_source())
    rows = r.prompts_per_step * r.group_size
    cache_rows = min(rows, r.max_batch_size) if capabilities(r.engine).bounded_batch else rows
    generation = {
        "seconds": time.perf_counter() - started,
        "completions": rows,
        "tokens": sum(len(c.completion_ids) for g in groups for c in g),
        "kv_cache_rows": cache_rows,
        "kv_cache_bytes": kv_cache_bytes(
            parts.model.config, cache_rows, len(prompt) + r.max_new_tokens, parts.precision.compute
        ),
    }
    phase_peaks["generation"] = peak_memory_mb(device, reset=True)
    second = probe_update(parts.learner, batch, advantages)
    phase_peaks["update_2"] = peak_memory_mb(device)
    n_params = sum(p.numel() for p in parts.model.parameters())

    state = parts.optimizer.state
    hidden = parts.model.config.hidden_size
    vocab = parts.model.get_output_embeddings().weight.shape[0]
    mb, length, chunk = cfg.optim.micro_batch_size, batch.input_ids.shape[1], cfg.model.logprob_chunk_size
    return {
        "model": model_record(parts.model, parts.model_dir),
        "device": str(device),
        "dtype": str(next(parts.model.parameters()).dtype),
        "algorithm": parts.spec.name,
        "batch": {
            "sequences": len(batch),
            "longest_prompt_id": longest_id,
            "prompt_tokens": len(prompt),
            "max_new_tokens": cfg.rollout.max_new_tokens,
            "sequence_length": length,
            "micro_batch_size": mb,
            "micro_batch_tokens": cfg.optim.micro_batch_tokens,
            "micro_batches": len(parts.learner.forward(batch).planner.plan(torch.arange(len(batch)))),
            "shared_prompts": parts.learner.share_prompts,
            "logprob_chunk_size": chunk,
            "gradient_checkpointing": cfg.model.gradient_checkpointing,
        },
        "shapes": {
            "input_ids": [len(batch), length],
            "micro_batch": [mb, length],
            "hidden_states": [mb, length, hidden],
            "logits_chunk": [mb, min(chunk, length - 1), vocab],
            "full_logits_avoided": [mb, length, vocab],
        },
        "updates": [first, second],
        "generation": generation,
        "parameters": {
            "total": n_params,
            "trained": sum(p.numel() for p in parts.policy.trainable()),
            "bytes": bytes_by_part(parts),
            "lora_rank": cfg.model.lora.rank if cfg.model.lora else None,
            "reference": (
                "none"
                if parts.reference is None
                else "the policy, adapter off (no copy)"
                if parts.reference is parts.model
                else "a frozen copy"
            ),
        },
        "optimizer_state_initialised": len(state) > 0 and all(len(s) > 0 for s in state.values()),
        "optimizer_state_tensors": len(state),
        "precision": {
            "setting": parts.precision.name,
            "weights": str(parts.precision.storage),
            "compute": str(parts.precision.compute),
            "optimizer_state_bytes": optimizer_state_bytes(parts.optimizer),
            "bytes_by_setting": memory_table(n_params),
        },
        "peak_memory_mb": max(phase_peaks.values()),
        "phase_peak_memory_mb": phase_peaks,
        "peak_memory_kind": "cuda max allocated" if device.type == "cuda" else "process max resident",
        "phase_seconds": {
            "update_1": first["seconds"],
            "generation": generation["seconds"],
            "update_2": second["seconds"],
        },
    }
