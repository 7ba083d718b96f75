"""Final-answer equivalence: a fast numeric path, then math-verify in a killable worker process.

``answers_match(predicted, gold)`` first tries plain numbers: when both strings are one number
among plain words (``"The answer is $1,234.00 dollars"``, ``\\boxed{18}``, ``50%``), their
canonical decimals decide, in-process and in microseconds. Anything else
(``\\frac{1}{2}``, ``2^{10}``, ``x^2+1``) goes to ``math_verify.parse``/``verify``.

math-verify's own timeouts use ``signal.alarm``: whole seconds, main thread only (in another thread
``verify`` raises), and they replace any alarm the caller set. So math-verify runs in a child
process instead (``python -c ...``, no ``multiprocessing``, so no ``__main__`` guard is needed):
a soft ``setitimer`` inside the child ends slow Python-level work, and the parent kills the child
when no reply arrives within ``timeout_s``. This works from any thread, on Linux and macOS. A
worker starts on first use (~0.4 s here, not counted in ``timeout_s``) and is reused; one is killed
and lazily replaced after a hard timeout. Inputs longer than ``MAX_ANSWER_CHARS`` only match
exactly. The function never raises.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import re
import select
import signal
import subprocess
import sys
import threading
from pathlib import Path

DEFAULT_TIMEOUT_S = 2.0
MAX_ANSWER_CHARS = 1000
STARTUP_TIMEOUT_S = 60.0
SOFT_FRACTION = 0.8  # the worker stops itself at this fraction of timeout_s; the parent kills at 1.0
MAX_WORKERS = max(1, min(4, os.cpu_count() or 1))

logger = logging.getLogger(__name__)

# --- numeric fast path --------------------------------------------------------------------------

_NUMBER = r"[-+]?(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(?:\.[0-9]+)?|[-+]?\.[0-9]+"
_WORDS = r"[A-Za-z\s.,:;=%'\"?]*"
_PLAIN = re.compile(rf"{_WORDS}?(?<![A-Za-z.])({_NUMBER})(?![A-Za-z0-9]){_WORDS}")
_WRAPPERS = re.compile(r"\\(?:boxed|text|textbf|textrm|mathrm|mbox|fbox)\s*\{([^{}]*)\}")
_LATEX_SPACING = {"\\$": "$", "\\%": "%", "{,}": ",", "\\,": "", "\\!": "", "\\ ": " ", "\u2212": "-"}
# Words that turn "2 pi" or "3 i" into something other than the number: leave those to math-verify.
_MATH_WORDS = re.compile(r"(?i)\b(?:pi|e|i|j|sqrt|inf|infty|infinity|frac|times|cdot|mod|root)\b")


def _canonical(number: str) -> str:
    """Canonical decimal: no '+', thousands commas, leading zeros, trailing fractional zeros, '-0'."""
    number = number.replace(",", "")
    sign = "-" if number.startswith("-") else ""
    int_part, _, frac = number.lstrip("+-").partition(".")
    out = (int_part.lstrip("0") or "0") + ("." + frac.rstrip("0") if frac.rstrip("0") else "")
    return out if out == "0" else sign + out


def plain_number(text: str) -> str | None:
    """Canonical decimal of ``text`` when it is exactly one number among plain words, else None.

    ``"The answer is $1,234.00 dollars."`` -> ``"1234"``; ``"\\boxed{-0.50}"`` -> ``"-0.5"``;
    ``"50%"`` -> ``"50"`` (``%`` is read as a unit). None for several numbers (``"3 or 4"``,
    ``"1/2"``, ``"1e3"``), operators or LaTeX commands (``"\\sqrt{4}"``, ``"5!"``), math words
    (``"2 pi"``) and text longer than ``MAX_ANSWER_CHARS``.
    """
    if len(text) > MAX_ANSWER_CHARS:
        return None
    for old, new in _LATEX_SPACING.items():
        text = text.replace(old, new)
    while True:
        unwrapped = _WRAPPERS.sub(r"\1", text)
        if unwrapped == text:
            break
        text = unwrapped
    text = text.replace("$", "").strip()
    match = _PLAIN.fullmatch(text)
    if match is None or _MATH_WORDS.search(text):
        return None
    return _canonical(match.group(1))


# --- math-verify worker -------------------------------------------------------------------------


class _SoftTimeout(BaseException):
    """Raised in the worker by its interval timer; a BaseException so math-verify cannot swallow it."""


def _mv_parse(text: str) -> list:
    """math-verify parse; bare LaTeX (``2^{10}``, ``\\sqrt{4}``) is wrapped in ``$...$`` first."""
    from math_verify import parse

    has_delimiters = any(d in text for d in ("$", "\\(", "\\[", "\\boxed"))
    if not has_delimiters and any(c in text for c in "\\^{_"):
        text = f"${text}$"
    parsed = parse(text, parsing_timeout=None)
    return parsed or (parse(f"${text}$", parsing_timeout=None) if not has_delimiters else [])


def _serve() -> None:
    """Worker loop: read ``[pred, gold, soft_s]`` JSON lines from stdin, answer ``1``/``0`` lines."""

    def on_alarm(signum: int, frame: object) -> None:
        raise _SoftTimeout

    channel = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)  # stray prints from libraries must not corrupt the protocol
    from math_verify import verify

    logging.getLogger("math_verify").setLevel(logging.CRITICAL)
    signal.signal(signal.SIGALRM, on_alarm)
    channel.write(b"ready\n")
    for line in sys.stdin.buffer:
        ok = False
        try:
            pred, gold, soft_s = json.loads(line)
            signal.setitimer(signal.ITIMER_REAL, max(float(soft_s), 0.01))
            try:
                ok = bool(verify(_mv_parse(gold), _mv_parse(pred), timeout_seconds=None))
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        except (Exception, _SoftTimeout):
            ok = False
        channel.write(b"1\n" if ok else b"0\n")


class _Worker:
    """One math-verify child process, used by one thread at a time."""

    def __init__(self) -> None:
        root = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from grpolab.tasks.answers import _serve; _serve()"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, start_new_session=True,
        )
        if self._read_line(STARTUP_TIMEOUT_S) != b"ready":
            self.close()
            raise RuntimeError("math-verify worker did not start (is math-verify installed?)")

    def _read_line(self, timeout_s: float) -> bytes | None:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        return self.proc.stdout.readline().strip() if ready else None

    def check(self, predicted: str, gold: str, timeout_s: float, soft_s: float) -> bool | None:
        """True/False from math-verify, or None when the worker died or missed the deadline.

        The worker gives up by itself after ``soft_s``; the caller must kill it on None.
        """
        assert self.proc.stdin is not None
        request = json.dumps([predicted, gold, soft_s]).encode("ascii") + b"\n"
        self.proc.stdin.write(request)
        self.proc.stdin.flush()
        reply = self._read_line(timeout_s)
        return {b"1": True, b"0": False}.get(reply) if reply is not None else None

    def close(self) -> None:
        """Kill the child and reap it."""
        self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()


class _Pool:
    """Idle workers shared by threads; at most ``MAX_WORKERS`` run at once."""

    def __init__(self) -> None:
        self.idle: list[_Worker] = []
        self.lock = threading.Lock()
        self.slots = threading.BoundedSemaphore(MAX_WORKERS)
        self.broken = False

    def check(self, predicted: str, gold: str, timeout_s: float) -> bool:
        if self.broken:
            return False
        with self.slots:
            with self.lock:
                worker = self.idle.pop() if self.idle else None
            if worker is not None and worker.proc.poll() is not None:  # died while idle
                worker.close()
                worker = None
            try:
                worker = worker or _Worker()
            except Exception as err:  # no interpreter, no math-verify: numeric answers still work
                self.broken = True
                logger.warning("math-verify unavailable, only numeric answers are compared: %s", err)
                return False
            try:
                result = worker.check(predicted, gold, timeout_s, SOFT_FRACTION * timeout_s)
            except Exception:
                result = None
            if result is None:
                worker.close()
                return False
            with self.lock:
                self.idle.append(worker)
            return result

    def close(self) -> None:
        with self.lock:
            workers, self.idle = self.idle, []
        for worker in workers:
            worker.close()


_pool = _Pool()
atexit.register(lambda: _pool.close())


def _reset_after_fork() -> None:
    """A forked child must not share its parent's workers (their pipes would be read twice)."""
    global _pool
    for worker in _pool.idle:
        for stream in (worker.proc.stdin, worker.proc.stdout):
            if stream is not None:
                stream.close()  # the child's copies only; the parent keeps its worker
    _pool = _Pool()


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_reset_after_fork)


