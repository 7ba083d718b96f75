"""Rollout engine on the training model itself: ``grpolab.rollout.hf.decode`` over transformers' KV cache.

Sampling is fully specified here and never inherits from ``model.generation_config`` (a checkpoint's
``generation_config.json`` may carry top_k=20, repetition penalties, ...): temperature, top-k and top-p
come from ``SamplingParams`` alone, and the log-prob of each sampled token is recorded under
``softmax(logits / temperature)`` (see ``grpolab.rollout.base`` for the convention). Rows that have
ended leave the decoding batch (see ``decode``).

Shared prefill (``grpolab.rollout.hf.prefill``): each distinct prompt of a batch is prefilled once for its
``n`` samples, and the prefix all its prompts share (a system prompt, a template's header) once for all;
only the prompts' last tokens are prefilled per row.

On a CPU, grouped key/value heads attend as they are, even with the padding's mask
(``grpolab.rollout.hf.grouped_attention``), and large weights are laid out once per call
(``grpolab.rollout.hf.packed_linear``).

With float32 master weights and a bf16 compute dtype the engine generates on its own copy of the model whose
linear weights are bf16, refreshed by each ``sync_weights`` (``grpolab.rollout.hf.engine_weights``); where the
weights are already in the compute dtype it generates on the training model itself.

Seeding: every batch seeds torch's RNG from ``params.seed`` and the global index of its first row
(``params.prompt_offset * n`` plus its position in the call; a call's first batch at offset 0 takes the
seed itself), inside ``torch.random.fork_rng``, so the caller's global RNG stream is left untouched.
Results for a seed depend on the batch's rows (prompts, ``n``, ``max_batch_size``): a rank whose share
starts on a batch boundary of the whole list samples exactly what one process samples for it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch
from torch import nn

from grpolab.models.logprobs import backbone_and_head
from grpolab.models.routing import routers
from grpolab.models.weights import PolicyWeights
from grpolab.rollout.base import Completion, EngineCapabilities, SamplingParams, collect_eos_ids
from grpolab.rollout.hf.decode import decode
from grpolab.rollout.hf.engine_weights import ComputeCopy, CopyMode, engine_weights
from grpolab.rollout.hf.grouped_attention import grouped_kv_attention
from grpolab.rollout.hf.packed_linear import packed_linears
from grpolab.rollout.hf.prefill import prompt_layout, shared_prefill
from grpolab.rollout.hf.routing_capture import RoutingCapture

__all__ = ["HFEngine"]


def batch_seed(seed: int, first_row: int) -> int:
    """The seed of a generation batch whose first row has global index ``first_row`` (``seed`` itself at 0)."""
    return seed if first_row == 0 else (seed * 1_000_003 + first_row * 7_919) % 2**63


class HFEngine:
    """``RolloutEngine`` that samples from the (training) model itself (``grpolab.rollout.hf.decode``).

    model: a transformers causal LM; generation runs in eval mode under ``torch.no_grad`` and
        the train/eval mode is restored afterwards.
    tokenizer: its tokenizer (decoding, EOS and pad ids).
    max_batch_size: most sequences (prompts x n) generated together.
    eos_token_ids: ids that end generation; default: the tokenizer's EOS plus the EOS ids of
        ``model.generation_config``.
    compute_context: a factory of the context generation runs in on the training model (the trainer's
        bf16 autocast when its weights are float32 masters), so that sampling and training forwards agree.
    compute_dtype: the trainer's compute dtype; where the model's weights are of another dtype (float32
        masters), generation runs on a copy with weights in this dtype (``grpolab.rollout.hf.engine_weights``;
        None: never a copy).
    copy_mode: which weights the copy casts: ``matmul`` (the linear layers', generating under
        ``compute_context`` as the trainer does) or ``all`` (every weight, without ``compute_context``).
    shared_prefill: prefill each distinct prompt of a batch, and the prefix they share, once
        (``grpolab.rollout.hf.prefill``).
    synced: the model's forwards are collectives over data-parallel ranks (FSDP): decoding goes on, with
        finished rows idle, until every rank's batch is done.
    pack_weights: on a CPU, generate with weights laid out once per call (``grpolab.rollout.hf.packed_linear``).

    An MoE model's completions carry the experts its routers chose for every token
    (``Completion.routed_experts``; ``grpolab.rollout.hf.routing_capture``).
    """

    capabilities = EngineCapabilities(
        shares_training_model=True,
        max_temperature=None,
        truncated_sampling=True,
        graceful_stop=True,
        records_routing=True,
        serves_adapters=False,
        batch_refill=False,
        bounded_batch=True,
    )

    def __init__(
        self,
        model: nn.Module,
        tokenizer,
        max_batch_size: int = 64,
        eos_token_ids: Sequence[int] | None = None,
        compute_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
        shared_prefill: bool = True,
        synced: bool = False,
        pack_weights: bool = True,
        compute_dtype: torch.dtype | None = None,
        copy_mode: CopyMode = "matmul",
    ):
        if max_batch_size < 1:
            raise ValueError("max_batch_size must be >= 1")
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.compute_context = compute_context
        self.shared_prefill, self.synced, self.pack_weights = shared_prefill, synced, pack_weights
        self.compute_dtype, self.copy_mode = compute_dtype, copy_mode
        self.copy: ComputeCopy | None = engine_weights(model, compute_dtype, copy_mode)
        self.eos_token_ids = (
            list(eos_token_ids)
            if eos_token_ids is not None
            else collect_eos_ids(tokenizer, getattr(getattr(model, "generation_config", None), "eos_token_id", None))
        )
        if not self.eos_token_ids:
            raise ValueError("no EOS token id: pass eos_token_ids")
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad_token_id = int(pad) if pad is not None else self.eos_token_ids[0]

    def sync_weights(self, weights: PolicyWeights) -> None:
        """For the model it was built with (kind ``full``): refreshes its compute-dtype copy where it has one,
        else nothing (it samples from the training model itself). Weights of another model object: generates
        with that one (or a copy of it) from now on."""
        if weights.model is not self.model:
            self.model = weights.model
            self.copy = engine_weights(self.model, self.compute_dtype, self.copy_mode)
        elif self.copy is not None:
            self.copy.refresh()

    @property
    def generation_model(self) -> nn.Module:
        """The model generation runs on: the compute-dtype copy, or the training model itself."""
        return self.copy.model if self.copy is not None else self.model

    def close(self) -> None:
        pass

    def generate(self, prompts: list[list[int]], n: int, params: SamplingParams) -> list[list[Completion]]:
        """``n`` completions per prompt, ``[len(prompts)][n]``, prompt order kept."""
        if n < 1:
            raise ValueError("n must be >= 1")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("empty prompt")
        flat = [list(p) for p in prompts for _ in range(n)]
        model = self.generation_model
        was_training = model.training
        device = next(model.parameters()).device
        out: list[Completion] = []
        try:
            model.eval()
            with contextlib.ExitStack() as stack:
                stack.enter_context(torch.no_grad())
                if self.copy is None or self.copy.autocast:
                    stack.enter_context(self.compute_context())
                stack.enter_context(grouped_kv_attention(model))
                if self.pack_weights:
                    stack.enter_context(packed_linears(model, min(len(flat), self.max_batch_size)))
                if params.seed is not None:
                    stack.enter_context(torch.random.fork_rng(devices=[device] if device.type == "cuda" else []))
                for i in range(0, len(flat), self.max_batch_size):
                    if params.seed is not None:
                        torch.manual_seed(batch_seed(params.seed, params.prompt_offset * n + i))
                    out.extend(self._generate_batch(model, flat[i : i + self.max_batch_size], params, device))
        finally:
            model.train(was_training)
        return [out[i * n : (i + 1) * n] for i in range(len(prompts))]

    def _generate_batch(
        self, model: nn.Module, prompts: list[list[int]], params: SamplingParams, device
    ) -> list[Completion]:
        capture = None
        if routers(model):
            capture = RoutingCapture(model, len(prompts), max(map(len, prompts)) + params.max_new_tokens, device)
        with capture.attach() if capture is not None else contextlib.nullcontext():
            if self.shared_prefill:
                input_ids, attention_mask, cache = shared_prefill(
                    backbone_and_head(model)[0],
                    model.config,
                    prompts,
                    self.pad_token_id,
                    device,
                    params.max_new_tokens,
                    on_forward=capture.at if capture is not None else None,
                )
            else:
                input_ids, attention_mask = (t.to(device) for t in prompt_layout(prompts, self.pad_token_id))
                cache = None
            out = decode(
                model,
                input_ids,
                attention_mask,
                max_new_tokens=params.max_new_tokens,
                temperature=params.temperature,
                top_k=params.top_k,
                top_p=params.top_p,
                eos_token_ids=self.eos_token_ids,
                cache=cache,
                stop_strings=params.stop_strings,
                synced=self.synced,
                decode_ids=lambda ids: self.tokenizer.decode(ids, skip_special_tokens=False),
                on_forward=(lambda rows, places: capture.at([[r] for r in rows], places))
                if capture is not None
                else None,
            )
        routed = capture.choices.cpu() if capture is not None else None
        return [
            Completion(
                prompt_ids=prompt,
                completion_ids=ids,
                logprobs=logprobs,
                finish_reason="stop" if stopped else "length",
                text=self.tokenizer.decode(ids, skip_special_tokens=True),
                routed_experts=None if routed is None else routed[row, : len(prompt) + len(ids)],
            )
            for row, (prompt, ids, logprobs, stopped) in enumerate(zip(prompts, out.tokens, out.logprobs, out.stopped))
        ]
