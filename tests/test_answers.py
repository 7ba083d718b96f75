"""Final-answer equivalence: numeric fast path, math-verify fallback, never raises, never hangs."""

from __future__ import annotations

import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from grpolab.tasks.answers import MAX_ANSWER_CHARS, answers_match, plain_number
from grpolab.tasks.r1_zero import grade_r1_zero
from grpolab.tasks.sandbox import WorkerPool, _Worker


@pytest.mark.parametrize(
    ("text", "number"),
    [
        ("1234", "1234"),
        ("The answer is $1,234.00 dollars", "1234"),
        ("1,234,567", "1234567"),
        ("18.", "18"),
        ("18.0", "18"),
        ("0018.500", "18.5"),
        ("-0.50", "-0.5"),
        (".5", "0.5"),
        ("+7", "7"),
        ("-0", "0"),
        ("\u22125", "-5"),
        ("x = 18", "18"),
        ("\\boxed{18}", "18"),
        ("$\\boxed{\\text{18}}$", "18"),
        ("18 \\text{ dollars}", "18"),
        ("\\$18", "18"),
        ("50%", "50"),
        ("50\\%", "50"),
        ("1{,}234", "1234"),
        ("1\\,234", "1234"),
        ("It costs 12 dollars per day.", "12"),
    ],
)
def test_plain_number(text: str, number: str) -> None:
    assert plain_number(text) == number


@pytest.mark.parametrize(
    "text",
    [
        "",
        "dollars",
        "3 or 4",
        "1/2",
        "1e3",
        "1,2",
        "5!",
        "2^{10}",
        "\\sqrt{4}",
        "\\frac{1}{2}",
        "2 pi",
        "3 i",
        "5km",
        "x-5",
        "1.2.3",
        "(1, 2)",
        "12,34",
    ],
)
def test_not_a_plain_number(text: str) -> None:
    assert plain_number(text) is None


@pytest.mark.parametrize(
    ("predicted", "gold", "expected"),
    [
        ("The answer is $1,234.00 dollars", "1234", True),
        ("1234", "1,234", True),
        ("18", "18.000", True),
        ("18", "19", False),
        ("-3", "3", False),
        ("1,2", "12", False),
        ("", "", False),
        ("  ", "5", False),
        ("5", "", False),
        ("yes", "yes", True),  # identical strings match without any parsing
    ],
)
def test_numeric_cases(predicted: str, gold: str, expected: bool) -> None:
    assert answers_match(predicted, gold) is expected


@pytest.mark.parametrize(
    ("predicted", "gold", "expected"),
    [
        ("\\frac{1}{2}", "0.5", True),
        ("0.5", "\\frac{1}{2}", True),
        ("\\boxed{\\frac{1}{2}}", "0.5", True),
        ("1/2", "\\frac{1}{2}", True),
        ("\\frac{36}{2}", "18", True),
        ("\\dfrac{37}{2}", "18", False),
        ("2^{10}", "1024", True),
        ("\\sqrt{4}", "2", True),
        ("\\sqrt{4}", "4", False),
        ("(x+1)^2", "x^2+2x+1", True),
        ("0.333333", "\\frac{1}{3}", True),
        ("0.33", "\\frac{1}{3}", False),
        ("\\{1,2\\}", "\\{2,1\\}", True),
        ("\\pi", "3.14159", False),
    ],
)
def test_latex_cases_via_math_verify(predicted: str, gold: str, expected: bool) -> None:
    assert answers_match(predicted, gold) is expected


def test_symbolic_false_compares_plain_numbers_only() -> None:
    assert answers_match("57+38", "95")  # math-verify evaluates the expression
    assert not answers_match("57+38", "95", symbolic=False)
    assert not answers_match("\\frac{1}{2}", "0.5", symbolic=False)
    assert answers_match("\\boxed{95}", "95", symbolic=False)


def test_r1_zero_grader_uses_math_verify() -> None:
    grade = grade_r1_zero(" so half </think> <answer> \\frac{1}{2} </answer>", "0.5", truncated=False)
    assert (grade.format_reward, grade.answer_reward) == (1.0, 1.0)


