"""Built-in multi-step arithmetic task: column addition with a short chain of thought.

A question is ``"57+38"``; the worked completion adds the columns from the right, carrying:

    " 7+8=15 5+3+1=9 </think> <answer> 95 </answer>"

Every column after the first lists its carry (``+0`` when there is none), so each step has the
same shape. Problems are drawn without repetition from a seeded RNG; the validation split is drawn
first, so changing ``n_train`` never changes the validation set.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from pydantic import Field

from grpolab.tasks.base import Example, Grade, Task, TaskSettings
from grpolab.tasks.r1_zero import grade_r1_zero, r1_zero_prompt


def column_addition_solution(operands: list[int]) -> str:
    """Worked r1_zero completion (text after ``<think>``) for the sum of ``operands``."""
    width = max(len(str(n)) for n in operands)
    steps: list[str] = []
    carry = 0
    for col in range(width):
        terms = [n // 10**col % 10 for n in operands if col < len(str(n))]
        if col > 0:
            terms.append(carry)
        total = sum(terms)
        steps.append("+".join(map(str, terms)) + f"={total}")
        carry = total // 10
    return f" {' '.join(steps)} </think> <answer> {sum(operands)} </answer>"


@dataclass(frozen=True)
class ArithmeticTask(Task):
    """Sum ``operands`` numbers of exactly ``digits`` digits each, in the r1_zero format.

    Args:
        n_train: number of training problems.
        n_val: number of validation problems (disjoint question strings from train).
        seed: RNG seed; the same arguments always give the same problems.
        digits: digits per operand (difficulty: number of columns).
        operands: numbers per problem (difficulty: terms per column, size of carries).
    """

    n_train: int = 4000
    n_val: int = 500
    seed: int = 0
    digits: int = 2
    operands: int = 2
    name: str = field(default="arithmetic", init=False)

    def __post_init__(self) -> None:
        if self.digits < 1 or self.operands < 2 or self.n_train < 0 or self.n_val < 0:
            raise ValueError("need digits >= 1, operands >= 2, n_train >= 0, n_val >= 0")
        space = (9 * 10 ** (self.digits - 1)) ** self.operands
        if self.n_train + self.n_val > space:
            raise ValueError(f"only {space} distinct problems; asked for {self.n_train + self.n_val}")
        val, train = self._generate()
        object.__setattr__(self, "_val", val)
        object.__setattr__(self, "_train", train)

    def _generate(self) -> tuple[list[Example], list[Example]]:
        rng = random.Random(f"arithmetic-{self.seed}-{self.digits}-{self.operands}")
        low, high = 10 ** (self.digits - 1), 10**self.digits - 1
        seen: set[str] = set()
        problems: list[list[int]] = []
        while len(problems) < self.n_val + self.n_train:
            operands = [rng.randint(low, high) for _ in range(self.operands)]
            question = "+".join(map(str, operands))
            if question not in seen:
                seen.add(question)
                problems.append(operands)

        def make(split: str, index: int, operands: list[int]) -> Example:
            return Example(
                id=f"arithmetic-{split}-{index}",
                question="+".join(map(str, operands)),
                answer=str(sum(operands)),
                solution=column_addition_solution(operands),
            )

        val = [make("val", i, p) for i, p in enumerate(problems[: self.n_val])]
        train = [make("train", i, p) for i, p in enumerate(problems[self.n_val :])]
        return val, train

    def train_examples(self) -> list[Example]:
        """Training problems with worked solutions (a fresh list each call)."""
        return list(self._train)  # type: ignore[attr-defined]

    def validation_examples(self) -> list[Example]:
        """Validation problems (a fresh list each call)."""
        return list(self._val)  # type: ignore[attr-defined]

    def prompt(self, example: Example) -> str:
        """The r1_zero prompt for ``example``."""
        return r1_zero_prompt(example.question)

    def grade(self, completion: str, example: Example, truncated: bool) -> Grade:
        """r1_zero grading against the exact sum."""
        return grade_r1_zero(completion, example.answer, truncated, symbolic=False)  # '57+38' must not count


class ArithmeticTaskConfig(TaskSettings):
    """The built-in task: multi-digit addition with a worked chain of thought."""

    name: Literal["arithmetic"] = Field("arithmetic", description="the built-in addition task")
    n_train: int = Field(4000, ge=1, description="training problems")
    n_val: int = Field(500, ge=1, description="held-out validation problems")
    seed: int = Field(0, description="data seed, separate from the run seed so runs share their data")
    digits: int = Field(2, ge=1, description="digits per operand")
    operands: int = Field(2, ge=2, description="numbers per problem")

    FILES: ClassVar[tuple[str, ...]] = ()  # fields naming data files (the suite snapshot copies them)

    def build(self) -> ArithmeticTask:
        return ArithmeticTask(**self.model_dump(exclude={"name"}))
