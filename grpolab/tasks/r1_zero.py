"""The r1_zero prompt format and its grader (GUIDE section 3).

The model continues the prompt after ``<think>``; a well-formed completion looks like
``" reasoning </think> <answer> 42 </answer>"``. Grading is pure string work and never raises.
"""

from __future__ import annotations

from grpolab.tasks.base import Grade

R1_ZERO_TEMPLATE = (
    "A conversation between User and Assistant. The User asks a question, and the Assistant solves it. "
    "The Assistant first thinks about the reasoning process in the mind and then provides the User "
    "with the answer. The reasoning process is enclosed within <think> </think> and answer is enclosed "
    "within <answer> </answer> tags, respectively, i.e., <think> reasoning process here </think> "
    "<answer> answer here </answer>.\n"
    "User: {question}\n"
    "Assistant: <think>"
)

THINK_CLOSE_ANSWER_OPEN = "</think> <answer>"
ANSWER_CLOSE = "</answer>"


def r1_zero_prompt(question: str, tools_note: str = "") -> str:
    """Insert ``question`` into the r1_zero template; ``tools_note`` (how to call the tools, e.g.
    ``Toolset.instruction()``) goes on its own line before the question."""
    head, tail = R1_ZERO_TEMPLATE.split("User: {question}")
    return f"{head}{tools_note}User: {question}{tail}"


def parse_r1_zero(completion: str) -> tuple[bool, str | None]:
    """Split a completion into (format_ok, answer).

    The format is ok when ``"</think> <answer>"`` occurs and ``"</answer>"`` follows it; the answer
    is the stripped text between them. Otherwise returns ``(False, None)``.
    """
    start = completion.find(THINK_CLOSE_ANSWER_OPEN)
    if start < 0:
        return False, None
    rest = completion[start + len(THINK_CLOSE_ANSWER_OPEN) :]
    end = rest.find(ANSWER_CLOSE)
    if end < 0:
        return False, None
    return True, rest[:end].strip()


def answers_match(predicted: str, gold: str, symbolic: bool = True) -> bool:
    """Plain-number match, else (when ``symbolic``) math-verify with a time bound (``grpolab.tasks.answers``)."""
    from grpolab.tasks.answers import answers_match as match

    return match(predicted, gold, symbolic=symbolic)


def grade_r1_zero(completion: str, gold: str, truncated: bool, symbolic: bool = True) -> Grade:
    """Grade an r1_zero completion against the gold answer.

    Rewards: truncated -> (format 0, answer 0); malformed -> (0, 0); well-formed with a wrong
    answer -> (1, 0); well-formed and numerically equal to gold -> (1, 1).
    """
    format_ok, answer = parse_r1_zero(completion)
    if truncated or not format_ok or answer is None:
        return Grade(format_reward=0.0, answer_reward=0.0, extracted=answer)
    return Grade(
        format_reward=1.0, answer_reward=1.0 if answers_match(answer, gold, symbolic) else 0.0, extracted=answer
    )
