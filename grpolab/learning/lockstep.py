"""The data-parallel ranks in lockstep around the learner: what they agree on before, during and after one
update, the learner's only way to the ranks' collectives.

Every rank holds the global rollout batch and trains on its own block of whole prompt groups (``RankPart``);
the sync check reads the global batch, the update runs as this rank's share (``DataParallelShare``: DDP's local
accumulation, FSDP's padded forwards, the global step's denominators and skip decision), and the metrics are
summed over the ranks. With one process every agreement is this process's own value and nothing waits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

from torch import Tensor, nn

from grpolab.learning.update import DataParallelShare, PolicyLogprobs
from grpolab.parallel.ranks import Ranks, no_sync

__all__ = ["RankPart", "UpdateLockstep"]

Groups = TypeVar("Groups", list, Tensor)


@dataclass(frozen=True)
class RankPart:
    """This rank's part of a rollout batch of ``n_groups`` prompt groups of ``group_size`` completions: its whole
    groups ``groups`` (a contiguous block, equal on every rank)."""

    groups: range
    group_size: int
    n_groups: int

    @property
    def rows(self) -> range:
        """Its rows of the global batch, flattened group by group."""
        return range(self.groups.start * self.group_size, self.groups.stop * self.group_size)

    @property
    def n_rows(self) -> int:
        """The rows of the global batch."""
        return self.n_groups * self.group_size

    def of(self, per_group: Groups) -> Groups:
        """Its items of a per-group list or tensor (the rollout's completions, the advantages [B, G])."""
        return per_group[self.groups.start : self.groups.stop]


class UpdateLockstep:
    """The cross-rank agreements of a learner over ``ranks`` whose training forward is ``train_forward`` (DDP-wrapped
    or not); ``sharded``: FSDP shards the model, so every forward is a collective and the ranks run as many."""

    def __init__(self, ranks: Ranks, train_forward: nn.Module, sharded: bool):
        self.ranks, self.train_forward, self.sharded = ranks, train_forward, sharded

    def part(self, n_groups: int, group_size: int) -> RankPart:
        """This rank's groups of a rollout batch (raises ValueError when they cannot be split evenly)."""
        return RankPart(self.ranks.groups(n_groups), group_size, n_groups)

    @property
    def forwards(self) -> Ranks | None:
        """The ranks every forward is a collective over (FSDP: each rank runs the busiest rank's count), or None."""
        return self.ranks if self.sharded else None

    def global_rows(self, *tensors: Tensor) -> list[Tensor]:
        """Each of the ranks' [n_r, T_r] ``tensors`` stacked over the ranks in rank order (``Ranks.stack_rows``)."""
        return [self.ranks.stack_rows(t) for t in tensors]

    def share(self, part: RankPart, filler_logprobs: PolicyLogprobs | None = None) -> DataParallelShare | None:
        """This rank's share of the update over ``part`` (None with one process); ``filler_logprobs``: the forward
        of a row that only joins the busiest rank's collectives (None: the training forward)."""
        if not self.ranks.parallel:
            return None
        return DataParallelShare(
            self.ranks,
            part.rows,
            part.n_rows,
            lambda: no_sync(self.train_forward),
            lockstep=self.sharded,
            filler_logprobs=filler_logprobs,
        )

    def total(self, tensor: Tensor) -> Tensor:
        """``tensor`` summed over the ranks, in place (returned)."""
        return self.ranks.sum_(tensor)

    def sum_counts(self, counts: dict[str, int]) -> dict[str, int]:
        """``counts`` added up key by key over the ranks."""
        return self.ranks.sum_counts(counts)
