"""The weights the hf engine generates with: the training model itself, or its own copy in the compute dtype.

With float32 master weights and bf16 compute (``optim.precision fp32_master``) the trainer runs every forward
under bf16 autocast. Generating on the training model under that autocast casts each float32 weight to bf16
once per generation call (autocast caches the cast of a leaf weight that requires grad until its context ends),
and keeps the weights float32, so ``grpolab.rollout.hf.packed_linear`` cannot lay them out beforehand. ``engine_weights`` instead gives the engine a copy of the model with its weights cast once, refreshed
by each weight sync (``ComputeCopy.refresh``: one ``copy_`` with the cast per tensor, under ``torch.no_grad``;
never per decoding step). Two kinds of copy (``CopyMode``):

``matmul`` (the default) casts exactly the weights the trainer's autocast casts, those of the ``nn.Linear``
    layers (the projections and the output layer; a tied output layer gets its own bf16 copy, the embedding
    stays float32), keeps the rest (embeddings, norms, buffers) as the trainer holds it, and generates under
    the trainer's autocast. Every operation then sees the values the trainer's forward sees: engine and
    trainer log-probs agree as closely as when the engine generated on the training model itself (KV-cached
    decoding against one forward), and the sync check's limits stand. The bf16 linear weights are packed.
``all`` casts every floating-point parameter (a model loaded in bf16; buffers stay as they are, as
    transformers keeps its rotary frequencies float32) and generates without autocast: the residual stream and
    norms run in bf16 where the trainer's autocast keeps them float32. The mean |engine - trainer| log-prob
    went from 8.2e-4 (``matmul``) to 8.0e-3 on the tests' tiny model and from 3.1e-2 to 4.1e-2 on
    SmolLM2-135M (16 samples of <= 24-30 tokens; 2026-12-06 at fbc0a64, AMD EPYC with avx512_bf16, under load);
    kept for speed comparisons (``benchmarks/precision_step.py``).

Where the weights are already in the compute dtype (float32 runs, bf16 storage, a model loaded in the compute
dtype) the engine generates on the training model itself: no copy. It also does where a copy cannot stand in
for the training model or would not pay, and generation keeps the trainer's autocast there (``copy_refusal``):
weights on a GPU (no packing there, and autocast's cache already casts each weight once per call: a copy would
only cost memory), FSDP's DTensor shards (the forward is a collective over the shards), a LoRA policy (its base is already in the compute dtype;
peft's layers are the training model's own), weights of mixed dtypes.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Literal

import torch
from torch import Tensor, nn

__all__ = ["COPY_MODES", "ComputeCopy", "CopyMode", "copy_refusal", "engine_weights"]

CopyMode = Literal["matmul", "all"]
COPY_MODES: tuple[CopyMode, ...] = ("matmul", "all")


def copy_refusal(model: nn.Module, compute: torch.dtype) -> str | None:
    """Why the engine does not generate on a ``compute``-dtype copy of ``model`` (None: it does)."""
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if not dtypes or dtypes == {compute}:
        return "its weights are already in the compute dtype"
    if len(dtypes) > 1:
        return f"its weights have mixed dtypes ({', '.join(sorted(str(d) for d in dtypes))})"
    if any(p.device.type != "cpu" for p in model.parameters()):
        return "its weights are not on the CPU (nothing there packs bf16 weights, and a copy only costs memory)"
    if any(type(p) not in (Tensor, nn.Parameter) for p in model.parameters()):
        return "its weights are sharded (FSDP)"
    if any(type(m).__module__.startswith("peft.") for m in model.modules()):
        return "it carries a LoRA adapter"
    return None


class ComputeCopy:
    """An eval-mode copy of ``source`` with its weights cast to ``dtype`` as ``mode`` says (module docstring),
    made without a float32 duplicate of what it casts. ``model``: the copy; ``refresh``: take the source's current
    weights; ``autocast``: whether generation on it runs under the trainer's autocast (``matmul``)."""

    def __init__(self, source: nn.Module, dtype: torch.dtype, mode: CopyMode = "matmul"):
        if mode not in COPY_MODES:
            raise ValueError(f"unknown copy mode {mode!r}; one of {', '.join(COPY_MODES)}")
        self.source, self.dtype, self.mode = source, dtype, mode
        self.autocast = mode == "matmul"
        # deepcopy finds every parameter in the memo (as None) and copies the rest (buffers, config, modules);
        # each module's parameters are then set below, so a cast weight is never first copied in float32
        memo: dict[int, object] = {id(p): None for p in source.parameters()}
        with torch.no_grad():
            self.model = copy.deepcopy(source, memo)
            made: dict[tuple[int, torch.dtype], nn.Parameter] = {}  # shared weights stay shared per dtype
            self._slots: list[tuple[nn.Module, str, nn.Module, str]] = []
            for (_, theirs), (_, mine) in zip(
                source.named_modules(remove_duplicate=False), self.model.named_modules(remove_duplicate=False)
            ):
                for name, p in theirs._parameters.items():
                    if p is None:
                        continue
                    target = self._dtype_of(theirs, p)
                    key = (id(p), target)
                    if key not in made:
                        made[key] = nn.Parameter(p.detach().to(target, copy=True), requires_grad=False)
                    mine._parameters[name] = made[key]
                    self._slots.append((mine, name, theirs, name))
        self.model.eval()
        self.refreshes = 0

    def _dtype_of(self, module: nn.Module, p: Tensor) -> torch.dtype:
        if not p.is_floating_point():
            return p.dtype
        return self.dtype if self.mode == "all" or isinstance(module, nn.Linear) else p.dtype

    def pairs(self) -> Iterator[tuple[Tensor, Tensor]]:
        """(copy's tensor, source's tensor) for every parameter and buffer, each copy tensor once."""
        seen: set[int] = set()
        for mine, name, theirs, their_name in self._slots:
            dst = mine._parameters[name]
            if id(dst) not in seen:
                seen.add(id(dst))
                yield dst, theirs._parameters[their_name]
        theirs = dict(self.source.named_buffers())
        for name, dst in self.model.named_buffers():
            if name in theirs:
                yield dst, theirs[name]

    @torch.no_grad()
    def refresh(self) -> None:
        """Copy the source's weights into the copy, cast to its dtypes (once per weight sync)."""
        for mine, theirs in self.pairs():
            mine.copy_(theirs.detach())
        self.refreshes += 1


def engine_weights(model: nn.Module, compute: torch.dtype | None, mode: CopyMode = "matmul") -> ComputeCopy | None:
    """A ``ComputeCopy`` of ``model`` for the engine to generate on, or None where it generates on ``model``
    itself (``compute`` None, or ``copy_refusal``)."""
    if compute is None or copy_refusal(model, compute) is not None:
        return None
    return ComputeCopy(model, compute, mode)
