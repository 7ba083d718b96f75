"""The ``[task]`` table: the union of the task kinds' settings, and ``build_task``.

Each built-in task module declares its settings class (a ``TaskSettings`` with ``name`` as its tag
and ``build()``); this module registers them. ``task.name`` picks the kind: ``arithmetic`` (built
in), ``gsm8k``, ``calculator`` (the built-in tool task), ``chat_arithmetic``, ``dataset`` (your own
data, prompt format and rewards), ``openenv`` (an OpenEnv environment server stepped by multi-turn
rollouts), ``verifiers`` (a verifiers 0.4 environment), ``reasoning_gym`` (reasoning-gym's procedural
generators), ``code`` (Python functions graded by their tests in the sandbox), or ``"package.module:Class"``, a task class of your own that follows the
``grpolab.tasks.base.Task`` contract (inheriting it, or a plain class with its members) and takes the table's
other keys as keyword arguments.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Union

from pydantic import ConfigDict, Discriminator, Field, Tag, field_validator

from grpolab.common.validation import describe_validation_error
from grpolab.tasks.arithmetic import ArithmeticTaskConfig
from grpolab.tasks.base import REQUIRED_MEMBERS, PlainTask, Task, TaskSettings
from grpolab.tasks.calculator import CalculatorTaskConfig
from grpolab.tasks.chat_arithmetic import ChatArithmeticTaskConfig
from grpolab.tasks.code import CodeTaskConfig
from grpolab.tasks.dataset import DatasetTaskConfig
from grpolab.tasks.gsm8k import GSM8KTaskConfig
from grpolab.tasks.openenv_env import OpenEnvTaskConfig
from grpolab.tasks.reasoning_gym import ReasoningGymTaskConfig
from grpolab.tasks.sandbox import IMPORT_PATH, resolve
from grpolab.tasks.verifiers_env import VerifiersTaskConfig

SETTINGS: tuple[type[TaskSettings], ...] = (
    ArithmeticTaskConfig,
    GSM8KTaskConfig,
    CalculatorTaskConfig,
    ChatArithmeticTaskConfig,
    DatasetTaskConfig,
    OpenEnvTaskConfig,
    VerifiersTaskConfig,
    ReasoningGymTaskConfig,
    CodeTaskConfig,
)
"""The built-in kinds, registered: each class's ``name`` default is its tag."""


class ImportedTaskConfig(TaskSettings):
    """A task class of your own, ``name = "package.module:Class"``; the other keys are its keyword arguments.
    A class that does not inherit ``Task`` is built as a ``PlainTask`` (the defaults for what it lacks)."""

    model_config = ConfigDict(extra="allow")
    name: str = Field(description="a task class of your own; the table's other keys are its keyword arguments")

    FILES: ClassVar[tuple[str, ...]] = ()

    @field_validator("name")
    @classmethod
    def _import_path(cls, value: str) -> str:
        if not IMPORT_PATH.fullmatch(value):
            raise ValueError(f"unknown task {value!r}; choose {', '.join(BUILT_IN)} or 'package.module:Class'")
        return value

    def reward_weights(self) -> None:
        """A task class's reward terms and weights are its own: unknown here."""
        return None

    def build(self) -> Task:
        try:
            cls = resolve(self.name)
        except Exception as err:
            raise ValueError(f"task {self.name!r} cannot be imported: {type(err).__name__}: {err}") from None
        try:
            made = cls(**(self.model_extra or {}))
        except TypeError as err:
            raise ValueError(f"task {self.name!r}: {err}") from None
        missing = [m for m in REQUIRED_MEMBERS if not hasattr(made, m)]
        if missing:
            raise ValueError(
                f"task {self.name!r} does not follow the Task contract (grpolab.tasks.base.Task): "
                f"missing {', '.join(missing)}"
            )
        return made if isinstance(made, Task) else PlainTask(made)


BUILT_IN = {cls.model_fields["name"].default: cls for cls in SETTINGS}


TASK_KINDS = (*BUILT_IN, "imported")  # the union's tags
TINY_MODEL_TASKS = ("arithmetic", "calculator")  # built-in tasks with worked solutions for the tiny model


def _kind(value: Any) -> str:
    name = value.get("name", "arithmetic") if isinstance(value, dict) else getattr(value, "name", None)
    return name if isinstance(name, str) and name in BUILT_IN else "imported"


TaskConfig = Annotated[
    Union[  # noqa: UP007 (a union of a tuple built at import: no `X | Y` spelling)
        tuple(Annotated[cls, Tag(name)] for name, cls in BUILT_IN.items())
        + (Annotated[ImportedTaskConfig, Tag("imported")],)
    ],
    Discriminator(_kind),
]


def build_task(settings: Any) -> Task:
    """The task of a ``[task]`` config (a TaskConfig, or its dict as in a run's config.json)."""
    if isinstance(settings, dict):
        from pydantic import TypeAdapter, ValidationError

        try:
            settings = TypeAdapter(TaskConfig).validate_python(settings)
        except ValidationError as err:
            raise ValueError("\n".join(describe_validation_error(err, "task", TASK_KINDS))) from None
    return settings.build()
