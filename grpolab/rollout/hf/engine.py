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
(``grpolab.models.grouped_attention``), and large weights are laid out once per call
(``grpolab.rollout.hf.packed_linear``).

With float32 master weights and a bf16 compute dtype the engine generates on its own copy of the model whose
linear weights are bf16, refreshed by each ``sync_weights`` (``grpolab.rollout.hf.engine_weights``); where the
weights are already in the compute dtype it generates on the training model itself.


Refill: a call's rows are decoded in one running batch of at most ``max_batch_size`` rows; as rows end, the
call's next rows join it (``grpolab.rollout.hf.decode``'s ``waiting``): their prompts are prefilled (shared
prefill where it applies), their cache joins the running one (``grpolab.rollout.hf.kv_cache.join_rows``) and
their prompts' last column rides in the next decoding step. Rows join once an eighth of the batch is free
(``refill_fraction``), or once every row still waiting fits. Each admission costs a prefill forward (a weight
pass, like a decoding step) and a copy of the cache; waiting for f of the batch to be free leaves about f / 2 of
it idle. With completions of L steps, rows join about every f * L steps, so the cost per step is about
1 / (f * L) forwards against f / 2 of a step's rows, least near f = sqrt(2 / L): 1/8 for L of about 130.
``docs/engines.md`` has a rough count of the trade-off. Refill is off, and
a call's rows are decoded batch after batch as before, under ``synced`` (a rank's prefill would be a collective
the other ranks do not join) and for a model whose cache has sliding-window or other layers
(``grpolab.rollout.hf.kv_cache.joins_rows``). An MoE model's routing is recorded under refill too.

Seeding: a row's ``t``-th token is sampled with ``grpolab.rollout.hf.draws.uniforms(params.seed, row, t)``, the
row's global index being ``params.prompt_offset * n`` plus its place in the call: a completion does not depend
on ``max_batch_size``, on when rows joined or left the batch, or on how ranks split the list, and a rank
samples exactly what one process samples for its rows. No RNG is seeded or advanced, so the caller's global RNG
stream is left untouched; ``seed=None`` draws a seed from torch's global RNG.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence

import torch
from torch import nn

from grpolab.models.grouped_attention import grouped_kv_attention
from grpolab.models.logprobs import backbone_and_head
from grpolab.models.routing import routers
from grpolab.models.weights import PolicyWeights
from grpolab.rollout.base import Completion, SamplingParams, collect_eos_ids
from grpolab.rollout.capabilities import HF_CAPABILITIES
from grpolab.rollout.hf.decode import decode
from grpolab.rollout.hf.engine_weights import ComputeCopy, CopyMode, engine_weights
from grpolab.rollout.hf.kv_cache import joins_rows, reserved_cache
from grpolab.rollout.hf.packed_linear import packed_linears
from grpolab.rollout.hf.prefill import prompt_layout, shared_prefill
from grpolab.rollout.hf.routing_capture import RoutingCapture

__all__ = ["HFEngine"]


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
    refill_fraction: waiting rows join the running batch once this share of ``max_batch_size`` is free (at
        least one place; see Refill above).

    An MoE model's completions carry the experts its routers chose for every token
    (``Completion.routed_experts``; ``grpolab.rollout.hf.routing_capture``). ``step_rows``: the live rows of
    each decoding forward of the last call (``grpolab.rollout.hf.decode.Decoded.step_rows``), e.g. to see that
    refill keeps the batch full.
    """

    capabilities = HF_CAPABILITIES

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
        refill_fraction: float = 0.125,
    ):
        if max_batch_size < 1:
            raise ValueError("max_batch_size must be >= 1")
        if not 0.0 <= refill_fraction <= 1.0:
            raise ValueError(f"refill_fraction must be in [0, 1], got {refill_fraction}")
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.compute_context = compute_context
        self.shared_prefill, self.synced, self.pack_weights = shared_prefill, synced, pack_weights
        self.compute_dtype, self.copy_mode = compute_dtype, copy_mode
        self.copy: ComputeCopy | None = engine_weights(model, compute_dtype, copy_mode)
        self.refill_at = max(1, math.ceil(refill_fraction * max_batch_size))
        self.step_rows: list[int] = []  # the live rows of each forward of the last call's decoding batches
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
                # one running batch refilled as rows end, or (synced, a cache that cannot join rows) batches in turn
                refill = not self.synced and joins_rows(reserved_cache(model.config, 1))
                span = max(len(flat), 1) if refill else self.max_batch_size
                seed = params.seed
                if seed is None and not params.greedy:  # one seed for the call, whatever its batches
                    seed = int(torch.empty((), dtype=torch.int64).random_())
                self.step_rows = []
                rows = [params.prompt_index(j // n) * n + j % n for j in range(len(flat))]  # global, for seeding
                for i in range(0, len(flat), span):
                    out.extend(self._generate_rows(model, flat[i : i + span], params, device, seed, rows[i : i + span]))
        finally:
            model.train(was_training)
        return [out[i * n : (i + 1) * n] for i in range(len(prompts))]

    def _generate_rows(
        self,
        model: nn.Module,
        prompts: list[list[int]],
        params: SamplingParams,
        device,
        seed: int | None,
        row_ids: list[int],
    ) -> list[Completion]:
        """Completions of ``prompts`` (one per row), the first ``max_batch_size`` decoded at once and the rest
        joining as rows end; ``row_ids``: each one's global index (seeding)."""
        capture = None
        if routers(model):
            capture = RoutingCapture(model, len(prompts), max(map(len, prompts)) + params.max_new_tokens, device)
        backbone = backbone_and_head(model)[0]

        def prefill(start: int, stop: int, always: bool):
            return shared_prefill(
                backbone,
                model.config,
                prompts[start:stop],
                self.pad_token_id,
                device,
                params.max_new_tokens,
                on_forward=None
                if capture is None
                else lambda members, places: capture.at([[start + r for r in m] for m in members], places),
                share=self.shared_prefill,
                always=always,
            )

        first = min(len(prompts), self.max_batch_size)
        with capture.attach() if capture is not None else contextlib.nullcontext():
            if self.shared_prefill:
                input_ids, attention_mask, cache = prefill(0, first, always=False)
            else:
                input_ids, attention_mask = (t.to(device) for t in prompt_layout(prompts[:first], self.pad_token_id))
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
                seed=seed,
                first_row=row_ids,
                waiting=_Waiting(prefill, first, len(prompts)) if len(prompts) > first else None,
                max_rows=self.max_batch_size,
                refill_at=self.refill_at,
            )
        self.step_rows += out.step_rows
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


class _Waiting:
    """The call's rows ``[next, stop)`` not yet decoding (``grpolab.rollout.hf.decode.Waiting``), prefilled as
    they join."""

    def __init__(self, prefill: Callable[[int, int, bool], tuple], start: int, stop: int):
        self.prefill, self.next, self.stop = prefill, start, stop

    def __len__(self) -> int:
        return self.stop - self.next

    def take(self, count: int):
        start, self.next = self.next, self.next + count
        return self.prefill(start, self.next, True)
