"""Ctrl-C and SIGTERM during a run, for the CLI and the Python API alike: the first asks the training loop to
stop after its step with a resumable checkpoint, a second (or one outside the loop) ends it at once."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from grpolab.run.stop import StopRequest


class Interrupts:
    """SIGINT / SIGTERM are remembered. While the training loop runs, the first one asks it to stop after
    the current step with a resumable checkpoint; otherwise (or the second time) they raise
    KeyboardInterrupt. vLLM's engine processes share the terminal's process group, die of the same
    Ctrl-C, and the library may catch the trainer's own KeyboardInterrupt while it raises an engine
    error instead; the run is still an interrupted one. A SIGTERM within ``REPEATED_SIGTERM_S`` of the
    stop's request changes nothing (torchrun's agent and a Slurm cancel may both pass one on); a later
    one ends the run at once, like a second Ctrl-C: a step that cannot end (a stuck engine, a reward
    function that never returns) must not make a run deaf to ``kill``, ``timeout`` or a suite's stop."""

    received = False
    stop = StopRequest()

    @classmethod
    def handler(cls, signum: int, frame: Any) -> None:
        cls.received = True
        if cls.stop.armed and not cls.stop.requested:
            cls.stop.requested, cls.stop.requested_at = True, time.monotonic()
            return
        if (
            cls.stop.armed
            and signum == signal.SIGTERM
            and time.monotonic() - cls.stop.requested_at < REPEATED_SIGTERM_S
        ):
            return
        raise KeyboardInterrupt


REPEATED_SIGTERM_S = 5.0  # SIGTERMs this close to the first are one request passed on twice


@contextmanager
def stopping_on_signals() -> Iterator[StopRequest]:
    """A fresh ``Interrupts.stop`` for one command or ``grpolab.train`` call, with SIGINT and SIGTERM handled by
    ``Interrupts`` meanwhile (from the main thread only, where Python lets a handler be set: a notebook's cells
    run there), the previous handlers restored after."""
    Interrupts.received, Interrupts.stop = False, StopRequest()
    main = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.signal(sig, Interrupts.handler) for sig in (signal.SIGINT, signal.SIGTERM)} if main else {}
    try:
        yield Interrupts.stop
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
