"""The tool protocol: how a completion calls a tool and what it reads back.

A call is JSON between the call tags, ``<tool_call>{"name": "calculator", "arguments":
{"expression": "37*24"}}</tool_call>``; generation pauses at the closing tag, the call is parsed,
its arguments are checked against the tool's JSON schema, the tool runs, and the observation
``<tool_response>903</tool_response>`` is appended to the context (or ``<tool_response>error:
...</tool_response>``: a malformed call, an unknown tool, arguments the schema refuses or a tool
failure never raise). The tags are settings; they are best single tokens of the model's vocabulary
(Qwen3's ``<tool_call>`` / ``</tool_call>`` are), so that a call ends on a token boundary.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from grpolab.tools.calculator import CALCULATOR_DESCRIPTION, CALCULATOR_SCHEMA, CalculatorError, calculate
from grpolab.tools.python_tool import KIND_OF_STATUS, PYTHON_DESCRIPTION, PYTHON_SCHEMA, ToolFailed

MAX_CALL_CHARS = 6000  # longer call texts are refused before JSON parsing (a Python tool's code: 4000 at most)
_ECHO = 40  # at most this much of the model's own text is quoted back in an error
CODE_KINDS = tuple(KIND_OF_STATUS.values())  # error observations that are the code's own output


class ToolError(ValueError):
    """A tool refused its arguments; the message becomes the error observation, counted as ``kind``."""

    kind = "refused"


ERROR_KINDS = ("format", "unknown_tool", "arguments", "refused", "turn_limit", *CODE_KINDS, "sandbox")
"""How a call can fail (``ToolCall.kind``): the call's text (not JSON, not a call, no opening tag, too long), an
unknown tool, arguments its schema refuses, the tool refusing them, the turn limit; the Python tool's code
raising, timing out, killed or printing past the cap; and ``sandbox``, the tool's machinery failing (its
trajectory is a failed sample)."""


@dataclass(frozen=True)
class Tool:
    """A callable tool: ``run(arguments) -> output text`` raises ``ToolError`` (or ``ValueError``) on bad input;
    ``parallel``: its calls are worth running side by side (processes), the calls of a turn then run at once."""

    name: str
    description: str
    parameters: Mapping[str, Any]  # JSON schema of the arguments object
    run: Callable[[dict[str, Any]], str]
    parallel: bool = False

    def schema(self) -> dict[str, Any]:
        """The function schema chat templates take (``apply_chat_template(tools=[...])``)."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": dict(self.parameters)},
        }


def _calculator(arguments: dict[str, Any]) -> str:
    try:
        return calculate(arguments["expression"])
    except CalculatorError as err:
        raise ToolError(str(err)) from None


class SandboxSettings(BaseModel):
    """The code sandbox's settings (``grpolab.tools.code_sandbox``), per call: ``[task.tools.sandbox]`` for the
    Python tool, ``[task.sandbox]`` for the code task."""

    model_config = ConfigDict(extra="forbid")

    wall_seconds: float = Field(10.0, gt=0, description="wall-clock limit per call; the whole sandbox is killed")
    cpu_seconds: int = Field(5, ge=1, description="CPU seconds per call")
    memory_mb: int = Field(512, ge=64, description="address space per call, MiB")
    max_output_chars: int = Field(1000, ge=16, description="the observation's length at most (the cut is said)")
    workers: int | None = Field(None, ge=1, description="calls run at once; None = the machine's cores")
    unsafe: bool = Field(
        False,
        description="run the code WITHOUT isolation where bubblewrap cannot run (trusted code only; logged loudly)",
    )

    def sandbox(self):
        """The ``CodeSandbox`` these settings describe (refused in one line where bubblewrap cannot run)."""
        from grpolab.tools.code_sandbox import CodeSandbox, SandboxLimits

        limits = SandboxLimits(self.wall_seconds, self.cpu_seconds, self.memory_mb << 20)
        return CodeSandbox(limits, unsafe=self.unsafe, workers=self.workers)


def _python(settings: SandboxSettings) -> Tool:
    from grpolab.tools.python_tool import PythonRunner

    runner = PythonRunner(settings.sandbox(), settings.max_output_chars)
    return Tool("python", PYTHON_DESCRIPTION, PYTHON_SCHEMA, runner, parallel=True)


