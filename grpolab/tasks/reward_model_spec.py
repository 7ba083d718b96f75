"""A learned reward in a task's reward list: ``function = "model:DIR"`` names a local Hugging Face
sequence-classification model with one output (as TRL's ``reward_funcs`` takes one by name).

The task only declares it; the run loads it once on the trainer's device, batched and frozen
(``grpolab.models.reward_model``), and adds its weighted, normalized score to the RL reward
(``grpolab.rollout.reward_models``). ``options`` are checked here, and the folder's ``config.json``
(a ``*ForSequenceClassification`` architecture, ``num_labels = 1``), so bad input is one line before
anything runs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from grpolab.common.validation import describe_validation_error

MODEL_PREFIX = "model:"


class RewardModelOptions(BaseModel):
    """A reward model's ``options`` table."""

    model_config = ConfigDict(extra="forbid")

    normalize: Literal["none", "batch", "running"] = Field(
        "none",
        description="none = the raw score; batch = z-score over each rollout batch; running = z-score "
        "with the running mean/std of every score so far (kept in the run state: resume is exact)",
    )
    clip: float | None = Field(None, gt=0, description="clamp the (normalized) score to [-clip, clip]")
    dtype: Literal["auto", "float32", "bfloat16"] = Field("auto", description="auto = bf16 on CUDA, float32 on CPU")
    batch_size: int = Field(16, ge=1, description="texts per forward")
    max_length: int | None = Field(None, ge=1, description="tokens per rendered text; None = the model's context")
    truncate: Literal["error", "left"] = Field(
        "error", description="a longer text: error, or keep its last max_length tokens"
    )
    pad_token: str | None = Field(
        None, description="for a tokenizer without a pad token: one of its tokens to pad with (e.g. its EOS token)"
    )


class RewardModelSpec(BaseModel):
    """One reward model term as the run needs it: where, its label and weight, its options."""

    model_config = ConfigDict(frozen=True)

    path: str
    name: str
    weight: float
    options: RewardModelOptions


def is_model_reward(function: str) -> bool:
    return function.startswith(MODEL_PREFIX)


def check_reward_model_dir(path: str) -> dict:
    """The folder's ``config.json``; raises ``ValueError`` (one line) unless it is a sequence classifier
    with one output."""
    folder = Path(path)
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ValueError(f"reward model {path!r}: no config.json there (a local Hugging Face model folder is needed)")
    config = json.loads(config_file.read_text())
    architectures = config.get("architectures") or []
    if not any(a.endswith("ForSequenceClassification") for a in architectures):
        raise ValueError(
            f"reward model {path!r} is not a sequence-classification model (architectures: "
            f"{', '.join(architectures) or 'none'}); train or save it with "
            "AutoModelForSequenceClassification and num_labels = 1"
        )
    labels = config.get("num_labels", len(config.get("id2label") or {}) or 2)
    if labels != 1:
        raise ValueError(f"reward model {path!r} has {labels} labels; a reward model has one output (num_labels = 1)")
    return config


def reward_model_name(function: str) -> str:
    """The default name of a ``model:DIR`` entry's term: the folder's name."""
    return Path(function[len(MODEL_PREFIX) :]).name or "reward_model"


def reward_model_spec(function: str, name: str | None, weight: float, options: dict) -> RewardModelSpec:
    """The spec of a ``model:DIR`` reward entry, checked (one ``ValueError`` line when not)."""
    path = function[len(MODEL_PREFIX) :]
    try:
        checked = RewardModelOptions(**options)
    except ValidationError as err:
        lines = (f"options.{line}" for line in describe_validation_error(err, ""))
        raise ValueError(f"reward model {path!r}: " + "; ".join(lines)) from None
    check_reward_model_dir(path)
    return RewardModelSpec(path=path, name=name or reward_model_name(function), weight=weight, options=checked)
