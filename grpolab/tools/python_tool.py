"""The Python tool: the model's code runs in the code sandbox (``grpolab.tools.code_sandbox``), and what it
printed comes back as the observation (masked out of the loss, as every observation is).

Stateless, one fresh interpreter per call: a call sees no variable of an earlier one (the model writes what it
needs again). A persistent interpreter per trajectory would save re-running a few lines, but its state would
have to travel with checkpoints for a resume to be exact, would let one call's damage (a patched builtin, a
filled tmpfs) leak into the next, and would pin a trajectory to one worker; stateless calls are reproducible,
independent and pooled.

The observation is stdout, then stderr's last lines when the code failed, cut to ``max_output_chars`` (the
cut said). A call the code itself ends badly is an error observation of its kind (``exception``, ``timeout``,
``killed``, ``output_limit``), counted per kind; a call the sandbox could not run is an infrastructure failure
(``ToolFailed``): its trajectory is a failed sample, never graded.
"""

from __future__ import annotations

from typing import Any

from grpolab.tools.code_sandbox import CodeRun, CodeSandbox

MAX_CODE_CHARS = 4000
PYTHON_DESCRIPTION = (
    "Run a Python 3 program (standard library only; no network; nothing is kept between calls) and return "
    "what it prints. Print the values you need."
)
PYTHON_SCHEMA = {
    "type": "object",
    "properties": {
        "code": {
            "type": "string",
            "description": "a whole Python program; print() the result",
            "maxLength": MAX_CODE_CHARS,
        }
    },
    "required": ["code"],
    "additionalProperties": False,
}
KIND_OF_STATUS = {"error": "exception", "timeout": "timeout", "killed": "killed", "output_limit": "output_limit"}
"""The call error kind of each status of a run the code itself ended badly (``grpolab.tools.protocol.ERROR_KINDS``)."""


class ToolFailed(RuntimeError):
    """The tool's machinery failed (not the call): the trajectory cannot be judged."""


class CodeError(ValueError):
    """The code ran and failed; ``kind`` says how (``KIND_OF_STATUS``), the message is its observation."""

    def __init__(self, message: str, kind: str):
        super().__init__(message)
        self.kind = kind


class PythonRunner:
    """The tool's ``run``: the code of ``arguments["code"]`` in ``sandbox``; its output, or ``CodeError``."""

    def __init__(self, sandbox: CodeSandbox, max_output_chars: int = 1000):
        self.sandbox, self.max_output_chars = sandbox, max_output_chars

    def __call__(self, arguments: dict[str, Any]) -> str:
        result = self.sandbox.run(arguments["code"])
        if result.failed:
            raise ToolFailed(f"the code sandbox failed: {_tail(result.stderr, 200) or result.status}")
        text = observation(result, self.max_output_chars)
        if result.status != "ok":
            raise CodeError(text, KIND_OF_STATUS[result.status])
        return text


def observation(result: CodeRun, max_chars: int) -> str:
    """What the model reads of a run: its stdout, and for a failed run what went wrong (stderr's tail, or the
    limit it hit), within ``max_chars``."""
    why = {
        "timeout": "timed out (the time limit ended it)",
        "killed": f"killed (exit code {result.exit_code})",
        "output_limit": "printed more than the output limit (cut)",
    }.get(result.status)
    problem = why or (_tail(result.stderr, max_chars // 2) if result.status == "error" else "")
    room = max_chars - len(problem) - 1 if problem else max_chars
    stdout = result.stdout if len(result.stdout) <= room else result.stdout[: max(room - 16, 0)] + "...(cut)"
    return "\n".join(part for part in (stdout.rstrip("\n"), problem) if part)


def _tail(text: str, chars: int) -> str:
    text = text.strip()
    return text if len(text) <= chars else "..." + text[-chars:]