def test_non_strings_do_not_match() -> None:
    assert answers_match(None, "1") is False  # type: ignore[arg-type]
    assert answers_match("1", 1) is False  # type: ignore[arg-type]


_TOKENS = list("0123456789.,$%-+*/^_{}()[]=x !e") + [
    "\\frac",
    "\\sqrt",
    "\\boxed{",
    "\\text{",
    "\\left(",
    "\\right)",
    "\\infty",
    "\\pi",
    " pi",
]
_MATHY = st.lists(st.sampled_from(_TOKENS), max_size=20).map("".join)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(predicted=st.one_of(st.text(), _MATHY), gold=st.one_of(st.text(max_size=20), _MATHY))
def test_never_raises(predicted: str, gold: str) -> None:
    assert answers_match(predicted, gold, timeout_s=1.0) in (True, False)


@pytest.mark.parametrize(
    "predicted",
    [
        "9^9^9^9",
        "9^{9^{9^{9}}}",
        "10^{10^{10}}",
        "\\frac{1}{10^{10^{10}}}",
        "100000000!",
        "(" * 999,
        "9" * 100_000,
        "x" * 100_000,
        "\\sqrt{" * 500,
    ],
    ids=lambda s: s[:16],
)
def test_pathological_inputs_return_quickly(predicted: str) -> None:
    answers_match("\\frac{1}{2}", "0.5")  # make sure a worker is running: its start-up is not timed
    start = time.perf_counter()
    assert answers_match(predicted, "5", timeout_s=1.0) is False
    assert time.perf_counter() - start < 5.0


def test_overlong_inputs_only_match_exactly() -> None:
    long_number = "1" * (MAX_ANSWER_CHARS + 1)
    assert answers_match(long_number, long_number)
    assert not answers_match(long_number + ".0", long_number)


MATH_VERIFY = "grpolab.tasks.answers:math_verify_in_worker"


def test_missed_deadline_kills_worker(monkeypatch) -> None:
    """A worker stuck past the deadline (here: its own soft timer disabled) is killed, not awaited."""
    import grpolab.tasks.sandbox as sandbox

    monkeypatch.setattr(sandbox, "SOFT_FRACTION", 1000.0)
    pool = WorkerPool(MATH_VERIFY)
    start = time.perf_counter()
    reply = pool.call(["10^{10^{10}}", "5"], timeout_s=0.5)
    assert not reply.ok and "killed" in reply.error
    assert time.perf_counter() - start < 5.0 and not pool.idle


def test_dead_worker_is_replaced() -> None:
    pool = WorkerPool(MATH_VERIFY)
    dead = _Worker(MATH_VERIFY)
    dead.close()
    pool.idle.append(dead)
    assert pool.call(["\\frac{36}{2}", "18"], timeout_s=2.0).value is True
    assert pool.idle and pool.idle[0] is not dead
    pool.close()


def test_works_from_other_threads() -> None:
    """math-verify's signal-based timeout only works in the main thread; ours works anywhere."""
    cases = [("\\frac{36}{2}", "18", True), ("2^{10}", "1000", False), ("10^{10^{10}}", "5", False)] * 3
    results: list[tuple[bool, bool, float]] = []

    def run(predicted: str, gold: str, expected: bool) -> None:
        start = time.perf_counter()
        results.append((answers_match(predicted, gold, timeout_s=1.0), expected, time.perf_counter() - start))

    threads = [threading.Thread(target=run, args=case) for case in cases]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert len(results) == len(cases)
    assert all(got is expected for got, expected, _ in results)
    assert max(seconds for *_, seconds in results) < 30  # several may queue for a worker and start one


@pytest.mark.parametrize("listed", ["17, 18, 19", "18 or 19", "19; 20", "18 and 19"])
def test_a_list_of_answers_never_matches_a_numeric_gold(listed):
    assert not answers_match(listed, "19")