def math_verify_match(predicted: str, gold: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> bool:
    """math-verify equivalence of ``predicted`` to ``gold``, False on timeout or any error."""
    try:
        return _pool.check(predicted, gold, timeout_s)
    except Exception:
        return False


_SEVERAL_ANSWERS = re.compile(r",\s|;|\bor\b|\band\b")


def answers_match(
    predicted: str, gold: str, timeout_s: float = DEFAULT_TIMEOUT_S, *, symbolic: bool = True
) -> bool:
    """Whether ``predicted`` is the same final answer as ``gold``; never raises, never hangs.

    Empty answers never match; identical stripped strings always do. Two plain numbers (see
    ``plain_number``) are compared in-process; otherwise, when ``symbolic``, math-verify decides
    within ``timeout_s`` seconds (plus a worker's start-up, ~0.4 s, when one has to start). Inputs
    over ``MAX_ANSWER_CHARS`` only match exactly. math-verify evaluates expressions and takes the
    last of several answers: ``"57+38"`` matches 95 (a list such as ``"18 or 19"`` is refused when the
    gold is a plain number); pass
    ``symbolic=False`` where an unevaluated expression must not count (e.g. arithmetic drills).
    """
    try:
        if not isinstance(predicted, str) or not isinstance(gold, str):
            return False
        predicted, gold = predicted.strip(), gold.strip()
        if not predicted or not gold:
            return False
        if predicted == gold:
            return True
        if len(predicted) > MAX_ANSWER_CHARS or len(gold) > MAX_ANSWER_CHARS:
            return False
        pred_number, gold_number = plain_number(predicted), plain_number(gold)
        if pred_number is not None and gold_number is not None:
            return pred_number == gold_number
        if gold_number is not None and _SEVERAL_ANSWERS.search(predicted):
            return False  # "17, 18, 19" or "18 or 19" must not win by containing the gold number
        return symbolic and math_verify_match(predicted, gold, timeout_s)
    except Exception:
        return False
