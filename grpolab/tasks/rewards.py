"""Reward functions of a task: verifiers by name and user functions by import path, weighted.

Verifiers compare the answer extracted from a completion (``grpolab.tasks.extract``) with the gold
answer and give 1.0 or 0.0 (0.0 when no answer was found or the completion was truncated):

* ``numeric``: one plain number each, compared as canonical decimals (``"$1,234.00"`` = ``"1234"``).
* ``math``: math-verify, time-bounded (``timeout_s``, default 2): fractions, radicals, intervals,
  sets, LaTeX; a list is refused for a single gold answer.
* ``exact``: the stripped strings, whitespace runs collapsed; ``case_sensitive`` (default true).
* ``regex``: the answer fully matches ``pattern`` in which ``{gold}`` stands for the escaped gold
  answer (default ``"{gold}"``); with ``pattern = "gold"`` the gold answer itself is the regular
  expression. ``ignore_case``; ``timeout_s`` bounds the match (in a killable worker: the ``regex``
  package's own timeout misses some runaway searches).

A user function is named ``"package.module:function"``, or given as the function itself from Python
(``grpolab.train(rewards=[f])``, or ``function = f`` in a config dict: pickled by value with cloudpickle,
``grpolab.tasks.sandbox.pickled_callable``, so a function of a script's ``__main__``, a notebook cell or a
lambda works), and has this signature::

    def my_reward(completion: str, answer: str, **info) -> float

``completion`` is the generated text, ``answer`` the gold answer; ``info`` holds whichever of these
keyword arguments the function declares (all of them when it takes ``**kwargs``): ``question``,
``id``, ``extracted`` (the answer found in the task's answer format, or None), ``truncated`` (hit
the token limit), ``fields`` (the data row, a dict), and the term's ``options`` from the config.
It runs in a killable worker process (``grpolab.tasks.sandbox``) with its own time bound
(``timeout_s``, default 10): a function that raises, runs past its bound, or returns anything but a
finite real number (bool, int, float) gives 0.0 for that sample, is counted, and its first
traceback is logged once. The run goes on.
"""

from __future__ import annotations

import inspect
import logging
import math
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import regex

from grpolab.tasks.answers import answers_match
from grpolab.tasks.sandbox import IMPORT_PATH, WorkerPool, WorkerStartError, is_pickled, resolve, target_label

logger = logging.getLogger(__name__)

USER_FUNCTION_TIMEOUT_S = 10.0
INFO_KEYS = ("question", "id", "extracted", "truncated", "fields")


def numeric_verifier() -> Callable[[str, str], bool]:
    return lambda answer, gold: answers_match(answer, gold, symbolic=False)


def math_verifier(timeout_s: float = 2.0) -> Callable[[str, str], bool]:
    return lambda answer, gold: answers_match(answer, gold, timeout_s)


def exact_verifier(case_sensitive: bool = True) -> Callable[[str, str], bool]:
    def norm(text: str) -> str:
        text = " ".join(text.split())
        return text if case_sensitive else text.casefold()

    return lambda answer, gold: norm(answer) == norm(gold)


def regex_in_worker(pattern: str, answer: str, flags: int, timeout_s: float) -> bool:
    """``regex.fullmatch`` inside a ``WorkerPool`` child: the package's own timeout ends most runaway
    matches early, and the pool kills the child for those it does not check (long literal searches)."""
    try:
        return regex.fullmatch(pattern, answer, flags, timeout=timeout_s) is not None
    except Exception:  # a gold that is no valid expression, too deeply nested, or past the time bound
        return False


def regex_verifier(
    pattern: str = "{gold}", ignore_case: bool = False, timeout_s: float = 1.0
) -> Callable[[str, str], bool]:
    flags = regex.IGNORECASE if ignore_case else 0
    if pattern != "gold":  # checked once: a pattern that cannot compile is a config error
        try:
            regex.compile(pattern.replace("{gold}", ""), flags)
        except regex.error as err:
            raise ValueError(f"regex verifier: pattern {pattern!r} does not compile ({err})") from None
    pool = WorkerPool.shared("grpolab.tasks.rewards:regex_in_worker")

    def match(answer: str, gold: str) -> bool:
        source = gold if pattern == "gold" else pattern.replace("{gold}", regex.escape(gold))
        reply = pool.call([source, answer.strip(), flags, timeout_s], timeout_s=timeout_s + 0.5)
        return reply.ok and reply.value is True

    return match


VERIFIERS: dict[str, Callable[..., Callable[[str, str], bool]]] = {
    "numeric": numeric_verifier,
    "math": math_verifier,
    "exact": exact_verifier,
    "regex": regex_verifier,
}


def _check_options(factory: Callable, options: dict[str, Any], where: str) -> None:
    try:
        inspect.signature(factory).bind(**options)
    except TypeError as err:
        raise ValueError(f"{where}: bad options {options} ({err})") from None


@dataclass
class Sample:
    """What a reward function may look at for one completion."""

    completion: str
    answer: str
    question: str
    id: str
    extracted: str | None
    truncated: bool
    fields: Mapping[str, Any] = field(default_factory=dict)


