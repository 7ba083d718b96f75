"""A transformers KV cache that decoding appends to in place instead of re-concatenating.

transformers' ``DynamicLayer.update`` appends a step's keys and values with ``torch.cat``, which copies a
layer's whole cache at every decoding step. ``ReservedLayer`` keeps them in buffers with room for the
generation's last position and writes each step's columns in place; ``keys`` / ``values`` are views of
the filled part, so attention reads exactly what it reads from a ``DynamicLayer``. Row drops
(``batch_select_indices``) in ``grpolab.rollout.hf.decode.compaction``'s order copy only the rows that move,
within the buffers; any other selection gathers the filled part anew. Sliding-window and other layer
kinds stay as ``DynamicCache`` builds them.

Under CPU autocast (bf16 compute on float32 masters) attention is one of the ops autocast runs in bf16: it casts
its float32 inputs to bf16 at every call. The keys come out of the rotary embedding in float32 (bf16 projection
times float32 cos/sin), so a float32 cache had its whole key buffer cast again at every decoding step, in every
layer (1.3 of 6.8 s of a profiled SmolLM2-135M generation, 8 prompts x 8, <= 64 tokens, one thread; 2026-12-07,
Intel Xeon with AMX). A ``ReservedLayer``
made under autocast stores its columns in the autocast dtype (``storage_dtype``): each column is rounded once, when
it is written, to exactly the value the per-step cast gave, so attention reads the same numbers and the tokens
and log-probs are bit for bit those of the float32 cache.

Refill (``join_rows``): rows that join a running decoding batch bring their prompts' cache; each layer's
buffers are laid out anew once per admission, the running rows' columns that are padding in every row
dropped at the left and the narrower side left-padded with zeros (the attention mask is 0 there; zeros,
not whatever memory held, so that a masked column's weight of 0 never meets a NaN). Only a cache of
``ReservedLayer``s joins rows (``joins_rows``).
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

__all__ = ["ReservedLayer", "join_rows", "joins_rows", "reserved_cache"]


def storage_dtype(states: Tensor) -> torch.dtype:
    """The dtype a cache keeps ``states`` in: autocast's lower-precision dtype for floating-point states under
    autocast on their device (where attention would cast them to it anyway), else their own."""
    device = states.device.type
    if states.is_floating_point() and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return states.dtype


class ReservedLayer(DynamicLayer):
    """``DynamicLayer`` over [B, H, capacity, D] buffers; ``keys``/``values`` are their first ``length``
    positions, in ``storage_dtype`` (module docstring). A longer update than the room left reallocates (to
    exactly what it needs)."""

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity, self.length = capacity, 0

    def _grow(self, buffer: Tensor | None, new: Tensor, end: int) -> Tensor:
        if buffer is not None and end <= buffer.shape[-2]:
            return buffer
        shape = (*new.shape[:-2], max(end, self.capacity), new.shape[-1])
        grown = new.new_empty(shape, dtype=storage_dtype(new))
        if buffer is not None:
            grown[..., : self.length, :] = buffer[..., : self.length, :]
        return grown

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self._keys = self._values = None
        end = self.length + key_states.shape[-2]
        self._keys, self._values = self._grow(self._keys, key_states, end), self._grow(self._values, value_states, end)
        self._keys[..., self.length : end, :] = key_states
        self._values[..., self.length : end, :] = value_states
        self.length = end
        self.keys, self.values = self._keys[..., :end, :], self._values[..., :end, :]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def batch_select_indices(self, indices: Tensor) -> None:
        """Keep rows ``indices`` (in that order). Where every row that moves comes from past the kept count
        (``decode``'s compaction: the live rows past it fill the ended rows' places), the moved rows are
        copied within the buffers and the rest stay; otherwise the filled part is gathered anew."""
        if not self.length:
            return
        kept = indices.tolist()
        moves = [(to, source) for to, source in enumerate(kept) if to != source]
        in_place = all(source >= len(kept) for _, source in moves)
        for name in ("_keys", "_values"):
            old = getattr(self, name)
            if in_place:
                if moves:
                    to, source = (torch.tensor(side, device=old.device) for side in zip(*moves))
                    old[to, :, : self.length] = old[source, :, : self.length]
                buffer = old[: len(kept)]
            else:
                buffer = old.new_empty((len(kept), *old.shape[1:]))
                buffer[..., : self.length, :] = old[indices, :, : self.length]
            setattr(self, name, buffer)
        self.keys, self.values = self._keys[..., : self.length, :], self._values[..., : self.length, :]

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("ReservedLayer is for decoding forward only")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("ReservedLayer is for decoding forward only")

    def reset(self) -> None:
        self.length, self._keys, self._values = 0, None, None
        super().reset()


def reserved_cache(config, capacity: int) -> DynamicCache:
    """transformers' ``DynamicCache`` for ``config`` with each full-attention layer a ``ReservedLayer`` with
    room for ``capacity`` positions."""
    cache = DynamicCache(config=config)
    cache.layers = [ReservedLayer(capacity) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


def joins_rows(cache: DynamicCache) -> bool:
    """Whether ``join_rows`` can add rows to ``cache``: every layer a ``ReservedLayer``."""
    return all(isinstance(layer, ReservedLayer) for layer in cache.layers)


def join_rows(cache: DynamicCache, joining: DynamicCache | None, count: int, trim: int, room: int) -> int:
    """Append ``count`` rows, ``joining``'s, to ``cache``'s, in place; returns the joined width W.

    cache: [A, H, w, D] a layer, its first ``trim`` columns padding in every row (dropped); joining: [count, H, w',
    D] a layer, or None (rows with nothing cached yet, w' = 0). Both sides end at the last column: W = max(w - trim,
    w'), each side's missing columns zeros at its left. Each layer keeps room for ``room`` more columns."""
    joined = 0
    for at, layer in enumerate(cache.layers):
        other = joining.layers[at] if joining is not None and joining.layers[at].is_initialized else None
        assert isinstance(layer, ReservedLayer) and layer.is_initialized, "join_rows needs a running ReservedLayer"
        width = max(layer.length - trim, other.get_seq_length() if other is not None else 0)
        for name, side in (("_keys", "keys"), ("_values", "values")):
            mine = getattr(layer, side)[..., trim:, :]
            theirs = getattr(other, side) if other is not None else None
            buffer = mine.new_zeros((mine.shape[0] + count, *mine.shape[1:-2], width + room, mine.shape[-1]))
            buffer[: mine.shape[0], ..., width - mine.shape[-2] : width, :] = mine
            if theirs is not None:
                buffer[mine.shape[0] :, ..., width - theirs.shape[-2] : width, :] = theirs
            setattr(layer, name, buffer)
        layer.length, layer.capacity = width, width + room
        layer.keys, layer.values = layer._keys[..., :width, :], layer._values[..., :width, :]
        joined = width
    return joined
