"""Built-in tool task: ``a*b+c`` with two-digit numbers, where a calculator makes the difference.

The products are beyond the tiny demo model's mental arithmetic, so the way to be right is to call
the calculator with the expression and copy its result into the answer. The worked solutions (the
supervised warm start's demonstrations) call it in a share ``tool_demos`` of the problems and
answer directly in the others, so the warm-started policy sometimes calls and sometimes guesses:
RL has to learn that calling pays. A tool-using solution, after the r1_zero ``<think>``:

    ' <tool_call>{"name": "calculator", "arguments": {"expression": "37*24+15"}}</tool_call>'
    '<tool_response>903</tool_response> </think> <answer> 903 </answer>'

Only the first line is the policy's: the observation is the tool's, and the warm start, like RL,
trains on the policy's text alone (``Toolset.segments``). Problems are drawn without repetition
from a seeded RNG, validation first (as in the arithmetic task).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from pydantic import Field, field_validator

from grpolab.tasks.base import Example, Grade, Task, TaskSettings
from grpolab.tasks.r1_zero import grade_r1_zero, r1_zero_prompt
from grpolab.tools.calculator import calculate
from grpolab.tools.protocol import ToolsConfig, Toolset


def tool_note(toolset: Toolset) -> str:
    """A one-line tool instruction, short enough for the tiny model's context (``Toolset.instruction``
    describes every tool in full)."""
    open_, close = toolset.call_tags
    return f'To compute, call {open_}{{"name": "calculator", "arguments": {{"expression": "..."}}}}{close}.\n'


def tool_solution(toolset: Toolset, expression: str, answer: str) -> str:
    """The worked completion that calls the calculator on ``expression`` and answers with its result."""
    call = json.dumps({"name": "calculator", "arguments": {"expression": expression}})
    open_, close = toolset.call_tags
    return f" {open_}{call}{close}{toolset.observation(calculate(expression))} </think> <answer> {answer} </answer>"


@dataclass(frozen=True)
class CalculatorTask(Task):
    """``a*b+c`` problems (each number of ``digits`` digits) answered with the calculator's help.

    Args:
        n_train, n_val: problem counts (disjoint questions).
        seed: data seed.
        digits: digits per number.
        tool_demos: share of the worked solutions that call the calculator (the others answer directly).
        toolset: the tools and protocol (default: the calculator, 3 turns).
    """

    n_train: int = 4000
    n_val: int = 500
    seed: int = 0
    digits: int = 2
    tool_demos: float = 0.8
    toolset: Toolset = field(default_factory=lambda: Toolset(["calculator"], max_turns=3))
    name: str = field(default="calculator", init=False)
    # copying the tool's result into the answer is learnt late (between 200 and 300 supervised steps)
    warm_start_overrides = {"steps": 300}

    def __post_init__(self) -> None:
        if "calculator" not in self.toolset.tools:
            raise ValueError("the calculator task needs the calculator tool")
        if not 0 <= self.tool_demos <= 1:
            raise ValueError("tool_demos is a share in [0, 1]")
        rng = random.Random(f"calculator-{self.seed}-{self.digits}")
        low, high = 10 ** (self.digits - 1), 10**self.digits - 1
        if self.n_train + self.n_val > (high - low + 1) ** 3:
            raise ValueError(f"not enough distinct problems for {self.n_train + self.n_val}")
        seen: dict[str, None] = {}
        while len(seen) < self.n_val + self.n_train:
            seen.setdefault(f"{rng.randint(low, high)}*{rng.randint(low, high)}+{rng.randint(low, high)}")
        questions = list(seen)

        def make(split: str, index: int, question: str) -> Example:
            answer = calculate(question)
            direct = f" </think> <answer> {answer} </answer>"
            uses_tool = rng.random() < self.tool_demos
            return Example(
                id=f"calculator-{split}-{index}",
                question=question,
                answer=answer,
                solution=tool_solution(self.toolset, question, answer) if uses_tool else direct,
            )

        object.__setattr__(self, "_val", [make("val", i, q) for i, q in enumerate(questions[: self.n_val])])
        object.__setattr__(self, "_train", [make("train", i, q) for i, q in enumerate(questions[self.n_val :])])

    def train_examples(self) -> list[Example]:
        return list(self._train)  # type: ignore[attr-defined]

    def validation_examples(self) -> list[Example]:
        return list(self._val)  # type: ignore[attr-defined]

    def prompt(self, example: Example) -> str:
        """The r1_zero prompt with a one-line tool instruction."""
        return r1_zero_prompt(example.question, tool_note(self.toolset))

    def prompt_template(self) -> str:
        return r1_zero_prompt("{question}", tool_note(self.toolset))

    def grade(self, completion: str, example: Example, truncated: bool) -> Grade:
        """r1_zero grading of the whole trajectory against the exact value (observations hold no answer tags)."""
        return grade_r1_zero(completion, example.answer, truncated, symbolic=False)


class CalculatorTaskConfig(TaskSettings):
    """The built-in tool task: a*b+c with two-digit numbers, the calculator at hand."""

    name: Literal["calculator"] = Field("calculator", description="the built-in tool task")
    n_train: int = Field(4000, ge=1, description="training problems")
    n_val: int = Field(500, ge=1, description="held-out validation problems")
    seed: int = Field(0, description="data seed, separate from the run seed so runs share their data")
    digits: int = Field(2, ge=1, le=4, description="digits per number")
    tool_demos: float = Field(
        0.8,
        ge=0,
        le=1,
        description="share of the warm start's demonstrations that call the calculator (the others answer directly)",
    )
    tools: ToolsConfig = Field(
        default_factory=lambda: ToolsConfig(enabled=["calculator"], max_turns=3),
        description="the tools the model may call (the calculator among them)",
    )

    FILES: ClassVar[tuple[str, ...]] = ()

    @field_validator("tools")
    @classmethod
    def _has_calculator(cls, value: ToolsConfig) -> ToolsConfig:
        if "calculator" not in value.enabled:
            raise ValueError("the calculator task needs tools.enabled to include 'calculator'")
        return value

    def build(self) -> CalculatorTask:
        return CalculatorTask(**self.model_dump(exclude={"name", "tools"}), toolset=self.tools.build())
