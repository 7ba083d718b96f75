"""Final-answer equivalence: a fast numeric path, then math-verify in a killable worker process.

``answers_match(predicted, gold)`` first tries plain numbers: when both strings are one number
among plain words (``"The answer is $1,234.00 dollars"``, ``\\boxed{18}``, ``50%``), their
canonical decimals decide, in-process and in microseconds. Anything else
(``\\frac{1}{2}``, ``2^{10}``, ``x^2+1``) goes to ``math_verify.parse``/``verify``.

math-verify's own timeouts use ``signal.alarm``: whole seconds, main thread only (in another thread
``verify`` raises), and they replace any alarm the caller set. So math-verify runs in a killable
child process instead (``grpolab.tasks.sandbox``): its soft timer ends slow Python-level work, and
the child is killed when no reply arrives within ``timeout_s``. This works from any thread. A
worker starts on first use (~0.4 s here, not counted in ``timeout_s``) and is reused. Inputs longer
than ``MAX_ANSWER_CHARS`` only match exactly. The function never raises.
"""

from __future__ import annotations

import logging
import re

from grpolab.tasks.sandbox import WorkerPool, WorkerStartError

DEFAULT_TIMEOUT_S = 2.0
MAX_ANSWER_CHARS = 1000

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


# --- math-verify in a worker process ------------------------------------------------------------


def _mv_parse(text: str) -> list:
    """math-verify parse; bare LaTeX (``2^{10}``, ``\\sqrt{4}``) and lists (``3, 2``) are wrapped in ``$...$`` first."""
    from math_verify import parse

    has_delimiters = any(d in text for d in ("$", "\\(", "\\[", "\\boxed"))
    if not has_delimiters and any(c in text for c in "\\^{_,"):
        text = f"${text}$"
    parsed = parse(text, parsing_timeout=None)
    return parsed or (parse(f"${text}$", parsing_timeout=None) if not has_delimiters else [])


def math_verify_in_worker(predicted: str, gold: str) -> bool:
    """math-verify's verdict, computed inside a ``WorkerPool`` child (no timeouts of its own: the pool's)."""
    from math_verify import verify

    logging.getLogger("math_verify").setLevel(logging.CRITICAL)
    return bool(verify(_mv_parse(gold), _mv_parse(predicted), timeout_seconds=None))


_pool = WorkerPool.shared("grpolab.tasks.answers:math_verify_in_worker")
_unavailable: list[str] = []  # set once a worker could not start: numeric answers still work


def math_verify_match(predicted: str, gold: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> bool:
    """math-verify equivalence of ``predicted`` to ``gold``, False on timeout or any error."""
    if _unavailable:
        return False
    try:
        reply = _pool.call([predicted, gold], timeout_s=timeout_s)
    except WorkerStartError as err:
        _unavailable.append(str(err))
        logger.warning("math-verify unavailable, only numeric answers are compared: %s", err)
        return False
    except Exception:
        return False
    return reply.ok and reply.value is True


_SEVERAL_ANSWERS = re.compile(r",\s|;|\bor\b|\band\b")
_GOLD_LIST = re.compile(r",|;|\bor\b|\band\b")  # a gold with commas may be an interval, tuple or set


def is_single_answer(gold: str) -> bool:
    """True when ``gold`` holds no comma or list word: one value, so a predicted list cannot equal it."""
    return _GOLD_LIST.search(gold) is None


def answers_match(predicted: str, gold: str, timeout_s: float = DEFAULT_TIMEOUT_S, *, symbolic: bool = True) -> bool:
    """Whether ``predicted`` is the same final answer as ``gold``; never raises, never hangs.

    Empty answers never match; identical stripped strings always do. Two plain numbers (see
    ``plain_number``) are compared in-process; otherwise, when ``symbolic``, math-verify decides
    within ``timeout_s`` seconds (plus a worker's start-up, ~0.4 s, when one has to start). Inputs
    over ``MAX_ANSWER_CHARS`` only match exactly. math-verify evaluates expressions and takes the
    last of several answers: ``"57+38"`` matches 95, so a list such as ``"18 or 19"`` or ``"\\frac12, 3"``
    is refused when the gold is a single answer (``is_single_answer``). Pass ``symbolic=False`` where
    an unevaluated expression must not count (e.g. arithmetic drills).
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
        if is_single_answer(gold) and _SEVERAL_ANSWERS.search(predicted):
            return False  # "17, 18, 19" or "18 or 19" must not win by containing the gold answer
        return symbolic and math_verify_match(predicted, gold, timeout_s)
    except Exception:
        return False
