"""Answer formats: where a completion states its final answer. Pure string work; never raises.

* ``r1_zero``: ``... </think> <answer> X </answer>`` exactly as the r1_zero grader reads it.
* ``answer_tags``: the last ``<answer>X</answer>``.
* ``boxed``: the last ``\\boxed{X}`` (braces balanced, so ``\\boxed{\\frac{1}{2}}`` gives ``\\frac{1}{2}``;
  also ``\\boxed X`` and ``\\fbox{X}``).
* ``last_number``: the last number (``-1,234.5``, ``.5``, ``3/4``) in the text.

For every format but ``r1_zero``, text up to the last ``</think>`` is a thinking block and is not
searched; a completion that opens ``<think>`` and never closes it states no answer (the chat
prompts of thinking models open that block in the completion).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Literal

from grpolab.tasks.r1_zero import parse_r1_zero

AnswerFormat = Literal["r1_zero", "answer_tags", "boxed", "last_number"]

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
MAX_SCAN_CHARS = 100_000  # longer completions are searched in their last this-many characters

_BOX_OPENER = re.compile(r"\\(?:boxed|fbox)")
_LAST_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?|-?\.\d+")


def after_thinking(text: str) -> str | None:
    """The text after the last ``</think>``; None when a ``<think>`` is never closed; else the text."""
    close = text.rfind(THINK_CLOSE)
    if close >= 0:
        return text[close + len(THINK_CLOSE) :]
    return None if THINK_OPEN in text else text


def last_answer_tags(text: str) -> str | None:
    """The stripped content of the last ``<answer>...</answer>`` (the last opening tag before the last closing one)."""
    close = text.rfind("</answer>")
    start = text.rfind("<answer>", 0, close) if close >= 0 else -1
    return text[start + len("<answer>") : close].strip() if start >= 0 else None


def _matching_braces(text: str) -> dict[int, int]:
    """{index of "{": index of its "}"} for every balanced pair, in one pass."""
    opened, pairs = [], {}
    for i, char in enumerate(text):
        if char == "{":
            opened.append(i)
        elif char == "}" and opened:
            pairs[opened.pop()] = i
    return pairs


def last_boxed(text: str) -> str | None:
    """The stripped content of the last ``\\boxed{...}`` / ``\\fbox{...}`` / ``\\boxed X`` (linear time)."""
    pairs: dict[int, int] | None = None
    for rest in reversed([m.end() for m in _BOX_OPENER.finditer(text)]):
        if text.startswith("{", rest):
            pairs = _matching_braces(text) if pairs is None else pairs
            if rest in pairs:
                return text[rest + 1 : pairs[rest]].strip()
        elif text.startswith(" ", rest):
            word = re.match(r" +([^\s$]+)", text[rest : rest + 1000])
            if word:
                return word.group(1)
    return None


def last_number(text: str) -> str | None:
    """The last number in ``text``, thousands commas removed."""
    found = _LAST_NUMBER.findall(text)
    return found[-1].replace(",", "") if found else None


_FINDERS: dict[str, Callable[[str], str | None]] = {
    "answer_tags": last_answer_tags,
    "boxed": last_boxed,
    "last_number": last_number,
}


def extract_answer(completion: str, answer_format: AnswerFormat) -> str | None:
    """The final answer ``completion`` states in ``answer_format``: None when the format's structure is
    absent (no tags, no box, no number), possibly ``""`` when it is present but empty."""
    try:
        text = completion[-MAX_SCAN_CHARS:]
        if answer_format == "r1_zero":
            return parse_r1_zero(text)[1]
        visible = after_thinking(text)
        return _FINDERS[answer_format](visible) if visible is not None else None
    except Exception:  # defensive: a grader must never raise
        return None
