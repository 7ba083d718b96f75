"""Data-parallel ranks as threads of one process: torch's in-process ("threaded") process group, whose
collectives (all-reduce, all-gather, broadcast) exchange tensors between the threads, so DDP, the ranks'
agreements (``grpolab.parallel.ranks.Ranks``) and a rank's update run unchanged, in seconds, where
``torch.multiprocessing`` or ``torchrun`` would start an interpreter per rank. What runs per rank must not
touch process-wide state (the global RNG, files of the same name): each thread sees the whole process."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


def run_as_threads(world: int, fn: Callable[[int], T], timeout: float = 120.0) -> list[T]:
    """``fn(rank)`` on ``world`` threads joined in one process group; the results in rank order. The first
    rank's error is raised (the others are woken from their collectives)."""
    from torch.testing._internal.distributed.multi_threaded_pg import (
        ProcessLocalGroup,
        _install_threaded_pg,
        _uninstall_threaded_pg,
    )

    results: list = [None] * world
    errors: list[tuple[int, BaseException]] = []
    store = dist.HashStore()
    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    _install_threaded_pg()
    installed = dist.distributed_c10d._world
    if not hasattr(installed, "comms"):  # torch 2.11's threaded world lacks the list destroy_process_group reads
        installed.comms = []

    def rank_main(rank: int) -> None:
        dist.init_process_group("threaded", rank=rank, world_size=world, store=store)
        try:
            results[rank] = fn(rank)
        except BaseException as error:  # noqa: BLE001 - passed on to the caller below
            errors.append((rank, error))
            ProcessLocalGroup.exception_handle(error)  # wakes the ranks waiting in a collective
        finally:
            dist.destroy_process_group()

    threads = [threading.Thread(target=rank_main, args=(rank,), daemon=True) for rank in range(world)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout)
            if thread.is_alive():
                raise TimeoutError(f"a rank did not finish within {timeout:g} s")
    finally:
        ProcessLocalGroup.reset()
        _uninstall_threaded_pg()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
    if errors:
        rank, error = min(errors, key=lambda e: e[0])
        raise RuntimeError(f"rank {rank} failed") from error
    return results
