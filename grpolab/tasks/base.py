"""What a task is: data + prompt template + reward function.

A task hands out fixed train/validation examples, turns an example into a prompt string and grades
a sampled completion. Rewards are plain floats; the RL reward is the answer reward (or, for tasks
with several weighted rewards, their total), the format reward is reported separately.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict


@dataclass(frozen=True)
class Example:
    """One problem.

    Attributes:
        id: stable identifier, unique within the task.
        question: the text inserted into the prompt template.
        answer: gold final answer string (compared after normalisation).
        solution: a worked completion in the task's completion format (for r1_zero tasks the text
            that follows ``<think>``), used for supervised warm start; None when unknown.
        fields: the data row it came from (for prompt templates and user reward functions); empty
            for generated tasks. Not compared: the id, question and answer identify an example.
    """

    id: str
    question: str
    answer: str
    solution: str | None = None
    fields: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)


@dataclass(frozen=True)
class Grade:
    """Reward components of one completion.

    ``format_reward`` (1.0 when the completion has the required structure) is logged only;
    ``answer_reward`` (1.0 when the final answer is correct) is the task's correctness (accuracy,
    pass@k) and, unless ``total`` is set, the RL reward. ``extracted`` is the answer the grader read
    from the completion (None when it found none), for evaluation records; it takes no part in
    comparisons.

    Tasks with several weighted rewards, and length shaping, set ``components`` (name, unweighted
    value), ``total`` (the RL reward) and ``failed`` (names of reward functions that failed here).
    """

    format_reward: float
    answer_reward: float
    extracted: str | None = field(default=None, compare=False)
    components: tuple[tuple[str, float], ...] = ()
    total: float | None = None
    failed: tuple[str, ...] = ()

    @property
    def reward(self) -> float:
        """The scalar reward used for RL: ``total`` when set, else the answer reward."""
        return self.answer_reward if self.total is None else self.total

    def plus(self, name: str, value: float) -> "Grade":
        """This grade with one more additive component (e.g. a length penalty) in its RL reward."""
        return replace(self, components=self.components + ((name, value),), total=self.reward + value)


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


# Optional members a task may have (looked up with getattr by the trainer, the suite and reports):
#   data_fingerprint() -> dict      row counts and SHA-256s of its data and prompt, for the manifest
#   prompt_template() -> str        how prompts are made, for the suite snapshot
#   bind_tokenizer(tokenizer)       called once the model's tokenizer is loaded, before any prompt
#                                   (chat-template prompts need it)
#   grade_batch(items) -> [Grade]   grade many (completion, example, truncated) at once, e.g. in parallel
#   toolset: grpolab.tools.Toolset  tools the model may call: rollouts become multi-turn
#   warm_start_overrides: dict      WarmStartSettings fields for the demo's tiny model


class TaskSettings(BaseModel):
    """A ``[task]`` table's settings: unknown keys are refused; each task module declares its own
    (``name`` its tag, ``FILES`` the fields naming data files, ``build()`` the task)."""

    model_config = ConfigDict(extra="forbid")

    def nonbinary_rewards(self) -> list[str]:
        """The terms of the RL reward these settings say can take values other than 0 and 1, each named by its
        setting (an objective defined for rewards in {0, 1} refuses them up front). The built-in tasks' reward
        is their correctness: none."""
        return []
