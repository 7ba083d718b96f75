"""Grading code by running it in the code sandbox (``grpolab.tools.code_sandbox``), two ways:

* **Values compared outside** (``grade_by_values``, the training problems): the sandboxed program defines the
  completion's function, calls it on each test's input (each under its own time limit) and prints what it
  returned; this process, outside the sandbox, compares each returned value with the expected one it alone
  holds. Code that prints forged results, exits early or patches the harness gains nothing: a test passes
  only when its value equals the expected one, which the sandbox never sees. Reward: the share of tests passed
  (``partial``) or 1 when all pass (``all``).
* **The problem's own check** (``grade_by_check``, HumanEval): the completion, the problem's ``check`` function
  and a call of it run together, as HumanEval's own harness does; a pass is a clean exit that printed this
  call's random token after ``check`` returned. This trusts code in the candidate's process (it could read the
  token by introspection and print it), which is acceptable for an evaluation set the policy is never trained
  on, and is why training uses values compared outside.

A sandbox that could not run the program is an infrastructure failure (``Grade.failed_as("sandbox", ...)``),
never a zero; a program that times out, is killed or prints past the cap failed its tests.
"""

from __future__ import annotations

import ast
import json
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from grpolab.tasks.base import Grade
from grpolab.tools.code_sandbox import CodeRun, CodeSandbox

NOT_PYTHON = ("SyntaxError", "IndentationError", "TabError")  # a program that did not even compile
_FENCE = re.compile(r"```(?:python|py)?\s*\n(.*?)(?:```|$)", re.DOTALL)


@dataclass(frozen=True)
class ValueTests:
    """A function's tests as inputs and expected values: ``inputs[i]`` (a tuple of arguments, literals only) must
    give ``expected[i]``."""

    entry_point: str
    inputs: tuple[tuple[Any, ...], ...]
    expected: tuple[Any, ...]


def program_text(prompt: str, completion: str) -> str:
    """The program a completion makes. With a fenced code block (a chat answer): the prompt (its imports,
    helpers, and the function with its docstring only, a complete definition) and then the block, which
    redefines the function. Else the prompt followed by the completion as the function's body, up to its
    first line that is not indented (what follows the function, a stop string included, is not the body)."""
    fenced = _FENCE.search(completion)
    if fenced:
        return f"{prompt}\n{fenced.group(1)}"
    lines = completion.split("\n")
    body = [lines[0]]
    for line in lines[1:]:
        if line.strip() and not line[0].isspace():
            break
        body.append(line)
    return prompt + "\n".join(body) + "\n"


def values_program(program: str, tests: ValueTests, token: str, test_seconds: float) -> str:
    """The sandboxed program of ``grade_by_values``: the completion's program, then each test's call under its
    own alarm, one line ``TOKEN INDEX repr(value)`` per test that returned (a raised error prints nothing)."""
    harness = f"""

def __grpolab_tests():
    import signal as _signal
    _signal.signal(_signal.SIGALRM, lambda *_: (_ for _ in ()).throw(TimeoutError()))
    for _index, _args in enumerate({list(tests.inputs)!r}):
        try:
            _signal.setitimer(_signal.ITIMER_REAL, {test_seconds!r})
            _value = {tests.entry_point}(*_args)
            _signal.setitimer(_signal.ITIMER_REAL, 0)
            print({token!r}, _index, repr(_value), flush=True)
        except BaseException:
            _signal.setitimer(_signal.ITIMER_REAL, 0)

__grpolab_tests()
"""
    return program + harness


def passed_values(stdout: str, tests: ValueTests, token: str) -> list[bool]:
    """Which tests returned their expected value: the first line of each test's index (a line whose value is
    not a Python literal passes nothing)."""
    seen: dict[int, Any] = {}
    for line in stdout.splitlines():
        parts = line.split(" ", 2)
        if len(parts) != 3 or parts[0] != token or not parts[1].isdigit():
            continue
        index = int(parts[1])
        if index in seen or index >= len(tests.expected):
            continue
        try:
            seen[index] = ast.literal_eval(parts[2])
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            seen[index] = _UNREADABLE
    return [index in seen and _same(seen[index], want) for index, want in enumerate(tests.expected)]


