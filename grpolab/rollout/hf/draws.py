"""The uniform draws the hf engine samples with, counter-based: one per (seed, row, token index).

A row's ``t``-th token is sampled with ``uniform(seed, row, t)``, a float64 in [0, 1) computed from those three
integers alone (SplitMix64's finalizer, a bijective mixer of 64-bit words, applied to the seed, then to the
row, then to the token index, chained; the top 53 bits as the fraction). ``row`` is the row's global index in
the caller's list (``SamplingParams.prompt_offset * n`` plus its place in the call), so a completion is the same
whatever the batch it was decoded in, the order rows joined the batch, or the rank that sampled it. There is no
generator state: no RNG is seeded, forked or advanced.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

__all__ = ["uniforms"]

_MASK = 2**64 - 1
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _mix(x: np.ndarray) -> np.ndarray:
    """SplitMix64's step on uint64 words [N] (wrapping arithmetic)."""
    x = x + _GOLDEN
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


def uniforms(
    seed: int, rows: Tensor | list[int], steps: Tensor | list[int], device: torch.device | None = None
) -> Tensor:
    """[N] float64 draws in [0, 1): ``uniform(seed, rows[i], steps[i])`` for each i.

    seed: any integer (taken modulo 2**64); rows, steps: [N] non-negative integers (global row index, token
    index within the row's completion)."""
    rows = np.asarray(rows.tolist() if isinstance(rows, Tensor) else rows, dtype=np.uint64)
    steps = np.asarray(steps.tolist() if isinstance(steps, Tensor) else steps, dtype=np.uint64)
    with np.errstate(over="ignore"):
        key = _mix(np.full(rows.shape, seed & _MASK, dtype=np.uint64))
        word = _mix(_mix(key ^ rows) ^ steps)
    fraction = (word >> np.uint64(11)).astype(np.float64) * 2.0**-53
    return torch.from_numpy(fraction).to(device) if device is not None else torch.from_numpy(fraction)
