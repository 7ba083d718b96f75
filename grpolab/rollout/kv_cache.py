"""A transformers KV cache that decoding appends to in place instead of re-concatenating.

transformers' ``DynamicLayer.update`` appends a step's keys and values with ``torch.cat``, which copies a
layer's whole cache at every decoding step. ``ReservedLayer`` keeps them in buffers with room for the
generation's last position and writes each step's columns in place; ``keys`` / ``values`` are views of
the filled part, so attention reads exactly what it reads from a ``DynamicLayer``. Row drops
(``batch_select_indices``) copy the filled part only. Sliding-window and other layer kinds stay as
``DynamicCache`` builds them.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

__all__ = ["ReservedLayer", "reserved_cache"]


class ReservedLayer(DynamicLayer):
    """``DynamicLayer`` over [B, H, capacity, D] buffers; ``keys``/``values`` are their first ``length``
    positions. A longer update than the room left reallocates (to exactly what it needs)."""

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity, self.length = capacity, 0

    def _grow(self, buffer: Tensor | None, new: Tensor, end: int) -> Tensor:
        if buffer is not None and end <= buffer.shape[-2]:
            return buffer
        grown = new.new_empty((*new.shape[:-2], max(end, self.capacity), new.shape[-1]))
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
        if self.length:
            for name in ("_keys", "_values"):
                old = getattr(self, name)
                buffer = old.new_empty((len(indices), *old.shape[1:]))
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
