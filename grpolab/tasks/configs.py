"""Task settings (the ``[task]`` table): one pydantic class per kind of task, each with ``build()``.

``task.name`` picks the kind: ``arithmetic`` (built in), ``gsm8k``, ``calculator`` (the built-in
tool task), ``dataset`` (your own data,
prompt format and rewards), or ``"package.module:Class"``, a task class of your own that follows
the ``grpolab.tasks.base.Task`` contract and takes the table's other keys as keyword arguments.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator, model_validator

from grpolab.tasks.base import Task
from grpolab.tasks.extract import AnswerFormat
from grpolab.tasks.prompts import PromptBuilder, PromptFormat, template_fields
from grpolab.tasks.sandbox import IMPORT_PATH


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ToolsConfig(_Section):
    """Tools the model may call in multi-turn rollouts (``grpolab.tools``); none = single-turn."""

    enabled: list[str] = Field(default_factory=list, description="tool names (calculator); [] = no tools")
    max_turns: int = Field(4, ge=2, description="generation turns per trajectory; a call in the last is not run")
    call_tags: tuple[str, str] = Field(("<tool_call>", "</tool_call>"), description="around a JSON call "
                                       '{"name": ..., "arguments": {...}}; best single tokens of the vocabulary')
    response_tags: tuple[str, str] = Field(("<tool_response>", "</tool_response>"),
                                           description="around the tool's output in the observation")

    @field_validator("enabled")
    @classmethod
    def _known_tools(cls, value: list[str]) -> list[str]:
        from grpolab.tools.protocol import TOOLS

        unknown = [v for v in value if v not in TOOLS]
        if unknown:
            raise ValueError(f"unknown tools {', '.join(unknown)}; available: {', '.join(TOOLS)}")
        return value

    def build(self):
        """The ``Toolset``, or None without tools."""
        from grpolab.tools.protocol import Toolset

        return Toolset(self.enabled, self.max_turns, self.call_tags, self.response_tags) if self.enabled else None


class ArithmeticTaskConfig(_Section):
    """The built-in task: multi-digit addition with a worked chain of thought."""

    name: Literal["arithmetic"] = "arithmetic"
    n_train: int = Field(4000, ge=1)
    n_val: int = Field(500, ge=1)
    seed: int = Field(0, description="data seed, separate from the run seed so runs share their data")
    digits: int = Field(2, ge=1, description="digits per operand")
    operands: int = Field(2, ge=2, description="numbers per problem")

    FILES: ClassVar[tuple[str, ...]] = ()  # fields naming data files (the suite snapshot copies them)

    def build(self) -> Task:
        from grpolab.tasks.arithmetic import ArithmeticTask

        return ArithmeticTask(**self.model_dump(exclude={"name"}))


class GSM8KTaskConfig(_Section):
    """GSM8K from local copies of the official files (the first n rows, as the reference runs)."""

    name: Literal["gsm8k"] = "gsm8k"
    train_path: str
    test_path: str
    n_train: int | None = Field(6400, ge=1, description="first N train rows (None = all)")
    n_val: int | None = Field(1024, ge=1, description="first M test rows as validation (None = all)")
    question_field: str = "question"
    answer_field: str = "answer"
    tools: ToolsConfig = Field(default_factory=ToolsConfig, description="e.g. {enabled = [\"calculator\"]}: "
                               "the prompt says how to call them, rollouts run them")

    FILES: ClassVar[tuple[str, ...]] = ("train_path", "test_path")

    def build(self) -> Task:
        from grpolab.tasks.gsm8k import GSM8KTask

        return GSM8KTask(**self.model_dump(exclude={"name", "tools"}), toolset=self.tools.build())


class CalculatorTaskConfig(_Section):
    """The built-in tool task: a*b+c with two-digit numbers, the calculator at hand."""

    name: Literal["calculator"] = "calculator"
    n_train: int = Field(4000, ge=1)
    n_val: int = Field(500, ge=1)
    seed: int = 0
    digits: int = Field(2, ge=1, le=4)
    tool_demos: float = Field(0.8, ge=0, le=1, description="share of the warm start's demonstrations that "
                              "call the calculator (the others answer directly)")
    tools: ToolsConfig = Field(default_factory=lambda: ToolsConfig(enabled=["calculator"], max_turns=3))

    FILES: ClassVar[tuple[str, ...]] = ()

    @field_validator("tools")
    @classmethod
    def _has_calculator(cls, value: ToolsConfig) -> ToolsConfig:
        if "calculator" not in value.enabled:
            raise ValueError("the calculator task needs tools.enabled to include 'calculator'")
        return value

    def build(self) -> Task:
        from grpolab.tasks.calculator import CalculatorTask

        return CalculatorTask(**self.model_dump(exclude={"name", "tools"}), toolset=self.tools.build())


class ChatArithmeticTaskConfig(_Section):
    """The built-in task for real instruct models: small arithmetic in the model's chat template."""

    name: Literal["chat_arithmetic"] = "chat_arithmetic"
    operations: str = Field("*", description="any of + - * (a - b only with a >= b)")
    low: int = Field(2, ge=0, description="smallest operand")
    high: int = Field(9, ge=0, description="largest operand")
    n_val: int = Field(32, ge=1)
    n_train: int | None = Field(None, ge=1, description="None = every problem not in validation")
    seed: int = Field(0, description="data seed: which problems validate")
    system: str | None = Field(None, description="a system message (None: the template's default, if any)")

    FILES: ClassVar[tuple[str, ...]] = ()

    def build(self) -> Task:
        from grpolab.tasks.chat_arithmetic import ChatArithmeticTask

        return ChatArithmeticTask(**self.model_dump(exclude={"name"}))


