"""A task class of a user's own, loaded by import path (``task.name = "custom_task:CountdownTask"``)."""

from __future__ import annotations

from grpolab.tasks.base import Example, Grade
from grpolab.tasks.extract import extract_answer


class CountdownTask:
    """Subtract 1 from a number: ``n`` problems, the first ``n // 2`` for training. Follows the Task
    contract and nothing else: no grpolab package change needed."""

    name = "countdown"

    def __init__(self, n: int = 10, raise_on: str | None = None):
        self.raise_on = raise_on
        self.examples = [Example(id=f"c{i}", question=f"{i + 2}-1", answer=str(i + 1)) for i in range(n)]

    def train_examples(self) -> list[Example]:
        return self.examples[: len(self.examples) // 2]

    def validation_examples(self) -> list[Example]:
        return self.examples[len(self.examples) // 2:]

    def prompt(self, example: Example) -> str:
        return f"{example.question}=<think>"

    def grade(self, completion: str, example: Example, truncated: bool) -> Grade:
        if self.raise_on is not None and self.raise_on in completion:
            raise RuntimeError("a bug in the user's grader")
        answer = extract_answer(completion, "answer_tags")
        ok = answer is not None and not truncated
        return Grade(float(ok), float(ok and answer == example.answer), extracted=answer)


class NotATask:
    name = "half"

    def train_examples(self) -> list[Example]:
        return []
