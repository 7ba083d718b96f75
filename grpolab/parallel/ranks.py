"""Data parallelism over ``torch.distributed``: who this process is, what the ranks agree on, DDP.

Under ``torchrun`` every rank takes whole prompt groups (a group is never split, so advantages are
those of one process); the update divides by the global step's denominators and sums the gradients over
the ranks (DDP's all-reduce, or FSDP2's reduce-scatter (``grpolab.parallel.fsdp``), with a sum in place of
their mean), so an N-rank optimizer step is the one one process would make on the global batch. One
process (no process group) is the world of one, and every collective here is then a no-op.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import inspect
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor, nn

__all__ = ["Ranks", "end_process_group", "init_from_env", "no_sync", "split_evenly", "wrap_ddp"]

T = TypeVar("T")


def init_from_env(device: torch.device, timeout_minutes: int = 30) -> tuple[Ranks, torch.device]:
    """Join the process group ``torchrun`` describes (WORLD_SIZE > 1 in the environment): gloo on CPU,
    NCCL on CUDA, each rank on its LOCAL_RANK device. Returns (ranks, this rank's device). Without
    torchrun: one process, nothing started. A rank that dies leaves the others in a collective: torchrun
    ends them at once, and ``timeout_minutes`` bounds every collective in any case."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(device)
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo", timeout=datetime.timedelta(minutes=timeout_minutes)
        )
    return Ranks.current(), device


def end_process_group() -> None:
    """Leave the process group, if any (after DDP's reducer is gone: its thread aborts the process when
    the group goes first)."""
    if dist.is_available() and dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


def split_evenly(n: int, world: int, rank: int) -> range:
    """Rank ``rank``'s contiguous block of ``range(n)`` when it is cut into ``world`` blocks whose sizes
    differ by at most one (the first ``n % world`` blocks are one longer)."""
    share, extra = divmod(n, world)
    start = rank * share + min(rank, extra)
    return range(start, start + share + (rank < extra))


def _sum_allreduce_hook(state, bucket):  # no annotations: DDP checks them, and they are strings here
    """DDP's all-reduce of a ``dist.GradBucket`` without its division by the world size: the loss already
    divides by the global step's denominators, so the ranks' gradients add up to the global batch's."""
    return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda fut: fut.value()[0])


def no_forward_buffer_sync() -> dict[str, bool]:
    """DDP's keyword that turns off the buffer broadcast at every forward: ``forward_sync_buffers`` from
    torch 2.13; before it ``broadcast_buffers``, which also skips the broadcast at construction (the
    buffers of a transformers model, rotary frequencies and the like, are built alike on every rank)."""
    if "forward_sync_buffers" in inspect.signature(nn.parallel.DistributedDataParallel).parameters:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}


def wrap_ddp(module: nn.Module, device: torch.device) -> nn.Module:
    """``module`` in ``DistributedDataParallel`` with summed gradients. Its weights are broadcast from
    rank 0 here with its buffers; buffers are not re-synchronised at each forward (they never change, and
    a forward must not be a collective: ranks run different numbers of forwards)."""
    ddp = nn.parallel.DistributedDataParallel(
        module, device_ids=[device] if device.type == "cuda" else None, **no_forward_buffer_sync()
    )
    ddp.register_comm_hook(None, _sum_allreduce_hook)
    return ddp


