"""Data parallelism over ``torch.distributed``: who this process is, and the sums the ranks agree on.

Under ``torchrun`` every rank takes whole prompt groups (a group is never split, so advantages are
those of one process) and ``run_update(..., reduce=ranks.reduce)`` makes its optimizer steps those of
the global batch. One process (no process group) is the world of one: ``reduce`` is None.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist
from torch import Tensor

__all__ = ["Ranks", "all_reduce_sum"]


def all_reduce_sum(tensor: Tensor) -> Tensor:
    """Sum ``tensor`` over every rank, in place; returns it."""
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


@dataclass(frozen=True)
class Ranks:
    """This process's place among the data-parallel ranks."""

    rank: int = 0
    world: int = 1

    @classmethod
    def current(cls) -> "Ranks":
        if dist.is_available() and dist.is_initialized():
            return cls(dist.get_rank(), dist.get_world_size())
        return cls()

    @property
    def reduce(self) -> Callable[[Tensor], Tensor] | None:
        """``run_update``'s ``reduce``: None for one process."""
        return None if self.world == 1 else all_reduce_sum

    def groups(self, n_groups: int) -> range:
        """The whole groups of ``n_groups`` this rank takes: a contiguous block, equal on every rank."""
        if n_groups % self.world:
            raise ValueError(f"{n_groups} prompt groups cannot be split evenly over {self.world} ranks")
        share = n_groups // self.world
        return range(self.rank * share, (self.rank + 1) * share)
