"""What a task is: data + prompt template + reward function.

A task hands out fixed train/validation examples, turns an example into a prompt string and grades
a sampled completion. Rewards are plain floats in [0, 1]; the RL reward is the answer reward, the
format reward is reported separately.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class Example:
    """One problem.

    Attributes:
        id: stable identifier, unique within the task.
        question: the text inserted into the prompt template.
        answer: gold final answer string (compared after normalisation).
        solution: a worked completion in the task's completion format (for r1_zero tasks the text
            that follows ``<think>``), used for supervised warm start; None when unknown.
    """

    id: str
    question: str
    answer: str
    solution: str | None = None


@dataclass(frozen=True)
class Grade:
    """Reward components of one completion.

    ``format_reward`` (1.0 when the completion has the required structure) is logged only;
    ``answer_reward`` (1.0 when the final answer is correct) is the RL reward. ``extracted`` is the
    answer the grader read from the completion (None when it found none), for evaluation records;
    it takes no part in comparisons.
    """

    format_reward: float
    answer_reward: float
    extracted: str | None = field(default=None, compare=False)

    @property
    def reward(self) -> float:
        """The scalar reward used for RL (the answer reward)."""
        return self.answer_reward


@runtime_checkable
class Task(Protocol):
    """A verifiable-reward task.

    Implementations must be deterministic: the same construction arguments give the same examples
    in the same order, and ``grade`` is a pure function that never raises.
    """

    name: str

    def train_examples(self) -> list[Example]:
        """Examples used for rollouts (and for the warm start)."""
        ...

    def validation_examples(self) -> list[Example]:
        """Held-out examples for evaluation; no question is shared with the train split."""
        ...

    def prompt(self, example: Example) -> str:
        """The full prompt string the model continues."""
        ...

    def grade(self, completion: str, example: Example, truncated: bool) -> Grade:
        """Grade ``completion`` (the generated text after the prompt, special tokens removed).

        ``truncated`` is True when generation stopped at the token limit instead of at EOS/stop.
        """
        ...
