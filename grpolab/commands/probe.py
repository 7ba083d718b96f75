"""`grpolab probe`: will this config fit? Two real optimizer updates at the worst-case shapes.

Every sequence of the rollout batch is the longest training prompt followed by a full
``max_new_tokens`` completion (random tokens, random +-1 advantages), so the update sees the largest
tensors the run can produce. Update 1, a real generation of the whole rollout batch (``prompts_per_step``
x ``group_size`` samples of the longest prompt, as a step generates them at once), update 2; then a
JSON report of peak memory, the bytes each part holds (the reward models' among them, and their total),
tensor shapes, parameter tensors that received gradient, optimizer state, the rollout's key/value cache
at its largest (counted from the model's shapes: sampled completions may stop before ``max_new_tokens``,
so the measured peak can fall short of it) and seconds per phase.

Each phase (load, update 1, generation, update 2) is a named ``Reporter`` phase: piped output gets its
lines and a heartbeat every 30 s, the updates count their micro-batches with the time left, and once the
first micro-batch is measured a line estimates the whole probe. The report is written as the probe goes
(atomically, after each phase, ``"complete": false`` until the end), so a killed probe leaves a partial
report that says which phases finished.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from grpolab.common.progress import Phase, Reporter, format_seconds
from grpolab.common.provenance import cpu_description
from grpolab.config import RunConfig
from grpolab.learning.batching import TrainBatch, collate
from grpolab.learning.learner import BatchForward, PolicyLearner
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


def counted(forward: BatchForward, each: Callable[[], None]) -> BatchForward:
    """``forward`` calling ``each()`` after every training micro-batch's forward (the update's progress)."""
    logprobs = forward.logprobs

    def counting(*args, **kwargs):
        out = logprobs(*args, **kwargs)
        each()
        return out

    forward.logprobs = counting
    return forward


def probe_update(
    learner: PolicyLearner, batch: TrainBatch, advantages: torch.Tensor, each: Callable[[], None] = lambda: None
) -> dict[str, Any]:
    """One optimizer step over the whole batch by the learner's own update; counts the gradients it produced.
    ``each()`` is called after every micro-batch's forward."""
    started = time.perf_counter()
    # a distillation teacher scores the batch first, as in a run (its own frozen forward, not counted as the update's)
    teacher = learner.teacher_logprobs(learner.forward(batch))
    data = UpdateData(
        advantages=advantages, response_mask=batch.response_mask, old_logprobs=None, teacher_logprobs=teacher
    )
    with_grad: list[int] = []
    counting = learner.optimizer.register_step_pre_hook(
        lambda *_: with_grad.append(
            sum(1 for p in learner.params if p.grad is not None and bool(p.grad.abs().sum() > 0))
        )
    )
    try:
        result = learner.update(
            data, counted(learner.forward(batch), each), spec=learner.spec.override(epochs=1, steps_per_epoch=1)
        )
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


def run_probe(cfg: RunConfig, report_path: Path, reporter: Reporter | None = None) -> dict[str, Any]:
    """Run the probe for ``cfg`` and write its JSON report to ``report_path`` (which must not exist): after each
    phase with ``"complete": false`` and the phases done so far, at the end whole with ``"complete": true``.
    ``reporter`` shows the phases (None: nothing is printed)."""
    if report_path.exists():
        raise FileExistsError(
            f"probe report already exists: {report_path} (an earlier probe's, perhaps a partial one); "
            "choose another --report or move it away"
        )
    reporter = reporter or Reporter(Console(quiet=True))
    with reporter.phase("probe: load") as phase:
        parts = assemble(cfg, lambda ranks: reporter)
        phase.info = f"{sum(p.numel() for p in parts.model.parameters()):,} parameters"
    try:
        out = _probe(parts, reporter, ProbeReport(report_path), phase.elapsed())
    finally:
        parts.close()
    return out


class ProbeReport:
    """The JSON report as the probe goes: each phase's results merged in and written whole (atomically)."""

    def __init__(self, path: Path):
        self.path, self.data = path, {"complete": False, "phases_done": [], "phase_seconds": {}}
        path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, results: dict[str, Any], phase: str, seconds: float, complete: bool = False) -> None:
        self.data.update(results)
        self.data["phases_done"].append(phase)
        self.data["phase_seconds"][phase] = seconds
        self.data["complete"] = complete
        write_json(self.path, self.data)


def _update_phase(
    reporter: Reporter,
    title: str,
    parts: RunParts,
    batch: TrainBatch,
    advantages: torch.Tensor,
    micros: int,
    on_first: Callable[[float], None] = lambda _: None,
) -> dict[str, Any]:
    """One probe update shown as a phase of ``micros`` micro-batches (time left from those done);
    ``on_first(seconds)`` hears the first micro-batch's time."""
    with reporter.phase(title, total=micros, unit="micro-batches") as phase:

        def each(phase: Phase = phase) -> None:
            phase.advance()
            if phase.done == 1:
                on_first(phase.elapsed())

        result = probe_update(parts.learner, batch, advantages, each)
        phase.info = f"grad norm {result['grad_norm']:.3g}"
    return result


