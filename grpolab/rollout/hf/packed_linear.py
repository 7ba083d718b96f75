"""Linear layers on prepacked weights for the length of a generation call, on a CPU.

A decoding step multiplies a few rows by every weight matrix of the model. ``F.linear`` on a CPU hands
the weight to a BLAS that re-lays it out (packs it) on every call, and at a few rows that packing and
its memory traffic cost as much as the arithmetic: on SmolLM2-135M's 49k x 576 output layer, 8 rows
run at ~9 GFLOP/s through ``F.linear`` and ~22 through oneDNN's matmul on a weight laid out once
beforehand (``torch.ops.mkldnn._reorder_linear_weight``, the op ``torch.compile``'s CPU weight-packing
pass uses). ``packed_linears`` lays out each large float32 ``nn.Linear`` weight once when generation
starts, routes those layers' forwards through ``torch.ops.mkldnn._linear_pointwise`` until it ends, and then
restores the modules as they were. The training forward never sees it.

The product is the same matmul in another summation order: log-probs move by float32 rounding
(~1e-6), as they do when the decode batch shrinks.

Only layers of at least ``MIN_PACKED_ELEMENTS`` weights are packed: oneDNN's call costs tens of
microseconds more than ``F.linear``'s, which small layers never win back (measured on one thread, packed
against ``F.linear`` at 4-256 rows: 0.2-0.8x for 64 x 64 to 300 x 64, 0.6-1.0x at 256 x 256, 1.0-1.1x at
1024 x 256, 1.0-1.3x at SmolLM2's 576 x 576 and 1536 x 576, 1.2-2.9x at its 49152 x 576 output layer).

Used only where it applies: CPU float32 weights that are plain tensors (not FSDP's DTensors), no autocast
(the trainer's bf16 compute context decides the matmul's precision there), and oneDNN available.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor, nn

__all__ = ["MIN_PACKED_ELEMENTS", "packed_linears", "packing_applies"]

MIN_PACKED_ELEMENTS = 2**18  # the smallest weight (out x in) packed: see the module docstring


def _large_linears(model: nn.Module) -> list[nn.Linear]:
    return [m for m in model.modules() if type(m) is nn.Linear and m.weight.numel() >= MIN_PACKED_ELEMENTS]


def packing_applies(model: nn.Module) -> bool:
    """Whether ``packed_linears`` would pack some of ``model``'s linear layers (see the module docstring)."""
    if (
        not torch.backends.mkldnn.is_available()
        or torch.is_autocast_enabled("cpu")
        or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    ):
        return False
    weights = [m.weight for m in model.modules() if type(m) is nn.Linear]
    return bool(_large_linears(model)) and all(
        type(w) in (Tensor, nn.Parameter) and w.device.type == "cpu" and w.dtype == torch.float32 for w in weights
    )


def _packed_forward(packed: Tensor, bias: Tensor | None):
    def forward(x: Tensor) -> Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")

    return forward


@contextlib.contextmanager
def packed_linears(model: nn.Module, rows: int) -> Iterator[bool]:
    """Within it, ``model``'s large ``nn.Linear`` layers multiply by weights laid out once for ~``rows`` rows.

    Yields whether it packed (False, and nothing changed, where ``packing_applies`` is False). Weights must
    not change inside it (generation runs under ``torch.no_grad``).
    """
    if not packing_applies(model):
        yield False
        return
    layers = _large_linears(model)
    packed_by_weight: dict[int, Tensor] = {}  # a weight two layers share is packed once
    try:
        with torch.no_grad():
            for layer in layers:
                w = layer.weight
                if id(w) not in packed_by_weight:
                    packed_by_weight[id(w)] = torch.ops.mkldnn._reorder_linear_weight(w.detach(), rows)
                layer.forward = _packed_forward(packed_by_weight[id(w)], layer.bias)
        yield True
    finally:
        for layer in layers:
            layer.__dict__.pop("forward", None)
