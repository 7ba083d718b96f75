"""A task class of a user's own, loaded by import path (``task.name = "custom_task:CountdownTask"``)."""

from __future__ import annotations

from grpolab.tasks import ArithmeticTask
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
        return self.examples[len(self.examples) // 2 :]

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


class ArithmeticWithBlanks:
    """The built-in arithmetic task, except that the training examples whose ids are in ``blank`` score 0
    whatever the completion (a step drawing only those has no signal), and that grading ``crash_on`` in
    the process of torchrun rank ``crash_rank`` ends that process mid-step: ``crash = "raise"`` raises
    an error nothing catches, ``"kill"`` dies at once as the kernel's OOM killer would do it."""

    name = "arithmetic_with_blanks"

    def __init__(
        self,
        blank: list[str] = (),
        crash_on: str | None = None,
        crash_rank: int = 1,
        crash: str = "raise",
        **arithmetic,
    ):
        from grpolab.tasks import ArithmeticTask

        self.inner, self.blank = ArithmeticTask(**arithmetic), set(blank)
        self.crash_on, self.crash_rank, self.crash = crash_on, str(crash_rank), crash

    def train_examples(self) -> list[Example]:
        return self.inner.train_examples()

    def validation_examples(self) -> list[Example]:
        return self.inner.validation_examples()

    def prompt(self, example: Example) -> str:
        return self.inner.prompt(example)

    def grade(self, completion: str, example: Example, truncated: bool) -> Grade:
        import os
        import signal

        if example.id == self.crash_on and os.environ.get("RANK") == self.crash_rank:
            if self.crash == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise SystemExit(f"rank {self.crash_rank}: the grader crashed on {example.id}")
        grade = self.inner.grade(completion, example, truncated)
        return Grade(0.0, 0.0, extracted=grade.extracted) if example.id in self.blank else grade


class DigitShare(ArithmeticTask):
    """The built-in arithmetic task graded by the share of digits in the completion: a signal that even an
    untrained model's completions vary in (for tests of the update's plumbing on random models)."""

    name = "digit_share"

    def grade(self, completion: str, example: Example, truncated: bool) -> Grade:
        return Grade(1.0, sum(c.isdigit() for c in completion) / max(len(completion), 1))