def _probe(parts: RunParts, reporter: Reporter, report: ProbeReport, load_seconds: float) -> dict[str, Any]:
    cfg, device = parts.cfg, parts.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    generator = torch.Generator().manual_seed(cfg.seed)
    batch, longest_id = worst_case_batch(parts, generator)
    signs = torch.randint(0, 2, (len(batch),), generator=generator).float() * 2 - 1
    advantages = signs.to(device)
    prompt = parts.prompt_ids[longest_id]
    r = cfg.rollout
    rows = r.prompts_per_step * r.group_size
    micros = len(parts.learner.forward(batch).planner.plan(torch.arange(len(batch))))

    def estimate(first: float) -> None:
        """Once the first micro-batch is timed: the two updates at that rate, and what is not estimated."""
        reporter.line(
            f"probe: the first micro-batch took {first:.2f} s; {micros} per update x 2 updates: "
            f"about {format_seconds(first * micros * 2)} for the updates (a first micro-batch is often the "
            f"slowest), plus a generation of {rows} completions of up to {r.max_new_tokens} tokens"
        )

    phase_peaks = {"setup": peak_memory_mb(device, reset=True)}
    report.write(
        {
            "config": cfg.model_dump(mode="json"),
            "model": model_record(parts.model, parts.model_dir),
            "device": str(device),
            "dtype": str(next(parts.model.parameters()).dtype),
            "algorithm": parts.spec.name,
            "batch": _batch_record(parts, batch, longest_id, micros),
            "shapes": _shapes(parts, batch),
        },
        "load",
        load_seconds,
    )
    first = _update_phase(reporter, "probe: update 1", parts, batch, advantages, micros, estimate)
    phase_peaks["update_1"] = peak_memory_mb(device, reset=True)
    report.write({"updates": [first], "phase_peak_memory_mb": dict(phase_peaks)}, "update_1", first["seconds"])

    started = time.perf_counter()
    with reporter.phase(f"probe: generation of {rows} completions (<= {r.max_new_tokens} tokens)") as phase:
        groups = parts.engine.generate(
            [prompt] * r.prompts_per_step, r.group_size, parts.collector.sampling_params(0, 0)
        )
        phase.set_status("weight sync")
        parts.engine.sync_weights(parts.sync_source())
        phase.set_status("")
        tokens = sum(len(c.completion_ids) for g in groups for c in g)
        phase.info = f"{tokens} tokens"
    cache_rows = min(rows, r.max_batch_size) if capabilities(r.engine).bounded_batch else rows
    generation = {
        "seconds": time.perf_counter() - started,
        "completions": rows,
        "tokens": tokens,
        "kv_cache_rows": cache_rows,
        "kv_cache_bytes": kv_cache_bytes(
            parts.model.config, cache_rows, len(prompt) + r.max_new_tokens, parts.precision.compute
        ),
    }
    phase_peaks["generation"] = peak_memory_mb(device, reset=True)
    report.write(
        {"generation": generation, "phase_peak_memory_mb": dict(phase_peaks)}, "generation", generation["seconds"]
    )
    second = _update_phase(reporter, "probe: update 2", parts, batch, advantages, micros)
    phase_peaks["update_2"] = peak_memory_mb(device)
    n_params = sum(p.numel() for p in parts.model.parameters())
    state = parts.optimizer.state
    final = {
        "updates": [first, second],
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
        "cpu": cpu_description(),  # its model, vector extensions and whether it has native bf16
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
    }
    report.write(final, "update_2", second["seconds"], complete=True)
    return report.data


def _batch_record(parts: RunParts, batch: TrainBatch, longest_id: str, micros: int) -> dict[str, Any]:
    cfg = parts.cfg
    return {
        "sequences": len(batch),
        "longest_prompt_id": longest_id,
        "prompt_tokens": len(parts.prompt_ids[longest_id]),
        "max_new_tokens": cfg.rollout.max_new_tokens,
        "sequence_length": batch.input_ids.shape[1],
        "micro_batch_size": cfg.optim.micro_batch_size,
        "micro_batch_tokens": cfg.optim.micro_batch_tokens,
        "micro_batches": micros,
        "shared_prompts": parts.learner.share_prompts,
        "logprob_chunk_size": cfg.model.logprob_chunk_size,
        "gradient_checkpointing": cfg.model.gradient_checkpointing,
    }


def _shapes(parts: RunParts, batch: TrainBatch) -> dict[str, list[int]]:
    cfg = parts.cfg
    hidden = parts.model.config.hidden_size
    vocab = parts.model.get_output_embeddings().weight.shape[0]
    mb, length, chunk = cfg.optim.micro_batch_size, batch.input_ids.shape[1], cfg.model.logprob_chunk_size
    return {
        "input_ids": [len(batch), length],
        "micro_batch": [mb, length],
        "hidden_states": [mb, length, hidden],
        "logits_chunk": [mb, min(chunk, length - 1), vocab],
        "full_logits_avoided": [mb, length, vocab],
    }
