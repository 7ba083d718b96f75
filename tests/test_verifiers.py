"""Answer formats and verifiers by name: tables of tricky cases, and never raising, never hanging."""

from __future__ import annotations

import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from grpolab.tasks.extract import extract_answer
from grpolab.tasks.rewards import VERIFIERS, Sample, reward_term

numeric, math, exact = VERIFIERS["numeric"](), VERIFIERS["math"](), VERIFIERS["exact"]()


@pytest.mark.parametrize(
    "answer, gold, expected",
    [
        ("72", "72", True),
        ("$1,234.00", "1234", True),
        ("-0.50", "-.5", True),
        ("\\boxed{18}", "18", True),
        ("72 dollars", "72", True),
        ("072", "72", True),
        ("73", "72", False),
        ("7.2", "72", False),
        ("72, 73", "72", False),
        ("1/2", "0.5", False),
        ("\\frac{1}{2}", "0.5", False),  # numeric never evaluates expressions
        ("57+38", "95", False),
        ("", "72", False),
        ("seventy-two", "72", False),
    ],
)
def test_numeric_table(answer, gold, expected):
    assert numeric(answer, gold) is expected


@pytest.mark.parametrize(
    "answer, gold, expected",
    [
        # equivalent forms accepted
        ("\\frac{5}{6}", "\\frac{5}{6}", True),
        ("\\dfrac{5}{6}", "\\frac56", True),
        ("\\frac{10}{12}", "\\frac{5}{6}", True),
        ("0.5", "\\frac{1}{2}", True),
        ("5\\sqrt{2}", "\\sqrt{50}", True),
        ("\\frac{\\sqrt{3}}{3}", "\\frac{1}{\\sqrt{3}}", True),
        ("(4,\\infty)", "(4, \\infty)", True),
        ("x=3", "3", True),
        ("\\{2, 1\\}", "\\{1, 2\\}", True),
        ("3, 2", "2, 3", True),
        ("1024", "2^{10}", True),
        ("\\$18", "18", True),
        ("18\\%", "18", True),
        # near misses refused
        ("\\frac{5}{7}", "\\frac{5}{6}", False),
        ("0.333", "\\frac{1}{3}", False),
        ("[4,\\infty)", "(4,\\infty)", False),
        ("(-2,2]", "(-2,2)", False),
        ("5\\sqrt{3}", "5\\sqrt{2}", False),
        ("-\\frac{5}{6}", "\\frac{5}{6}", False),
        ("2", "2, 3", False),
        # lists refused for single answers
        ("\\frac{1}{2}, 3", "\\frac{1}{2}", False),
        ("3, \\frac{1}{2}", "\\frac{1}{2}", False),
        ("81 or 82", "81", False),
        ("2; 3", "3", False),
        ("x = 2 and x = 3", "3", False),
    ],
)
def test_math_table(answer, gold, expected):
    assert math(answer, gold) is expected


@pytest.mark.parametrize(
    "answer, gold, options, expected",
    [
        ("Paris", "Paris", {}, True),
        ("  Paris ", "Paris", {}, True),
        ("New   York", "New York", {}, True),
        ("paris", "Paris", {}, False),
        ("paris", "Paris", {"case_sensitive": False}, True),
        ("Paris.", "Paris", {}, False),
    ],
)
def test_exact_table(answer, gold, options, expected):
    assert VERIFIERS["exact"](**options)(answer, gold) is expected


@pytest.mark.parametrize(
    "answer, gold, options, expected",
    [
        ("a.b", "a.b", {}, True),
        ("axb", "a.b", {}, False),  # the gold is escaped by default
        ("(B)", "B", {"pattern": r"\(?{gold}\)?"}, True),
        ("(C)", "B", {"pattern": r"\(?{gold}\)?"}, False),
        ("colour", "colou?r", {"pattern": "gold"}, True),
        ("Color", "colou?r", {"pattern": "gold", "ignore_case": True}, True),
        ("colr", "colou?r", {"pattern": "gold"}, False),
        ("x", "(unclosed", {"pattern": "gold"}, False),
    ],
)
def test_regex_table(answer, gold, options, expected):
    assert VERIFIERS["regex"](**options)(answer, gold) is expected


