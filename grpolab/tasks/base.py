"""What a task is: data + prompt template + reward function.

A task hands out fixed train/validation examples, turns an example into a prompt string and grades
a sampled completion. Rewards are plain floats; the RL reward is the answer reward (or, for tasks
with several weighted rewards, their total), the format reward is reported separately.
"""

from __future__ import annotations

import logging
import traceback
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict

from grpolab.tasks.reward_model_spec import RewardModelSpec
from grpolab.tools.protocol import Toolset

logger = logging.getLogger(__name__)
_reported: set[str] = set()  # tasks whose grade raised: the first traceback is logged
ANSWER_TERM = "answer_reward"  # the RL reward's one term where a grade has no components (Grade.answer_reward)
ENVIRONMENT_TERM = "environment"  # the failed term of an environment's rollout that raised or timed out
# why a sample failed (``Grade.failure``): its environment's rollout raised, ran out of time, or had a call of the
# policy endpoint fail; a reward term failed on it
FAILURE_KINDS = ("environment", "timeout", "endpoint", "reward", "sandbox")


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

    A failure is a state, never a zero: a grade with a failed term, or of a rollout that failed, has ``failure``,
    the kind (``FAILURE_KINDS``; "reward" where only ``failed`` is given, "environment" where that names
    ``ENVIRONMENT_TERM``), and ``error``, what went wrong. Its rewards are unknown: the sample takes no part in its
    group's advantages or the loss, and is counted (``rollout/failed/<kind>``).
    """

    format_reward: float
    answer_reward: float
    extracted: str | None = field(default=None, compare=False)
    components: tuple[tuple[str, float], ...] = ()
    total: float | None = None
    failed: tuple[str, ...] = ()
    failure: str | None = None
    error: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.failure is None and self.failed:
            kind = "environment" if ENVIRONMENT_TERM in self.failed else "reward"
            object.__setattr__(self, "failure", kind)
        if self.failure is not None and self.failure not in FAILURE_KINDS:
            raise ValueError(f"unknown failure kind {self.failure!r} (known: {', '.join(FAILURE_KINDS)})")

    @classmethod
    def failed_as(cls, kind: str, error: str, terms: tuple[str, ...] = ()) -> Grade:
        """The grade of a sample that failed: no reward, ``kind`` and ``error`` said, ``terms`` failed."""
        return cls(0.0, 0.0, failed=terms, failure=kind, error=error)

    @property
    def ok(self) -> bool:
        """True when the rollout and every reward term succeeded."""
        return self.failure is None

    @property
    def reward(self) -> float:
        """The scalar reward used for RL: ``total`` when set, else the answer reward."""
        return self.answer_reward if self.total is None else self.total

    def plus(self, name: str, value: float) -> Grade:
        """This grade with one more additive component (e.g. a length penalty) in its RL reward."""
        return replace(self, components=self.components + ((name, value),), total=self.reward + value)


class Task(ABC):
    """A verifiable-reward task: the base every task inherits (a task class of your own may too, or be a
    plain class with the same members: ``PlainTask`` gives it the defaults).

    Required: ``name``, ``train_examples``, ``validation_examples``, ``prompt`` and ``grade``.
    Implementations must be deterministic: the same construction arguments give the same examples in
    the same order, and ``grade`` is a pure function that never raises (one that raises is a failed
    sample, kind "reward", counted in ``reward/grade_failed``).

    The other members have defaults a task overrides when it has more to say:

    Attributes:
        toolset: tools the model may call (rollouts become multi-turn); None: single-turn.
        reward_models: reward models scored beside ``grade`` (their weighted terms join the RL reward).
        environment: the ``grpolab.tasks.environment.Environment`` that drives and grades its rollouts
            (an ``EnvironmentTask``); None: the engine samples and ``grade`` grades.
        warm_start_overrides: ``WarmStartSettings`` fields for the demo's tiny model on this task.
    """

    name: str
    toolset: Toolset | None = None
    reward_models: Sequence[RewardModelSpec] = ()
    environment: Any = None  # an Environment (grpolab.tasks.environment, which imports this module)
    warm_start_overrides: Mapping[str, Any] = MappingProxyType({})

    @abstractmethod
    def train_examples(self) -> list[Example]:
        """Examples used for rollouts (and for the warm start)."""

    @abstractmethod
    def validation_examples(self) -> list[Example]:
        """Held-out examples for evaluation; no question is shared with the train split."""

    @abstractmethod
    def prompt(self, example: Example) -> str:
        """The full prompt string the model continues."""

    @abstractmethod
    def grade(self, completion: str, example: Example, truncated: bool) -> Grade:
        """Grade ``completion`` (the generated text after the prompt, special tokens removed).

        ``truncated`` is True when generation stopped at the token limit instead of at EOS/stop.
        """

    def grade_batch(self, items: list[tuple[str, Example, bool]]) -> list[Grade]:
        """``grade`` over (completion, example, truncated) items, in order; a task may grade many at once
        (e.g. in parallel). By default one by one, a grade that raises scoring 0 (``grade_safely``)."""
        return [grade_safely(self, *item) for item in items]

    def bind_tokenizer(self, tokenizer: Any) -> None:
        """Called once the model's tokenizer is loaded, before any prompt (chat-template prompts need it);
        by default nothing."""

    def messages(self, example: Example) -> list[dict[str, str]]:
        """The prompt as chat messages before any chat template (what a reward model's own template
        renders); by default the prompt as one user turn."""
        return [{"role": "user", "content": self.prompt(example)}]

    def prompt_template(self) -> str:
        """How prompts are made, for the suite snapshot; by default the prompt of a question ``{question}``."""
        return self.prompt(Example(id="", question="{question}", answer=""))

    def data_fingerprint(self) -> dict[str, Any] | None:
        """Row counts and SHA-256s of its data and prompt, for the run's manifest (and checked on resume);
        None (the default): the manifest records no data fingerprint."""
        return None


def grade_safely(task: Task, completion: str, example: Example, truncated: bool) -> Grade:
    """``task.grade``, or a failed grade (kind "reward", counted in ``reward/grade_failed``) when it raises: a task
    class of the user's must not end the run. The first traceback per task is logged."""
    try:
        return task.grade(completion, example, truncated)
    except Exception as err:
        if task.name not in _reported:
            _reported.add(task.name)
            logger.warning(
                "task %r: grade raised on item %s (the sample is failed; later failures are only counted in "
                "reward/grade_failed):\n%s",
                task.name,
                example.id,
                traceback.format_exc(),
            )
        return Grade.failed_as("reward", f"grade raised {type(err).__name__}: {err}", ("grade",))