class PromptConfig(_Section):
    """How prompts are made and where the completion states its answer (``grpolab.tasks.prompts``)."""

    format: PromptFormat = Field("r1_zero", description="r1_zero; chat = the tokenizer's "
                                                           "chat template; template = your format string")
    template: str | None = Field(None, description="template: the whole prompt; chat: the user message (default "
                                 "'{question}'); fields as {name}: question and the data row's fields")
    system: str | None = Field(None, description="chat: a system message")
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict, description="chat: passed to the chat "
                                                 "template, e.g. {enable_thinking = false}")
    answer: AnswerFormat | None = Field(
        None, description="where the completion states its answer: r1_zero ('</think> <answer> X </answer>'), "
        "answer_tags (the last <answer>X</answer>), boxed (the last \\boxed{X}), last_number; None = r1_zero for "
        "the r1_zero format, else required")

    @model_validator(mode="after")
    def _answer_format(self) -> "PromptConfig":
        if self.answer is None:
            if self.format != "r1_zero":
                raise ValueError(f"prompt.answer is required with prompt.format {self.format!r}: answer_tags, "
                                 "boxed or last_number")
            self.answer = "r1_zero"
        PromptBuilder(self.format, self.template, self.system, self.chat_template_kwargs)  # refuses bad combinations
        return self


class RewardConfig(_Section):
    """One weighted reward function (``grpolab.tasks.rewards``)."""

    function: str = Field(description="a verifier (numeric, math, exact, regex) or 'package.module:function'")
    name: str | None = Field(None, description="label in the metrics (reward/<name>); default: the function's name")
    weight: float = 1.0
    timeout_s: float | None = Field(None, gt=0, description="time bound per call (math: 2 s, regex: 1 s, "
                                    "user functions: 10 s)")
    options: dict[str, Any] = Field(default_factory=dict, description="keyword arguments of the verifier or function")

    @field_validator("function")
    @classmethod
    def _known(cls, value: str) -> str:
        from grpolab.tasks.rewards import VERIFIERS

        if value not in VERIFIERS and not IMPORT_PATH.fullmatch(value):
            raise ValueError(f"unknown reward function {value!r}; use a verifier ({', '.join(VERIFIERS)}) or "
                             "'package.module:function'")
        return value


