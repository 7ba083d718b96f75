"""The records of a run directory as the trainer writes them, built by hand for the report tests with the
numbers a test chooses: a training step's and a validation's record of metrics.jsonl, and one item's record
of eval/step_NNNNNN.jsonl."""

from __future__ import annotations


def train_record(step: int) -> dict:
    """Step ``step``'s training record: mean reward 0.5, one update a step, 10 response tokens, fixed timings."""
    updates = {"total_attempted_updates": step, "total_actual_updates": step}
    timings = {"time/step": 0.1, "time/generate": 0.05, "time/reward": 0.01}
    return {"step": step, "reward_mean": 0.5, **updates, "response_tokens": 10, **timings}


def val_record(step: int, accuracy: float, length: float) -> dict:
    """Step ``step``'s validation record: ``accuracy``, every answer in format, ``length`` tokens on average,
    none truncated."""
    rates = {"val/format_rate": 1.0, "val/completion_len_mean": length, "val/truncation_rate": 0.0}
    return {"step": step, "val/accuracy": accuracy, **rates}


def eval_item(name: str, correct: bool, length: int) -> dict:
    """Validation item ``name``'s record: the answer "1" in format, the gold "1" when ``correct`` (else "2"),
    ``length`` tokens, not truncated."""
    answer = {"completion": "<answer>1</answer>", "extracted": "1", "gold": "1" if correct else "2"}
    graded = {"format_ok": True, "correct": bool(correct), "length": length, "truncated": False}
    return {"id": f"item-{name}", "prompt_sha256": f"p{name}", **answer, **graded}
