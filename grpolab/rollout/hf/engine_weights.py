"""The weights the hf engine generates with: the training model itself, or its own copy in the compute dtype.

With float32 master weights and bf16 compute (``optim.precision fp32_master``) the trainer runs every forward
under bf16 autocast. Generating on the training model under that autocast puts a cast in front of every matmul
of every decoding step and keeps the weights float32, so ``grpolab.rollout.hf.packed_linear`` cannot lay them
out beforehand. ``engine_weights`` instead gives the engine a copy of the model whose parameters are in the
compute dtype, made once and refreshed by each weight sync (``ComputeCopy.refresh``: one ``copy_`` with the cast
per parameter, under ``torch.no_grad``); generation runs on that copy with no autocast, as a model loaded in
bf16 runs. Its matmuls take the same bf16 weights as the trainer's autocast gives its matmuls, but its residual
stream and norms are bf16 where autocast keeps them float32, so engine and trainer log-probs differ by more than
they do when both run under autocast (``grpolab.rollout.sync_check``'s bf16 limits are measured on this pair).

Buffers are copied as they are: a transformers model loaded in bf16 keeps its rotary frequencies float32 (they
are computed, not loaded), and so does the copy, as the trainer does.

Where the weights are already in the compute dtype (float32 runs, bf16 storage, a model loaded in the compute
dtype) the engine generates on the training model itself: no copy. It also does where a copy cannot stand in
for the training model, and generation keeps the trainer's autocast there (``copy_refusal``): FSDP's DTensor
shards (the forward is a collective over the shards), a LoRA policy (its base is already in the compute dtype;
only the float32 adapter would be cast, and peft's layers are the training model's own), weights of mixed
dtypes.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

import torch
from torch import Tensor, nn

__all__ = ["ComputeCopy", "copy_refusal", "engine_weights"]


def _floating_parameters(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    return ((name, p) for name, p in model.named_parameters() if p.is_floating_point())


def copy_refusal(model: nn.Module, compute: torch.dtype) -> str | None:
    """Why the engine does not generate on a ``compute``-dtype copy of ``model`` (None: it does)."""
    dtypes = {p.dtype for _, p in _floating_parameters(model)}
    if not dtypes or dtypes == {compute}:
        return "its weights are already in the compute dtype"
    if len(dtypes) > 1:
        return f"its weights have mixed dtypes ({', '.join(sorted(str(d) for d in dtypes))})"
    if any(type(p) not in (Tensor, nn.Parameter) for p in model.parameters()):
        return "its weights are sharded (FSDP)"
    if any(type(m).__module__.startswith("peft.") for m in model.modules()):
        return "it carries a LoRA adapter"
    return None


class ComputeCopy:
    """An eval-mode copy of ``source`` whose floating-point parameters are in ``dtype`` (tied weights stay tied;
    buffers copied as they are), built without a float32 duplicate. ``model``: the copy; ``refresh``: take the
    source's current weights."""

    def __init__(self, source: nn.Module, dtype: torch.dtype):
        self.source, self.dtype = source, dtype
        with torch.no_grad():
            memo = {
                id(p): nn.Parameter(p.detach().to(dtype, copy=True), requires_grad=False)
                for _, p in _floating_parameters(source)
            }  # deepcopy meets each parameter in the memo first: only the cast copy is ever made
            self.model = copy.deepcopy(source, memo)
        self.model.eval()
        self.refreshes = 0

    def pairs(self) -> Iterator[tuple[Tensor, Tensor]]:
        """(copy's tensor, source's tensor) for every parameter and buffer, tied ones once."""
        theirs = dict(self.source.named_parameters())
        for name, mine in self.model.named_parameters():
            yield mine, theirs[name]
        theirs = dict(self.source.named_buffers())
        for name, mine in self.model.named_buffers():
            if name in theirs:
                yield mine, theirs[name]

    @torch.no_grad()
    def refresh(self) -> None:
        """Copy the source's weights into the copy, cast to its dtype (once per weight sync)."""
        for mine, theirs in self.pairs():
            mine.copy_(theirs.detach())
        self.refreshes += 1


def engine_weights(model: nn.Module, compute: torch.dtype | None) -> ComputeCopy | None:
    """A ``ComputeCopy`` of ``model`` for the engine to generate on, or None where it generates on ``model``
    itself (``compute`` None, or ``copy_refusal``)."""
    if compute is None or copy_refusal(model, compute) is not None:
        return None
    return ComputeCopy(model, compute)
