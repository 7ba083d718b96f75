"""Reward functions imported by path in the tests (``reward_fns:NAME``), as a user's module would be."""

from __future__ import annotations

import time


def brevity(completion: str, answer: str, *, truncated: bool) -> float:
    """1 for a completion of at most 30 characters that stopped by itself, falling linearly to 0 at 60."""
    if truncated:
        return 0.0
    return max(0.0, min(1.0, (60 - len(completion)) / 30))


def mentions_gold(completion: str, answer: str, **info) -> bool:
    """Whether the gold answer appears anywhere in the completion (sees every info key)."""
    assert {"question", "id", "extracted", "truncated", "fields"} <= set(info)
    return answer in completion


def scaled(completion: str, answer: str, extracted: str | None, scale: float = 1.0) -> float:
    """``scale`` when the extracted answer equals the gold string (an option from the config)."""
    return scale if extracted == answer else 0.0


def faulty(completion: str, answer: str, id: str) -> object:
    """Misbehaves by the item id's last digit: 0 raises, 1 sleeps forever, 2 returns NaN, 3 returns text,
    4 returns None, 5 returns infinity; other items get 1.0."""
    kind = id[-1]
    if kind == "0":
        raise RuntimeError(f"user bug on {id}")
    if kind == "1":
        time.sleep(10_000)
    return {"2": float("nan"), "3": "high", "4": None, "5": float("inf")}.get(kind, 1.0)


def busy_forever(completion: str, answer: str) -> float:
    """Never returns and ignores signals' Python-level exceptions (spins in a bare loop)."""
    while True:
        try:
            while True:
                pass
        except BaseException:
            continue


not_a_function = 42


def exits(completion: str, answer: str) -> float:
    """Kills its own process."""
    import os

    os._exit(3)


def echo(*args, **kwargs):
    """Returns what it was given; an object JSON cannot hold when asked to."""
    if kwargs.get("opaque"):
        return object()
    return [list(args), kwargs]


def format_credit(completion: str, answer: str, extracted: str | None) -> float:
    """Partial credit: 0.5 for a completion whose answer could be extracted (a right format), else 0."""
    return 0.5 if extracted is not None else 0.0


def flaky(completion: str, answer: str, extracted: str | None) -> float:
    """1.0 when the extracted answer is the gold, but raises on about one completion in five (chosen by its text's
    hash, so a completion always fails or never): a grader service that drops some calls."""
    import hashlib

    if int(hashlib.sha256(completion.encode()).hexdigest(), 16) % 5 == 0:
        raise ConnectionError("the grader service dropped the call")
    return float(extracted == answer)


def always_fails(completion: str, answer: str) -> float:
    """Raises on every call (a grader whose service is gone)."""
    raise ConnectionError("the grader service is unreachable")


def fails_on_train_items(completion: str, answer: str, id: str) -> float:
    """Raises on every training item (its grader service is gone), scores 0 on the held-out ones."""
    if id.startswith("train"):
        raise ConnectionError("the grader service is unreachable")
    return 0.0
