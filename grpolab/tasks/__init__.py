"""Tasks: data + prompt template + reward function."""

from __future__ import annotations

from typing import Any

from grpolab.tasks.arithmetic import ArithmeticTask, column_addition_solution
from grpolab.tasks.base import Example, Grade, Task
from grpolab.tasks.gsm8k import GSM8KTask
from grpolab.tasks.r1_zero import (
    R1_ZERO_TEMPLATE,
    grade_r1_zero,
    parse_r1_zero,
    r1_zero_prompt,
)

TASKS: dict[str, type] = {"arithmetic": ArithmeticTask, "gsm8k": GSM8KTask}


def make_task(name: str, **kwargs: Any) -> Task:
    """Build a registered task by name, e.g. ``make_task("arithmetic", digits=3)``."""
    if name not in TASKS:
        raise KeyError(f"unknown task {name!r}; known: {sorted(TASKS)}")
    return TASKS[name](**kwargs)


__all__ = [
    "R1_ZERO_TEMPLATE",
    "TASKS",
    "ArithmeticTask",
    "GSM8KTask",
    "Example",
    "Grade",
    "Task",
    "column_addition_solution",
    "grade_r1_zero",
    "make_task",
    "parse_r1_zero",
    "r1_zero_prompt",
]
