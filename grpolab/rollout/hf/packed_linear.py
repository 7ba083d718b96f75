"""Linear layers on prepacked weights for the length of a generation call, on a CPU.

A decoding step multiplies a few rows by every weight matrix of the model. ``F.linear`` on a CPU hands
the weight to a BLAS that re-lays it out (packs it) on every call, and at a few rows that packing and
its memory traffic cost as much as the arithmetic: on SmolLM2-135M's 49k x 576 output layer, 8 rows
run at ~9 GFLOP/s through ``F.linear`` and ~22 through oneDNN's matmul on a weight laid out once
beforehand (``torch.ops.mkldnn._reorder_linear_weight``, the op ``torch.compile``'s CPU weight-packing
pass uses). ``packed_linears`` lays out each large float32 (or bf16, below) ``nn.Linear`` weight once when
generation starts, routes those layers' forwards through ``torch.ops.mkldnn._linear_pointwise`` until it ends, and then
restores the modules as they were. The training forward never sees it.

The product is the same matmul in another summation order: log-probs move by float32 rounding
(~1e-6), as they do when the decode batch shrinks. In bf16 the packed product equalled ``F.linear``'s bit
for bit at every shape measured below (both are oneDNN's bf16 matmul).

Only layers of at least ``MIN_PACKED_ELEMENTS`` weights are packed: oneDNN's call costs tens of
microseconds more than ``F.linear``'s, which small layers never win back (measured on one thread, packed
against ``F.linear`` at 4-256 rows: 0.2-0.8x for 64 x 64 to 300 x 64, 0.6-1.0x at 256 x 256, 1.0-1.1x at
1024 x 256, 1.0-1.3x at SmolLM2's 576 x 576 and 1536 x 576, 1.2-2.9x at its 49152 x 576 output layer).

bf16 weights (the hf engine's own bf16 copy, ``grpolab.rollout.hf.engine_weights``, or a model stored in
bf16) are packed for oneDNN's bf16 path where the CPU runs it natively
(``bf16_packing_supported``: AVX512-BF16 or AMX-BF16, and oneDNN's bf16 path), from ``MIN_PACKED_ELEMENTS_BF16``
weights up (lower than float32's: packed bf16 wins down to 256 x 256), and at every SmolLM2-135M shape. Measured on one thread, packed against bf16 ``F.linear`` at 8 / 16 / 32 / 64 rows
(AMD EPYC with avx512_bf16, torch 2.13, measured under load from other processes, best of 3; 2026-12-06 at
9c9a4f4):

    out x in      8 rows   16 rows  32 rows  64 rows
    64 x 64       1.27x    1.12x    1.04x    1.14x
    128 x 128     0.98x    0.87x    1.06x    1.14x
    256 x 256     1.36x    1.21x    1.19x    1.10x
    192 x 576     1.10x    1.41x    1.11x    1.20x   (SmolLM2's k / v projections)
    576 x 576     1.47x    1.23x    1.07x    1.08x   (q / o)
    1536 x 576    1.50x    1.29x    1.15x    1.03x   (gate / up)
    576 x 1536    1.49x    1.28x    1.22x    1.09x   (down)
    49152 x 576   1.99x    1.70x    1.37x    1.21x   (output layer)

Used only where it applies: CPU weights, all float32 or all bf16 (with native bf16), that are plain tensors
(not FSDP's DTensors), and oneDNN available. Under autocast only bf16 weights under bf16 autocast (the hf
engine's copy of float32 masters, whose linear weights are bf16): the packed layer casts its input (and bias)
to bf16 and returns bf16, as autocast's ``linear`` does; float32 weights under autocast are not packed (the
trainer's bf16 compute context decides the matmul's precision there).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor, nn

from grpolab.common.provenance import native_bf16

__all__ = [
    "MIN_PACKED_ELEMENTS",
    "MIN_PACKED_ELEMENTS_BF16",
    "bf16_packing_supported",
    "packed_linears",
    "packing_applies",
]

MIN_PACKED_ELEMENTS = 2**18  # the smallest float32 weight (out x in) packed: see the module docstring
MIN_PACKED_ELEMENTS_BF16 = 2**16  # the smallest bf16 weight packed (128 x 128 breaks even, 256 x 256 wins)


def bf16_packing_supported() -> bool:
    """Whether oneDNN runs bf16 matmuls natively on this CPU (AVX512-BF16 or AMX; ``native_bf16``: torch's own
    check alone also passes on AVX-512 without bf16, where oneDNN emulates it)."""
    return native_bf16()


def _min_elements(dtype: torch.dtype) -> int:
    return MIN_PACKED_ELEMENTS_BF16 if dtype == torch.bfloat16 else MIN_PACKED_ELEMENTS


def _large_linears(model: nn.Module) -> list[nn.Linear]:
    return [m for m in model.modules() if type(m) is nn.Linear and m.weight.numel() >= _min_elements(m.weight.dtype)]


def packing_applies(model: nn.Module) -> bool:
    """Whether ``packed_linears`` would pack some of ``model``'s linear layers (see the module docstring)."""
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return False
    weights = [m.weight for m in model.modules() if type(m) is nn.Linear]
    dtypes = {w.dtype for w in weights}
    if torch.is_autocast_enabled("cpu"):
        if dtypes != {torch.bfloat16} or torch.get_autocast_dtype("cpu") != torch.bfloat16:
            return False  # autocast decides the matmul's precision
    if dtypes != {torch.float32} and not (dtypes == {torch.bfloat16} and bf16_packing_supported()):
        return False
    return bool(_large_linears(model)) and all(
        type(w) in (Tensor, nn.Parameter) and w.device.type == "cpu" for w in weights
    )


def _packed_forward(packed: Tensor, bias: Tensor | None, dtype: torch.dtype):
    """``dtype``: the weight's; the input (float32 under autocast) and bias are cast to it, as autocast does."""
    bias = None if bias is None else bias.to(dtype)

    def forward(x: Tensor) -> Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.to(dtype).contiguous(), packed, bias, "none", [], "")

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
                layer.forward = _packed_forward(packed_by_weight[id(w)], layer.bias, w.dtype)
        yield True
    finally:
        for layer in layers:
            layer.__dict__.pop("forward", None)