def check_function_name(target: str) -> str:
    """A user function's target as a config gives it: ``package.module:function`` or a pickled callable; a
    function of ``__main__`` is refused (the worker processes it runs in have another ``__main__``)."""
    if is_pickled(target):
        return target
    if not IMPORT_PATH.fullmatch(target):
        raise ValueError(
            f"reward function {target!r}: expected a verifier ({', '.join(VERIFIERS)}) or 'package.module:function'"
        )
    if target.partition(":")[0] == "__main__":
        raise ValueError(
            f"reward function {target!r}: a function of a script's or notebook's __main__ cannot be imported by "
            "the worker processes rewards run in; pass the function itself (grpolab.train(rewards=[f])) or "
            "move it into a module"
        )
    return target


class UserFunction:
    """A ``module:function`` reward (or a pickled callable), called in worker processes with a time bound."""

    def __init__(self, target: str, options: dict[str, Any], timeout_s: float):
        check_function_name(target)
        label = target_label(target) if is_pickled(target) else repr(target)
        try:
            function = resolve(target)
        except Exception as err:
            how = "loaded" if is_pickled(target) else "imported"
            raise ValueError(f"reward function {label} cannot be {how}: {type(err).__name__}: {err}") from None
        if not callable(function):
            raise ValueError(f"reward function {label} is not callable")
        try:
            parameters = inspect.signature(function).parameters.values()
        except (TypeError, ValueError):
            parameters = []
        takes_all = any(p.kind is p.VAR_KEYWORD for p in parameters)
        declared = {p.name for p in parameters if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}
        self.keys = INFO_KEYS if takes_all else tuple(k for k in INFO_KEYS if k in declared)
        unknown = set(options) - declared - set(INFO_KEYS)
        if unknown and not takes_all:
            raise ValueError(f"reward function {label} takes no option(s) {', '.join(sorted(unknown))}")
        self.target, self.options, self.timeout_s = target, options, timeout_s
        self.pool = WorkerPool.shared(target)
        self.start_error: str | None = None  # a worker could not import it: every call fails at once
        try:  # a worker that cannot load it is one error now, before the run starts, not a zero per sample
            self.pool.check()
        except WorkerStartError as err:
            raise ValueError(f"reward function {label}: {err}") from None

    def __call__(self, sample: Sample) -> tuple[float, str | None]:
        """(value, None) or (0.0, why it failed)."""
        if self.start_error is not None:
            return 0.0, self.start_error
        info = {k: getattr(sample, k) for k in self.keys}
        try:
            reply = self.pool.call([sample.completion, sample.answer], {**info, **self.options}, self.timeout_s)
        except WorkerStartError as err:
            self.start_error = str(err)
            return 0.0, self.start_error
        if not reply.ok:
            return 0.0, reply.error
        value = reply.value
        if isinstance(value, bool) or (isinstance(value, (int, float)) and math.isfinite(value)):
            return float(value), None
        return 0.0, f"returned {value!r}, not a finite number"


@dataclass
class RewardTerm:
    """One weighted reward function; ``name`` labels its metrics (``reward/<name>``)."""

    name: str
    weight: float
    score: Callable[[Sample], tuple[float, str | None]]
    failures: int = 0


def reward_term(
    function: str, name: str | None, weight: float, options: dict[str, Any], timeout_s: float | None
) -> RewardTerm:
    """A term from its config: a verifier name or a ``module:function``."""
    label = name or target_label(function)
    if function in VERIFIERS:
        if timeout_s is not None:
            options = {**options, "timeout_s": timeout_s}
        _check_options(VERIFIERS[function], options, f"reward {label!r} ({function})")
        verify = VERIFIERS[function](**options)

        def score(sample: Sample) -> tuple[float, str | None]:
            if sample.truncated or not sample.extracted:
                return 0.0, None
            return (1.0 if verify(sample.extracted, sample.answer) else 0.0), None

        return RewardTerm(label, weight, score)
    return RewardTerm(label, weight, UserFunction(function, options, timeout_s or USER_FUNCTION_TIMEOUT_S))


class RewardSet:
    """Weighted reward terms; the first is the task's correctness (accuracy, pass@k)."""

    def __init__(self, terms: list[RewardTerm]):
        names = [t.name for t in terms]
        if not terms or len(set(names)) != len(names):
            raise ValueError(f"a task needs at least one reward and distinct reward names (got {names})")
        self.terms = terms
        self._lock = threading.Lock()  # samples are scored from several threads (grade_batch)

    def score(self, sample: Sample) -> tuple[dict[str, float], tuple[str, ...], str | None]:
        """({name: unweighted value}, names of the terms that failed on this sample, the first one's error)."""
        values, failed, first_error = {}, [], None
        for term in self.terms:
            try:
                value, error = term.score(sample)
            except Exception as err:  # defensive: the built-in verifiers do not raise
                value, error = 0.0, f"{type(err).__name__}: {err}"
            if error is not None:
                with self._lock:
                    term.failures += 1
                    first = term.failures == 1
                failed.append(term.name)
                # a worker's error is its traceback: its last line says what was raised
                first_error = first_error or f"reward {term.name!r}: {error.strip().splitlines()[-1]}"
                if first:
                    logger.warning(
                        "reward %r failed on item %s (the sample is failed; later failures are only counted "
                        "in reward/%s_failed):\n%s",
                        term.name,
                        sample.id,
                        term.name,
                        error,
                    )
            values[term.name] = value
        return values, tuple(failed), first_error

    def total(self, values: dict[str, float]) -> float:
        return sum(t.weight * values[t.name] for t in self.terms)
