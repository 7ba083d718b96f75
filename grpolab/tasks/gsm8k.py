"""GSM8K grade-school math in the r1_zero format, from local copies of the official files.

Each official row has ``question`` and ``answer``; the answer is a rationale with ``<<48/2=24>>``
calculator annotations, ending in a line ``#### 72``. The gold answer is that number with commas
removed; the worked solution (for a supervised warm start) is the rationale without annotations:

    " Natalia sold 48/2 = 24 clips in May. ... </think> <answer> 72 </answer>"

The train split is the first ``n_train`` rows of the train file and the validation split the first
``n_val`` rows of the test file (the reference runs use 6,400 and 1,024). Example ids are
``train-<row>`` and ``test-<row>``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field

from grpolab.tasks.answers import plain_number
from grpolab.tasks.base import Example, Grade, Task, TaskSettings
from grpolab.tasks.datasets import DataError, first_n, load_source, rows_sha256, text_sha256
from grpolab.tasks.r1_zero import R1_ZERO_TEMPLATE, grade_r1_zero, r1_zero_prompt
from grpolab.tools.protocol import ToolsConfig, Toolset

FINAL_ANSWER_MARK = "####"
_CALCULATOR_ANNOTATION = re.compile(r"<<[^<>]*>>")


def split_gsm8k_answer(answer: str) -> tuple[str, str]:
    """(rationale without calculator annotations, gold number without commas).

    Raises DataError when there is no ``#### N`` or N is not a plain number.
    """
    rationale, mark, final = answer.rpartition(FINAL_ANSWER_MARK)
    gold = final.strip().replace(",", "")
    if not mark or plain_number(gold) is None:
        raise DataError(f"answer does not end in '{FINAL_ANSWER_MARK} <number>': ...{answer[-60:]!r}")
    return _CALCULATOR_ANNOTATION.sub("", rationale).strip(), gold


def r1_zero_solution(rationale: str, gold: str) -> str:
    """The worked completion that follows ``<think>``: ``" {rationale} </think> <answer> {gold} </answer>"``."""
    return f" {rationale} </think> <answer> {gold} </answer>"


def gsm8k_examples(rows: list[dict[str, str]], split: str, source: str) -> list[Example]:
    """Examples ``{split}-{index}`` from ``{"question", "answer"}`` rows."""
    examples = []
    for index, row in enumerate(rows):
        try:
            rationale, gold = split_gsm8k_answer(row["answer"])
        except DataError as err:
            raise DataError(f"{source}: row {index}: {err}") from None
        examples.append(
            Example(
                id=f"{split}-{index}", question=row["question"], answer=gold, solution=r1_zero_solution(rationale, gold)
            )
        )
    return examples


@dataclass(frozen=True)
class GSM8KTask(Task):
    """GSM8K from local ``.jsonl`` (or ``.parquet``) copies of the official train and test files.

    Args:
        train_path: the train file (7,473 rows officially), or ``hub:openai/gsm8k:main:train``.
        test_path: the test file (1,319 rows); its first ``n_val`` rows are the validation split.
        n_train: take the first ``n_train`` train rows (None = all).
        n_val: take the first ``n_val`` test rows (None = all).
        question_field, answer_field: field names in the files.
        toolset: tools the model may call (the prompt says how); None = single-turn.
    """

    train_path: str | Path
    test_path: str | Path
    n_train: int | None = None
    n_val: int | None = None
    question_field: str = "question"
    answer_field: str = "answer"
    toolset: Toolset | None = None
    name: str = field(default="gsm8k", init=False)

    def __post_init__(self) -> None:
        splits = {}
        for split, path, n in (("train", self.train_path, self.n_train), ("test", self.test_path, self.n_val)):
            rows = first_n(load_source(path, self.question_field, self.answer_field), n, source=str(path))
            splits[split] = (rows, gsm8k_examples(rows, split, str(path)))
        object.__setattr__(self, "_splits", splits)

    def train_examples(self) -> list[Example]:
        """The first ``n_train`` train rows (a fresh list each call)."""
        return list(self._splits["train"][1])  # type: ignore[attr-defined]

    def validation_examples(self) -> list[Example]:
        """The first ``n_val`` test rows (a fresh list each call)."""
        return list(self._splits["test"][1])  # type: ignore[attr-defined]

    def prompt(self, example: Example) -> str:
        """The r1_zero prompt for ``example`` (with the tool instruction when there are tools)."""
        return r1_zero_prompt(example.question, self.toolset.instruction() if self.toolset else "")

    def grade(self, completion: str, example: Example, truncated: bool) -> Grade:
        """r1_zero grading (format and answer rewards) against the gold number."""
        return grade_r1_zero(completion, example.answer, truncated)

    def data_fingerprint(self) -> dict[str, Any]:
        """Row counts and SHA-256s of the rows used and of the prompt template, for the run record."""
        train_rows, val_rows = self._splits["train"][0], self._splits["test"][0]  # type: ignore[attr-defined]
        return {
            "task": self.name,
            "train_rows": len(train_rows),
            "train_sha256": rows_sha256(train_rows),
            "validation_rows": len(val_rows),
            "validation_sha256": rows_sha256(val_rows),
            "prompt_template_sha256": text_sha256(
                R1_ZERO_TEMPLATE if self.toolset is None else r1_zero_prompt("{question}", self.toolset.instruction())
            ),
        }


class GSM8KTaskConfig(TaskSettings):
    """GSM8K from local copies of the official files (the first n rows, as the reference runs)."""

    name: Literal["gsm8k"] = Field("gsm8k", description="GSM8K from local JSONL files")
    train_path: str = Field(description="the train split's JSONL file (data/gsm8k/ holds the official ones)")
    test_path: str = Field(description="the test split's JSONL file; its first n_val rows validate")
    n_train: int | None = Field(6400, ge=1, description="first N train rows (None = all)")
    n_val: int | None = Field(1024, ge=1, description="first M test rows as validation (None = all)")
    question_field: str = Field("question", description="the rows' question field")
    answer_field: str = Field("answer", description="the rows' solution field (the gold answer after '####')")
    tools: ToolsConfig = Field(
        default_factory=ToolsConfig,
        description='e.g. {enabled = ["calculator"]}: the prompt says how to call them, rollouts run them',
    )

    FILES: ClassVar[tuple[str, ...]] = ("train_path", "test_path")

    def build(self) -> GSM8KTask:
        return GSM8KTask(**self.model_dump(exclude={"name", "tools"}), toolset=self.tools.build())