@dataclass(frozen=True)
class Ranks:
    """This process's place among the data-parallel ranks, and the collectives the trainer needs. Every
    method must be called by every rank, in the same order."""

    rank: int = 0
    world: int = 1
    device: str = "cpu"  # where the backend's tensors must be: NCCL reduces CUDA tensors only

    @classmethod
    def current(cls) -> Ranks:
        if dist.is_available() and dist.is_initialized():
            nccl = dist.get_backend() == "nccl"
            return cls(dist.get_rank(), dist.get_world_size(), f"cuda:{torch.cuda.current_device()}" if nccl else "cpu")
        return cls()

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that writes files and prints."""
        return self.rank == 0

    @property
    def parallel(self) -> bool:
        return self.world > 1

    def groups(self, n_groups: int) -> range:
        """The whole groups of ``n_groups`` this rank trains on: a contiguous block, equal on every rank."""
        if n_groups % self.world:
            raise ValueError(f"{n_groups} prompt groups cannot be split evenly over {self.world} ranks")
        return self.share(n_groups)

    def share(self, n: int) -> range:
        """This rank's contiguous block of ``n`` items (sizes differ by at most one between ranks)."""
        return split_evenly(n, self.world, self.rank)

    def share_chunks(self, n: int, chunk: int) -> range:
        """This rank's contiguous block of ``n`` items cut into whole ``chunk``-item chunks (the numbers of
        chunks differ by at most one between ranks): an engine that batches ``chunk`` items then batches
        each rank's items exactly as one process batches them all."""
        chunks = self.share(-(-n // chunk))
        return range(min(chunks.start * chunk, n), min(chunks.stop * chunk, n))

    def sum_(self, tensor: Tensor) -> Tensor:
        """Sum ``tensor`` over every rank, in place; returns it."""
        if self.parallel:
            on_backend = tensor.to(self.device)
            dist.all_reduce(on_backend, op=dist.ReduceOp.SUM)
            tensor.copy_(on_backend)
        return tensor

    def max(self, value: int) -> int:
        """The largest ``value`` over the ranks, on every rank."""
        return max(self.gather(value)) if self.parallel else value

    def any(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is True on any."""
        return bool(self.sum_(torch.tensor([float(flag)])) > 0) if self.parallel else flag

    def gather(self, obj: T) -> list[T]:
        """Every rank's ``obj``, in rank order, on every rank (pickled: small Python objects only)."""
        if not self.parallel:
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def concat(self, items: list[T]) -> list[T]:
        """The ranks' lists, concatenated in rank order, on every rank."""
        return [x for part in self.gather(items) for x in part]

    def stack_rows(self, tensor: Tensor) -> Tensor:
        """Every rank's [n_r, T_r] ``tensor``, right-padded with zeros to the widest and stacked in rank
        order: [sum n_r, max T_r] (on CPU when there are several ranks)."""
        if not self.parallel:
            return tensor
        parts = self.gather(tensor.cpu())
        width = max(p.shape[1] for p in parts)
        return torch.cat([nn.functional.pad(p, (0, width - p.shape[1])) for p in parts])

    def sum_counts(self, counts: dict[str, int]) -> dict[str, int]:
        """``counts`` added up key by key over the ranks (the same keys on every rank)."""
        if not self.parallel:
            return counts
        parts = self.gather(counts)
        return {k: sum(p[k] for p in parts) for k in counts}

    def from_main(self, obj: T) -> T:
        """Rank 0's ``obj`` on every rank."""
        if not self.parallel:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def run_on_main(self, fn: Callable[[], T]) -> T:
        """``fn()`` on rank 0 only, its result (or its exception, raised on every rank) everywhere: a
        failure there ends every rank with the same error instead of leaving them in a collective."""
        result: tuple[T | None, BaseException | None] = (None, None)
        if self.is_main:
            try:
                result = (fn(), None)
            except Exception as err:  # re-raised below, on every rank
                result = (None, err)
        value, error = self.from_main(result)
        if error is not None:
            raise error
        return value  # type: ignore[return-value]


def no_sync(module: nn.Module) -> contextlib.AbstractContextManager:
    """DDP's ``no_sync`` (backward passes accumulate locally), or nothing for another module. (FSDP2
    reduce-scatters at every backward: accumulating unsharded gradients would hold the whole model's.)"""
    return module.no_sync() if isinstance(module, nn.parallel.DistributedDataParallel) else contextlib.nullcontext()