_UNREADABLE = object()


def _same(got: Any, want: Any) -> bool:
    """Equal values, of the same kind (``True`` is not ``1``), floats within 1e-9 relative."""
    if isinstance(want, float) and isinstance(got, (int, float)) and not isinstance(got, bool):
        return abs(got - want) <= 1e-9 * max(1.0, abs(want))
    if type(got) is not type(want):
        return False
    if isinstance(want, (list, tuple)):
        return len(got) == len(want) and all(_same(g, w) for g, w in zip(got, want))
    return got == want


def grade_by_values(
    sandbox: CodeSandbox,
    items: Sequence[tuple[str, ValueTests]],
    reward: str = "partial",
    test_seconds: float = 1.0,
) -> list[Grade]:
    """A grade for each (program, tests): ``answer_reward`` the share of tests passed (``reward="partial"``) or
    1 when all pass (``"all"``); ``format_reward`` 1 when the program ran to its end; ``extracted`` says
    ``passed/total``."""
    tokens = [secrets.token_hex(8) for _ in items]
    runs = sandbox.run_many(
        [values_program(program, tests, token, test_seconds) for (program, tests), token in zip(items, tokens)]
    )
    grades = []
    for (_, tests), token, run in zip(items, tokens, runs):
        if run.failed:
            grades.append(Grade.failed_as("sandbox", f"the code sandbox failed: {run.stderr.strip()[-200:]}"))
            continue
        passed = passed_values(run.stdout, tests, token)
        share = sum(passed) / len(passed) if passed else 0.0
        value = share if reward == "partial" else float(all(passed) and bool(passed))
        grades.append(Grade(float(run.status == "ok"), value, extracted=f"{sum(passed)}/{len(passed)} tests"))
    return grades


def check_program(program: str, test: str, entry_point: str, token: str) -> str:
    """The sandboxed program of ``grade_by_check``: the completion's program, the problem's test code, its
    ``check`` of the entry point, then this call's token."""
    return f"{program}\n\n{test}\n\ncheck({entry_point})\nprint({token!r})\n"


def grade_by_check(sandbox: CodeSandbox, items: Sequence[tuple[str, str, str]]) -> list[Grade]:
    """A grade for each (program, test code, entry point): 1 when ``check`` passed (a clean exit that printed
    the call's token after it), else 0; ``format_reward`` 1 when the program compiled; ``extracted`` the error's
    last line, or "passed"."""
    tokens = [secrets.token_hex(8) for _ in items]
    runs = sandbox.run_many([check_program(p, t, e, token) for (p, t, e), token in zip(items, tokens)])
    return [_check_grade(run, token) for run, token in zip(runs, tokens)]


def _check_grade(run: CodeRun, token: str) -> Grade:
    if run.failed:
        return Grade.failed_as("sandbox", f"the code sandbox failed: {run.stderr.strip()[-200:]}")
    passed = run.status == "ok" and token in run.stdout.splitlines()
    why = "passed" if passed else (run.stderr.strip().splitlines() or [run.status])[-1][:200]
    return Grade(float(not why.startswith(NOT_PYTHON)), float(passed), extracted=why)


def literal(value: Any) -> Any:
    """``value`` after a round trip through its repr (a tuple stays a tuple, JSON would make it a list)."""
    return ast.literal_eval(repr(value))


def dumps(tests: ValueTests) -> str:
    """``tests`` as JSON-safe text for an example's answer field (reprs of the literals)."""
    return json.dumps(
        {"entry_point": tests.entry_point, "inputs": repr(tests.inputs), "expected": repr(tests.expected)}
    )


def loads(text: str) -> ValueTests:
    """The inverse of ``dumps``."""
    data = json.loads(text)
    return ValueTests(data["entry_point"], ast.literal_eval(data["inputs"]), ast.literal_eval(data["expected"]))
