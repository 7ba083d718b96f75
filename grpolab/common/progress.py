"""Progress of long phases: rich bars on a terminal, plain time-stamped lines otherwise.

On a terminal every open phase is a row of one rich progress display (phases nest: an evaluation
shows under the training bar). When the output is not a terminal (a log file, ``| tee run.log``) a
phase prints a 'running' line once it has taken a few seconds, a line every ``every`` units, a
heartbeat whenever nothing was printed for ``interval`` seconds (a thread covers calls that report
nothing, such as an engine starting or a long generation) and one when it ends, so that a log file
tells the story at a steady rhythm. A bar shows the time elapsed and, once a unit is done, the time
left (``Phase.left``, the same estimate as the plain lines').

``GRPOLAB_HEARTBEAT_SECONDS`` sets the heartbeat interval (default 30 s; tests set a fraction of a second).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, Progress, ProgressColumn, SpinnerColumn, Task, TextColumn, TimeElapsedColumn
from rich.text import Text


def _heartbeat_seconds(value: str | None) -> float:
    """GRPOLAB_HEARTBEAT_SECONDS as seconds (unset: 30); anything but a positive number is refused in one line."""
    try:
        seconds = float(value or 30.0)
    except ValueError:
        seconds = 0.0
    if not seconds > 0:
        raise ValueError(f"GRPOLAB_HEARTBEAT_SECONDS={value}: give a positive number of seconds, such as 30")
    return seconds


HEARTBEAT_SECONDS = _heartbeat_seconds(os.environ.get("GRPOLAB_HEARTBEAT_SECONDS"))
ANNOUNCE_SECONDS = 2.0


def format_seconds(seconds: float) -> str:
    """12 s, 3m05s, 1h02m."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def format_bytes(n: float) -> str:
    """950 B, 12 kB, 540 MB, 1.6 GB (powers of 1000, as disks are sold and ``df -H`` counts)."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.{1 if abs(n) < 10 * size else 0}f} {unit}"
    return f"{n:.0f} B"


class Phase:
    """One long phase: ``advance`` as units finish, ``status`` for what it is doing now."""

    def __init__(self, reporter: Reporter, title: str, total: int | None, unit: str, every: int | None, done: int = 0):
        self.reporter, self.title, self.total, self.unit, self.every = reporter, title, total, unit, every
        self.done, self.info, self.status, self.lines = done, "", "", 0
        self.first = done  # units done before this phase started (a resumed run)
        self.started = time.monotonic()
        self.task_id = None

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def left(self) -> float | None:
        """Estimated seconds left, from the rate so far; None before the first unit or without a total."""
        if not self.total or self.done <= self.first:
            return None
        return self.elapsed() / (self.done - self.first) * (self.total - self.done)

    def text(self) -> str:
        count = (
            f"{self.done}/{self.total} {self.unit}" if self.total else (f"{self.done} {self.unit}" if self.done else "")
        )
        return ", ".join(part for part in (count.strip(), self.status, self.info) if part)

    def advance(self, n: int = 1, info: str | None = None) -> None:
        """``n`` more units done; ``info`` (e.g. "loss 0.53") replaces the phase's extra text."""
        self.done += n
        if info is not None:
            self.info = info
        if self.reporter.plain:
            if self.every and (self.done % self.every == 0 or self.done == self.total):
                self.emit()
        else:
            self.reporter.refresh(self)

    def set_total(self, total: int | None) -> None:
        """The number of units, once known (a loop that counts its own work)."""
        self.total = total
        if self.reporter._live is not None and self.task_id is not None:
            self.reporter._live.update(self.task_id, total=total)

    def set_status(self, status: str) -> None:
        """What the phase is doing now (shown on the bar and in heartbeat lines)."""
        self.status = status
        if not self.reporter.plain:
            self.reporter.refresh(self)

    def emit(self, note: str = "") -> None:
        """A plain progress line now."""
        left = self.left()
        timing = f"{format_seconds(self.elapsed())} elapsed" + (f", ~{format_seconds(left)} left" if left else "")
        self.reporter.line(f"{self.title}: {', '.join(p for p in (self.text(), note, timing) if p)}")
        self.lines += 1