REQUIRED_MEMBERS = ("name", "train_examples", "validation_examples", "prompt", "grade")
OPTIONAL_MEMBERS = (
    "toolset",
    "reward_models",
    "environment",
    "warm_start_overrides",
    "grade_batch",
    "bind_tokenizer",
    "messages",
    "prompt_template",
    "data_fingerprint",
)


class PlainTask(Task):
    """A task class of your own that does not inherit ``Task``, as a ``Task``: its required members, and
    each optional one it has (not None) in place of the default, read once here.

    ``own`` must have every member of ``REQUIRED_MEMBERS``."""

    def __init__(self, own: Any):
        self.own, self.name = own, own.name
        for member in OPTIONAL_MEMBERS:
            value = getattr(own, member, None)
            if value is not None:  # None, as absent: the default
                setattr(self, member, value)

    def train_examples(self) -> list[Example]:
        return self.own.train_examples()

    def validation_examples(self) -> list[Example]:
        return self.own.validation_examples()

    def prompt(self, example: Example) -> str:
        return self.own.prompt(example)

    def grade(self, completion: str, example: Example, truncated: bool) -> Grade:
        return self.own.grade(completion, example, truncated)


class TaskSettings(BaseModel):
    """A ``[task]`` table's settings: unknown keys are refused; each task module declares its own
    (``name`` its tag, ``FILES`` the fields naming data files, ``build()`` the task)."""

    model_config = ConfigDict(extra="forbid")

    FILES: ClassVar[tuple[str, ...]] = ()  # fields naming data files (the suite snapshot copies them)

    def file_sources(self) -> dict[str, Any]:
        """Each field of ``FILES`` and the data source it names (a file, a hub source, or None)."""
        return {name: getattr(self, name) for name in self.FILES}

    def nonbinary_rewards(self) -> list[str]:
        """The terms of the RL reward these settings say can take values other than 0 and 1, each named by its
        setting (BNPO, defined for rewards in {0, 1}, refuses them up front). The built-in tasks' reward is their
        correctness: none."""
        return []

    def negative_rewards(self) -> list[str]:
        """The terms of the RL reward these settings say can be negative, each named by its setting (MaxRL, defined
        for rewards >= 0, refuses them up front; a term whose range only shows when it runs, a user function or an
        environment's reward, is checked on the actual rewards). The built-in tasks' reward is their correctness:
        none."""
        return []

    def reward_weights(self) -> dict[str, float] | None:
        """The RL reward's terms, each grade component's name and its weight (``answer_reward``: the grade's
        answer reward, for a task that sets no components); None where the settings cannot know them (a task
        class of the user's). GDPO normalizes each term apart. The built-in tasks' reward is their correctness."""
        return {ANSWER_TERM: 1.0}

    def clipped_reward_models(self) -> list[str]:
        """The term names of the reward models whose score is clipped (``options.clip``); the built-in tasks have
        no reward models: none."""
        return []

    def prompt_format(self) -> str | None:
        """The ``task.prompt.format`` these settings choose (``r1_zero``, ``template``, ``chat``); None for the
        kinds without that setting."""
        return None

    def absolute_reward_models(self) -> dict[str, Any]:
        """An update of these settings that names each reward model folder absolutely (a suite's runs start
        in another folder); empty when they name none."""
        return {}