CALCULATOR = Tool("calculator", CALCULATOR_DESCRIPTION, CALCULATOR_SCHEMA, _calculator)
TOOLS: dict[str, Callable[[SandboxSettings], Tool]] = {
    "calculator": lambda settings: CALCULATOR,
    "python": _python,
}
"""The tools by name, each built by its factory from the sandbox settings (which only the Python tool reads)."""


@dataclass(frozen=True)
class ToolCall:
    """One call of a trajectory: the text between the tags, what it asked for, what came back.

    error: None when the call was valid and the tool answered; else why not (the observation says it).
    observation: the text appended after the call (response tags included; "" when not executed).
    start, end: the observation's token span in ``Completion.completion_ids`` (policy mask 0 there).
    kind: how it failed (``ERROR_KINDS``), None when it did not.
    """

    text: str
    name: str | None
    arguments: dict[str, Any] | None
    error: str | None
    observation: str
    start: int = 0
    end: int = 0
    kind: str | None = None

    def record(self) -> dict[str, Any]:
        return asdict(self)


def _quote(text: str) -> str:
    return repr(text if len(text) <= _ECHO else text[:_ECHO] + "...")


class Toolset:
    """The tools a task offers and the protocol's tags and turn limit.

    max_turns: generation turns per trajectory; a call in the last turn is not executed (its
        trajectory ends there, counted as a tool error).
    """

    def __init__(
        self,
        names: Sequence[str],
        max_turns: int = 4,
        call_tags: tuple[str, str] = ("<tool_call>", "</tool_call>"),
        response_tags: tuple[str, str] = ("<tool_response>", "</tool_response>"),
        sandbox: SandboxSettings | None = None,
    ):
        unknown = [n for n in names if n not in TOOLS]
        if unknown or not names:
            raise ValueError(f"unknown tools {unknown or names}; available: {', '.join(TOOLS)}")
        if max_turns < 2:
            raise ValueError("max_turns must be >= 2 (one call and the turn that reads its result)")
        if not all(call_tags) or not all(response_tags):
            raise ValueError("tool tags must be non-empty")
        sandbox = sandbox or SandboxSettings()
        self.tools = {n: TOOLS[n](sandbox) for n in names}
        parallel = any(tool.parallel for tool in self.tools.values())  # else a turn's calls take microseconds
        self.workers = (sandbox.workers or os.cpu_count() or 1) if parallel else 1
        self.max_turns, self.call_tags, self.response_tags = max_turns, tuple(call_tags), tuple(response_tags)

    @property
    def call_close(self) -> str:
        return self.call_tags[1]

    def tags(self) -> tuple[str, ...]:
        return (*self.call_tags, *self.response_tags)

    def schemas(self) -> list[dict[str, Any]]:
        return [t.schema() for t in self.tools.values()]

    def instruction(self) -> str:
        """How to call the tools, for prompts that are not chat templates (one paragraph, ends in a newline)."""
        open_, close = self.call_tags
        listed = "; ".join(
            f"{t.name}: {t.description} Arguments: {json.dumps(dict(t.parameters)['properties'])}"
            for t in self.tools.values()
        )
        return (
            f'The Assistant may call a tool by writing {open_}{{"name": ..., "arguments": {{...}}}}{close} '
            f"and then reads its result between {self.response_tags[0]} {self.response_tags[1]}. Tools: {listed}\n"
        )

    def observation(self, output: str) -> str:
        return f"{self.response_tags[0]}{output}{self.response_tags[1]}"

    def ends_on_call(self, turn_text: str) -> bool:
        return self.call_tags[1] in turn_text

    def call_text(self, turn_text: str) -> str | None:
        """The text between the closing tag that ended ``turn_text`` and the last opening tag before it
        (None when there is none: ``execute`` answers with an error)."""
        open_, close = self.call_tags
        end = turn_text.rfind(close)
        if end < 0:
            return None
        start = turn_text.rfind(open_, 0, end)
        return None if start < 0 else turn_text[start + len(open_) : end]

    def execute(self, text: str | None) -> ToolCall:
        """Parse, check and run one call (``text`` between the tags; None: the closing tag had no opening
        tag). Never raises: every failure is an error observation."""

        def failed(error: str, kind: str, name: str | None = None, arguments: dict | None = None) -> ToolCall:
            observation = self.observation(error if kind in CODE_KINDS else f"error: {error}")
            return ToolCall(text or "", name, arguments, error, observation, kind=kind)

        if text is None:
            return failed(f"{self.call_tags[1]} without {self.call_tags[0]}", "format")
        if len(text) > MAX_CALL_CHARS:
            return failed(f"the call is longer than {MAX_CALL_CHARS} characters", "format")
        try:
            call = json.loads(text)
        except (ValueError, RecursionError):
            return failed(f"the call is not valid JSON: {_quote(text.strip())}", "format")
        if (
            not isinstance(call, dict)
            or not isinstance(call.get("name"), str)
            or not isinstance(call.get("arguments"), dict)
            or set(call) - {"name", "arguments"}
        ):
            return failed('a call is {"name": "<tool>", "arguments": {...}}', "format")
        name, arguments = call["name"], call["arguments"]
        tool = self.tools.get(name)
        if tool is None:
            return failed(
                f"unknown tool {_quote(name)}; tools: {', '.join(self.tools)}", "unknown_tool", name, arguments
            )
        problem = schema_error(tool.parameters, arguments)
        if problem:
            return failed(f"arguments: {problem}", "arguments", name, arguments)
        try:
            output = tool.run(arguments)
        except ToolFailed as err:  # the machinery, not the call: no observation, the trajectory fails
            return ToolCall(text, name, arguments, str(err), "", kind="sandbox")
        except ValueError as err:  # ToolError and the Python tool's CodeError included
            return failed(str(err), getattr(err, "kind", "refused"), name, arguments)
        return ToolCall(text, name, arguments, None, self.observation(output))

    def execute_many(self, texts: Sequence[str | None]) -> list[ToolCall]:
        """``execute`` for each of ``texts``, up to ``workers`` at once (the Python tool's calls are processes),
        in their order."""
        if len(texts) < 2 or self.workers < 2:
            return [self.execute(text) for text in texts]
        with ThreadPoolExecutor(min(self.workers, len(texts))) as pool:
            return list(pool.map(self.execute, texts))

    def segments(self, text: str) -> list[tuple[str, bool]]:
        """``text`` split into (piece, is_observation) at the response tags: for supervised warm starts
        that, like RL, train on the policy's text only."""
        open_, close = self.response_tags
        out: list[tuple[str, bool]] = []
        while (start := text.find(open_)) >= 0 and (end := text.find(close, start)) >= 0:
            out += [(text[:start], False), (text[start : end + len(close)], True)]
            text = text[end + len(close) :]
        return [(piece, obs) for piece, obs in out + [(text, False)] if piece]