class TimeLeftColumn(ProgressColumn):
    """A bar's time left: its phase's ``left()`` ("~1m05s left"), blank before the first unit or without a total."""

    def render(self, task: Task) -> Text:
        phase = task.fields.get("phase")
        left = phase.left() if phase is not None else None
        return Text(f"~{format_seconds(left)} left" if left is not None else "", style="progress.remaining")


class Reporter:
    """Shows long phases on ``console``; ``plain`` (time-stamped lines) when it is not a terminal."""

    def __init__(self, console: Console, interval: float = HEARTBEAT_SECONDS):
        self.console, self.interval = console, interval
        self.plain = not console.is_terminal
        self._live: Progress | None = None
        self._open: list[Phase] = []
        self._lock = threading.Lock()
        self.last_line = time.monotonic()  # any line resets every phase's heartbeat

    def line(self, text: str) -> None:
        """A log line: time-stamped when plain; printed above the bars on a terminal."""
        stamp = time.strftime("%H:%M:%S ") if self.plain else ""
        with self._lock:
            self.console.print(stamp + text, markup=False, highlight=False, soft_wrap=True)
            self.last_line = time.monotonic()

    def warning(self, text: str) -> None:
        """A 'warning: ' line, its word in yellow on a terminal (plain and time-stamped in a log)."""
        stamp = time.strftime("%H:%M:%S ") if self.plain else ""
        line = Text(stamp)
        line.append("warning:", style=None if self.plain else "bold yellow")
        line.append(" " + text)
        with self._lock:
            self.console.print(line, highlight=False, soft_wrap=True)
            self.last_line = time.monotonic()

    def refresh(self, phase: Phase) -> None:
        if self._live is not None and phase.task_id is not None:
            self._live.update(phase.task_id, completed=phase.done, text=phase.text())

    @contextmanager
    def phase(
        self,
        title: str,
        total: int | None = None,
        unit: str = "",
        every: int | None = None,
        done_note: bool | None = True,
        done: int = 0,
    ) -> Iterator[Phase]:
        """A phase of ``total`` units (None: unknown). Plain output gets a 'running' line after a few
        seconds, a line every ``every`` units (None: by time only), heartbeats and an end line: always
        with ``done_note`` True, never with False, with None only when the phase printed a line; never when the
        phase ends in an exception (its error is the last word, not a 'done')."""
        phase = Phase(self, title, total, unit, every, done)
        finished = False
        self._open.append(phase)
        stop = threading.Event()
        if self.plain:
            beat = threading.Thread(target=self._heartbeat, args=(phase, stop), daemon=True)
            beat.start()
        else:
            if self._live is None:
                self._live = Progress(
                    SpinnerColumn(),
                    TextColumn("{task.description}"),
                    BarColumn(),
                    TextColumn("{task.fields[text]}"),
                    TimeElapsedColumn(),
                    TimeLeftColumn(),
                    console=self.console,
                    transient=True,
                )
                self._live.start()
            phase.task_id = self._live.add_task(title, total=total, completed=done, text=phase.text(), phase=phase)
        try:
            yield phase
            finished = True
        finally:
            stop.set()
            self._open.remove(phase)
            if self._live is not None and phase.task_id is not None:
                self._live.remove_task(phase.task_id)
                if not self._open:
                    self._live.stop()
                    self._live = None
            if finished and (done_note or (done_note is None and phase.lines)):
                self.line(
                    f"{title}: done in {format_seconds(phase.elapsed())}" + (f" ({phase.info})" if phase.info else "")
                )

    def _heartbeat(self, phase: Phase, stop: threading.Event) -> None:
        """A 'running' line once the phase has taken ``ANNOUNCE_SECONDS`` (instant phases print only their
        end line), then a 'still running' line whenever nothing was printed for ``interval`` seconds."""
        if stop.wait(min(ANNOUNCE_SECONDS, self.interval)):
            return
        if self.last_line < phase.started + 0.5:
            phase.emit("running")
        while not stop.wait(min(1.0, self.interval)):
            if time.monotonic() - self.last_line >= self.interval:
                phase.emit("still running")
