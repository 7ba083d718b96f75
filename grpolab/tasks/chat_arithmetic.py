"""Built-in task for real instruct models: small arithmetic asked in the model's own chat template.

A question is ``"7 * 8"``; the prompt is the tokenizer's chat template over one user message,
``"What is 7 * 8? End your reply with: The answer is <number>."`` (and an optional system message),
with the generation prompt appended. The completion must state ``The answer is N`` (the last such
phrase counts, ``final answer is`` too): that is the format; the answer is correct when N is the
exact result. A truncated completion (it hit ``max_new_tokens``) gets neither.

It is made for a 135M instruct model on a CPU (SmolLM2-135M-Instruct): such a model knows its
single-digit tables well enough when it writes out ``7 * 8 = 56``, but rarely ends in the asked form,
and it writes the wrong number when forced to answer at once; RL has something to sharpen. Every
problem ``a op b`` with ``low <= a, b <= high`` is enumerated, shuffled by ``seed`` and split:
validation first, so changing ``n_train`` never changes it, and in whole commutative pairs (``3 * 7``
and ``7 * 3`` on the same side).
"""

from __future__ import annotations

import operator
import random
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from pydantic import Field

from grpolab.tasks.base import Example, Grade, Task, TaskSettings
from grpolab.tasks.datasets import text_sha256
from grpolab.tasks.prompts import PromptBuilder

OPERATIONS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
INSTRUCTION = "What is {question}? End your reply with: The answer is <number>."
_ANSWER = re.compile(r"answer is:?\s*\**\s*\$?(-?\d[\d,]*)", re.IGNORECASE)


def stated_answer(completion: str) -> str | None:
    """The N of the last ``answer is N`` in ``completion`` (commas removed), or None."""
    found = _ANSWER.findall(completion)
    return found[-1].replace(",", "") if found else None


@dataclass(frozen=True)
class ChatArithmeticTask(Task):
    """``a op b`` for every ``op`` in ``operations`` and ``low <= a, b <= high`` (``-``: only a >= b),
    as chat prompts; ``n_val`` of them for validation, the next ``n_train`` (None: all the rest) for training."""

    operations: str = "*"
    low: int = 2
    high: int = 9
    n_val: int = 32
    n_train: int | None = None
    seed: int = 0
    system: str | None = None
    name: str = field(default="chat_arithmetic", init=False)

    def __post_init__(self) -> None:
        if not self.operations or any(op not in OPERATIONS for op in self.operations):
            raise ValueError(f"operations must be made of {''.join(OPERATIONS)}, got {self.operations!r}")
        val, rest = self._split()
        n_train = len(rest) if self.n_train is None else self.n_train
        if n_train < 1 or n_train > len(rest):
            raise ValueError(
                f"{len(val) + len(rest)} distinct problems for operations {self.operations!r} in "
                f"[{self.low}, {self.high}]: cannot take {self.n_val} for validation and {n_train} to train"
            )

        def make(split: str, index: int, a: int, op: str, b: int) -> Example:
            return Example(id=f"{split}-{index}", question=f"{a} {op} {b}", answer=str(OPERATIONS[op](a, b)))

        object.__setattr__(self, "_val", [make("val", i, *p) for i, p in enumerate(val)])
        object.__setattr__(self, "_train", [make("train", i, *p) for i, p in enumerate(rest[:n_train])])
        object.__setattr__(self, "_prompts", PromptBuilder("chat", INSTRUCTION, self.system))

    def _split(self) -> tuple[list[tuple[int, str, int]], list[tuple[int, str, int]]]:
        """(validation, the rest) of every problem, shuffled; ``a + b`` and ``b + a`` (and ``a * b``, ``b * a``)
        always fall on the same side, so that validation never asks a training problem turned around."""
        groups: dict[tuple, list[tuple[int, str, int]]] = {}
        for op in dict.fromkeys(self.operations):
            for a in range(self.low, self.high + 1):
                for b in range(self.low, self.high + 1):
                    if op != "-" or a >= b:
                        key = (op, min(a, b), max(a, b)) if op != "-" else (op, a, b)
                        groups.setdefault(key, []).append((a, op, b))
        order = list(groups.values())
        random.Random(f"chat-arithmetic-{self.seed}").shuffle(order)
        val: list[tuple[int, str, int]] = []
        for group in order:  # whole groups while they fit; single problems (a = b) fill the count exactly
            if len(val) + len(group) <= self.n_val:
                val += group
        if len(val) != self.n_val:
            raise ValueError(f"cannot take exactly {self.n_val} validation problems in whole commutative pairs")
        taken = set(val)
        return val, [p for group in order for p in group if p not in taken]

    def train_examples(self) -> list[Example]:
        return list(self._train)  # type: ignore[attr-defined]

    def validation_examples(self) -> list[Example]:
        return list(self._val)  # type: ignore[attr-defined]

    def bind_tokenizer(self, tokenizer: Any) -> None:
        """The model's tokenizer, whose chat template renders the prompts (refused when it has none)."""
        self._prompts.bind_tokenizer(tokenizer)  # type: ignore[attr-defined]

    def prompt(self, example: Example) -> str:
        return self._prompts.render({"question": example.question})  # type: ignore[attr-defined]

    def prompt_template(self) -> str:
        return self._prompts.describe()  # type: ignore[attr-defined]

    def data_fingerprint(self) -> dict[str, Any]:
        rows = lambda examples: "\n".join(f"{e.id}\t{e.question}\t{e.answer}" for e in examples)  # noqa: E731
        return {
            "train_rows": len(self._train),
            "validation_rows": len(self._val),  # type: ignore[attr-defined]
            "train_sha256": text_sha256(rows(self._train)),  # type: ignore[attr-defined]
            "validation_sha256": text_sha256(rows(self._val)),  # type: ignore[attr-defined]
            "prompt_template_sha256": text_sha256(self.prompt_template()),
        }

    def grade(self, completion: str, example: Example, truncated: bool) -> Grade:
        """Format: an ``answer is N`` and not truncated; answer: that N equals the exact result."""
        answer = stated_answer(completion)
        if truncated or answer is None:
            return Grade(format_reward=0.0, answer_reward=0.0, extracted=answer)
        return Grade(format_reward=1.0, answer_reward=float(answer == example.answer), extracted=answer)


class ChatArithmeticTaskConfig(TaskSettings):
    """The built-in task for real instruct models: small arithmetic in the model's chat template."""

    name: Literal["chat_arithmetic"] = Field(
        "chat_arithmetic", description="small arithmetic in the model's chat template"
    )
    operations: str = Field("*", description="any of + - * (a - b only with a >= b)")
    low: int = Field(2, ge=0, description="smallest operand")
    high: int = Field(9, ge=0, description="largest operand")
    n_val: int = Field(32, ge=1, description="problems held out for validation")
    n_train: int | None = Field(None, ge=1, description="None = every problem not in validation")
    seed: int = Field(0, description="data seed: which problems validate")
    system: str | None = Field(None, description="a system message (None: the template's default, if any)")

    FILES: ClassVar[tuple[str, ...]] = ()

    def build(self) -> ChatArithmeticTask:
        return ChatArithmeticTask(**self.model_dump(exclude={"name"}))
