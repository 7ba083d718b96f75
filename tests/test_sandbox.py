"""Killable worker processes with deadlines (grpolab.tasks.sandbox)."""

from __future__ import annotations

import threading
import time

import pytest

from grpolab.tasks.sandbox import WorkerPool, WorkerStartError


def test_calls_return_values_and_tracebacks():
    pool = WorkerPool("reward_fns:echo")
    assert pool.call([1, "a"], {"k": [2.5]}).value == [[1, "a"], {"k": [2.5]}]
    assert pool.call([], {"opaque": True}).value == "<object object>"
    failed = WorkerPool("reward_fns:faulty").call(["x", "y"], {"id": "p0"})
    assert not failed.ok and "RuntimeError: user bug on p0" in failed.error
    pool.close()


def test_a_sleeping_call_ends_at_its_soft_bound_and_the_worker_is_kept():
    pool = WorkerPool("reward_fns:faulty")
    pool.call(["x", "y"], {"id": "p9"})  # start a worker
    start = time.perf_counter()
    reply = pool.call(["x", "y"], {"id": "p1"}, timeout_s=0.5)
    assert not reply.ok and reply.error.startswith("timed out after 0.4") and time.perf_counter() - start < 0.6
    assert len(pool.idle) == 1 and pool.call(["x", "y"], {"id": "p9"}).value == 1.0
    pool.close()


def test_a_dead_or_stuck_worker_is_replaced():
    pool = WorkerPool("reward_fns:exits")
    assert pool.call(["x", "y"]).error == "worker died" and not pool.idle
    stuck = WorkerPool("reward_fns:busy_forever")
    start = time.perf_counter()
    assert "killed" in stuck.call(["x", "y"], timeout_s=0.3).error and time.perf_counter() - start < 2
    assert not stuck.idle


def test_a_target_that_cannot_be_imported_is_a_start_error():
    with pytest.raises(WorkerStartError, match="AttributeError"):
        WorkerPool("reward_fns:missing").call([])


def test_threads_share_a_pool_of_at_most_max_workers():
    pool = WorkerPool("reward_fns:echo", max_workers=2)
    results = []
    threads = [threading.Thread(target=lambda i=i: results.append(pool.call([i]).value[0][0])) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert sorted(results) == list(range(8)) and len(pool.idle) <= 2
    pool.close()
    assert WorkerPool.shared("reward_fns:echo") is WorkerPool.shared("reward_fns:echo")


def test_worker_processes_start_without_torch():
    """Every worker imports grpolab.tasks: it must stay light (torch alone takes seconds to import)."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", "import sys, grpolab.tasks.sandbox; print('torch' in sys.modules)"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "False"


def test_a_pickled_closure_larger_than_an_argument_runs_in_a_worker():
    """A function pickled by value (a closure over 600 kB of data: longer than one command-line argument may be)
    reaches its worker on standard input and runs there; one over the size bound, or one that cannot be pickled,
    is refused with why; a worker that cannot load the pickle is one start error."""
    from grpolab.tasks.sandbox import MAX_PICKLED_BYTES, pickled_callable

    table = "x" * 600_000
    target = pickled_callable(lambda key: len(table) + key)
    assert len(target) > 2**17
    assert WorkerPool(target).call([1]).value == 600_001
    huge = bytes(MAX_PICKLED_BYTES + 1)
    with pytest.raises(ValueError, match="pickles to 8.0 MiB"):
        pickled_callable(lambda: len(huge))
    lock = threading.Lock()
    with pytest.raises(ValueError, match="cannot be sent to the worker processes"):
        pickled_callable(lambda: lock.locked())
    with pytest.raises(WorkerStartError, match="could not be loaded"):
        WorkerPool("pickle:broken:bm90IGEgcGlja2xl").check()