def schema_error(schema: Mapping[str, Any], arguments: dict[str, Any]) -> str | None:
    """The first problem ``jsonschema`` finds in ``arguments`` (None when they are valid)."""
    import jsonschema

    error = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(schema).iter_errors(arguments))
    if error is None:
        return None
    where = "/".join(map(str, error.absolute_path))
    return (f"{where}: " if where else "") + (
        error.message if len(error.message) <= 120 else error.message[:120] + "..."
    )


class ToolsConfig(BaseModel):
    """Tools the model may call in multi-turn rollouts (``grpolab.tools``); none = single-turn."""

    model_config = ConfigDict(extra="forbid")

    enabled: list[str] = Field(default_factory=list, description="tool names (calculator, python); [] = no tools")
    max_turns: int = Field(4, ge=2, description="generation turns per trajectory; a call in the last is not run")
    call_tags: tuple[str, str] = Field(
        ("<tool_call>", "</tool_call>"),
        description='around a JSON call {"name": ..., "arguments": {...}}; best single tokens of the vocabulary',
    )
    response_tags: tuple[str, str] = Field(
        ("<tool_response>", "</tool_response>"), description="around the tool's output in the observation"
    )
    sandbox: SandboxSettings = Field(
        default_factory=SandboxSettings, description="the Python tool's sandbox: limits per call, workers"
    )

    @field_validator("enabled")
    @classmethod
    def _known_tools(cls, value: list[str]) -> list[str]:
        unknown = [v for v in value if v not in TOOLS]
        if unknown:
            raise ValueError(f"unknown tools {', '.join(unknown)}; available: {', '.join(TOOLS)}")
        return value

    def build(self):
        """The ``Toolset``, or None without tools."""
        if not self.enabled:
            return None
        return Toolset(self.enabled, self.max_turns, self.call_tags, self.response_tags, self.sandbox)