class DatasetTaskConfig(_Section):
    """Your own data (JSONL, Parquet or the hub), prompt format and reward functions."""

    name: Literal["dataset"] = "dataset"
    train: str = Field(description="a .jsonl or .parquet file, or hub:NAME[:CONFIG]:SPLIT")
    validation: str | None = Field(None, description="as train; None = a seeded split of train (validation_size)")
    validation_size: float | None = Field(None, gt=0, description="without validation: a count (>= 1) or a "
                                          "fraction (< 1) of the train rows, drawn with split_seed")
    split_seed: int = 0
    n_train: int | None = Field(None, ge=1, description="the first N train rows (after the split; None = all)")
    n_val: int | None = Field(None, ge=1, description="the first M validation rows (None = all)")
    question_field: str = "question"
    answer_field: str = "answer"
    id_field: str | None = Field(None, description="a field of unique ids; None = '<split>-<row>'")
    gold: Literal["text", "boxed", "gsm8k"] = Field("text", description="how the answer field holds the gold "
                                                    "answer: as text, in its last \\boxed{} (MATH solutions), or "
                                                    "after '####' (GSM8K)")
    prompt: PromptConfig = PromptConfig()
    rewards: list[RewardConfig] = Field(default_factory=lambda: [RewardConfig(function="math")], min_length=1,
                                        description="weighted; the first is the task's correctness (accuracy)")
    tools: ToolsConfig = Field(default_factory=ToolsConfig, description="tools the model may call; the prompt "
                               "says how (chat: the template's tools argument; template: {tools})")

    FILES: ClassVar[tuple[str, ...]] = ("train", "validation")

    @model_validator(mode="after")
    def _split(self) -> "DatasetTaskConfig":
        if (self.validation is None) == (self.validation_size is None):
            raise ValueError("give either task.validation (a source) or task.validation_size (a split of train)")
        if self.validation_size is not None and self.validation_size >= 1 and self.validation_size % 1:
            raise ValueError(f"task.validation_size {self.validation_size}: a count must be whole, a fraction < 1")
        if not self.tools.enabled and "tools" in template_fields(self.prompt.template or ""):
            raise ValueError("task.prompt.template names {tools} but task.tools.enabled is empty")
        return self

    def build(self) -> Task:
        from grpolab.tasks.dataset import DatasetTask

        return DatasetTask(self)


class ImportedTaskConfig(BaseModel):
    """A task class of your own, ``name = "package.module:Class"``; the other keys are its keyword arguments."""

    model_config = ConfigDict(extra="allow")
    name: str

    FILES: ClassVar[tuple[str, ...]] = ()

    @field_validator("name")
    @classmethod
    def _import_path(cls, value: str) -> str:
        if not IMPORT_PATH.fullmatch(value):
            raise ValueError(f"unknown task {value!r}; choose {', '.join(BUILT_IN)} or 'package.module:Class'")
        return value

    def build(self) -> Task:
        from grpolab.tasks.sandbox import resolve

        try:
            cls = resolve(self.name)
        except Exception as err:
            raise ValueError(f"task {self.name!r} cannot be imported: {type(err).__name__}: {err}") from None
        try:
            task = cls(**(self.model_extra or {}))
        except TypeError as err:
            raise ValueError(f"task {self.name!r}: {err}") from None
        missing = [m for m in ("name", "train_examples", "validation_examples", "prompt", "grade")
                   if not hasattr(task, m)]
        if missing:
            raise ValueError(f"task {self.name!r} does not follow the Task contract (grpolab.tasks.base.Task): "
                             f"missing {', '.join(missing)}")
        return task


BUILT_IN = {"arithmetic": ArithmeticTaskConfig, "gsm8k": GSM8KTaskConfig, "calculator": CalculatorTaskConfig,
            "chat_arithmetic": ChatArithmeticTaskConfig, "dataset": DatasetTaskConfig}


TASK_KINDS = (*BUILT_IN, "imported")  # the union's tags
TINY_MODEL_TASKS = ("arithmetic", "calculator")  # built-in tasks with worked solutions for the tiny model


def _kind(value: Any) -> str:
    name = value.get("name", "arithmetic") if isinstance(value, dict) else getattr(value, "name", None)
    return name if isinstance(name, str) and name in BUILT_IN else "imported"


TaskConfig = Annotated[
    Union[tuple(Annotated[cls, Tag(name)] for name, cls in BUILT_IN.items())
          + (Annotated[ImportedTaskConfig, Tag("imported")],)],
    Discriminator(_kind),
]


def build_task(settings: Any) -> Task:
    """The task of a ``[task]`` config (a TaskConfig, or its dict as in a run's config.json)."""
    if isinstance(settings, dict):
        from pydantic import TypeAdapter, ValidationError

        try:
            settings = TypeAdapter(TaskConfig).validate_python(settings)
        except ValidationError as err:
            from grpolab.algorithms import describe_validation_error

            raise ValueError("\n".join(describe_validation_error(err, "task", TASK_KINDS))) from None
    return settings.build()