@pytest.mark.parametrize(
    "answer, gold",
    [
        ("a" * 40 + "!", "(a+)+$"),  # catastrophic backtracking: the regex package's timeout ends it
        ("x" * 100_000, "9" * 5000),  # a long literal search the package never times out: the worker is killed
    ],
)
def test_regex_runaway_matches_end_at_their_bound(answer, gold):
    verify = VERIFIERS["regex"](pattern="gold", timeout_s=0.2)
    verify("a", "a")  # a worker started
    start = time.perf_counter()
    assert verify(answer, gold) is False
    assert time.perf_counter() - start < 2.0


def test_bad_options_and_patterns_are_config_errors():
    with pytest.raises(ValueError, match="bad options"):
        reward_term("exact", None, 1.0, {"tolerance": 0.1}, None)
    with pytest.raises(ValueError, match="pattern '\\(unclosed' does not compile"):
        reward_term("regex", None, 1.0, {"pattern": "(unclosed"}, None)


@pytest.mark.parametrize(
    "completion, answer_format, expected",
    [
        (" 1+1 </think> <answer> 2 </answer>", "r1_zero", "2"),
        (" 1+1 <answer> 2 </answer>", "r1_zero", None),
        ("so <answer>3</answer> no, <answer> 4 </answer>", "answer_tags", "4"),
        ("we get \\boxed{\\frac{1}{2}}.", "boxed", "\\frac{1}{2}"),
        ("\\boxed{1} then \\fbox{2}", "boxed", "2"),
        ("\\boxed{(4,\\infty)} and \\boxed{\\{1, 2\\}}", "boxed", "\\{1, 2\\}"),
        ("$\\boxed 5$", "boxed", "5"),
        ("\\boxed{unbalanced", "boxed", None),
        ("<think>maybe \\boxed{3}</think> so \\boxed{4}", "boxed", "4"),
        ("<think>maybe \\boxed{3} and then", "boxed", None),  # thinking never closed: no answer yet
        ("it is 1,234.5 or -7", "last_number", "-7"),
        ("total 1,234 apples", "last_number", "1234"),
        ("no digits", "last_number", None),
    ],
)
def test_answer_formats(completion, answer_format, expected):
    assert extract_answer(completion, answer_format) == expected


ADVERSARIAL = st.one_of(
    st.text(max_size=300),
    st.text(alphabet="\\{}()[]^_$,0123456789+-*/=.a fracsqrtboxed", max_size=300),
    st.sampled_from(
        [
            "\\boxed{" * 200,
            "{" * 5000 + "}" * 4999,
            "10^{10^{10^{10}}}",
            "9" * 5000,
            "\\frac{" * 300,
            "(" * 1000,
            "x" * 100_000,
            "\x00\udcff",
            "1e999999",
            "\\sqrt{-1}^{\\infty}",
        ]
    ),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    answer=ADVERSARIAL,
    gold=ADVERSARIAL,
    name=st.sampled_from(sorted(VERIFIERS)),
    answer_format=st.sampled_from(["r1_zero", "answer_tags", "boxed", "last_number"]),
)
def test_never_raises_and_returns_within_its_bound(answer, gold, name, answer_format):
    term = reward_term(
        name, None, 1.0, {"pattern": "gold"} if name == "regex" else {}, 0.5 if name in ("math", "regex") else None
    )
    start = time.perf_counter()
    extracted = extract_answer(answer, answer_format)
    value, error = term.score(Sample(answer, gold, "q", "id", answer if extracted is None else extracted, False))
    assert value in (0.0, 1.0) and error is None
    assert time.perf_counter() - start < 5.0  # 0.5 s bound, plus a worker's start-up after a kill


@pytest.mark.parametrize(
    "text",
    [
        "<answer>" * 12_500,
        "\\boxed{" * 14_000,
        "\\fbox{" * 16_000,
        "{" * 100_000,
        "\\boxed " * 14_000,
        "\\boxed{1}" * 10_000,
        "1," * 50_000,
        "<think>" * 14_000,
    ],
)
def test_answer_extraction_is_linear_on_long_adversarial_completions(text):
    start = time.perf_counter()
    for answer_format in ("r1_zero", "answer_tags", "boxed", "last_number"):
        extract_answer(text, answer_format)
    assert time.perf_counter() - start < 1.0  # a quadratic scan takes minutes here
