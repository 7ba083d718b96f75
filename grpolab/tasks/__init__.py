"""Tasks: data + prompt + reward. Each built-in kind declares its settings class beside its task
(``arithmetic``, ``gsm8k``, ``calculator``, ``chat_arithmetic``, ``dataset``); ``configs`` registers
them as the ``[task]`` union (``"package.module:Class"`` is a task class of your own). Around them:
answers and verifiers (``answers``, ``extract``, ``rewards``, ``sandbox``), prompts (``prompts``,
``r1_zero``), data files (``datasets``), reward shaping (``shaping``) and the seeded stream of training
examples (``stream``).

May import: ``grpolab.tools``, ``grpolab.objectives``, ``grpolab.parallel``, ``grpolab.common``.
"""

from __future__ import annotations

from pathlib import PurePath
from typing import Any

from grpolab.tasks.arithmetic import ArithmeticTask, column_addition_solution
from grpolab.tasks.base import Example, Grade, Task
from grpolab.tasks.configs import BUILT_IN, TaskConfig, build_task
from grpolab.tasks.gsm8k import GSM8KTask
from grpolab.tasks.r1_zero import (
    R1_ZERO_TEMPLATE,
    grade_r1_zero,
    parse_r1_zero,
    r1_zero_prompt,
)


def make_task(name: str, **kwargs: Any) -> Task:
    """A task by name and settings, e.g. ``make_task("arithmetic", digits=3)`` (``build_task`` of that table)."""
    return build_task({"name": name, **{k: str(v) if isinstance(v, PurePath) else v for k, v in kwargs.items()}})


__all__ = [
    "BUILT_IN",
    "R1_ZERO_TEMPLATE",
    "ArithmeticTask",
    "Example",
    "GSM8KTask",
    "Grade",
    "Task",
    "TaskConfig",
    "build_task",
    "column_addition_solution",
    "grade_r1_zero",
    "make_task",
    "parse_r1_zero",
    "r1_zero_prompt",
]
