"""Loading the policy (and a frozen reference) exactly as a user's local Hugging Face model."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from grpolab.tasks.base import Task
from grpolab.tinymodel import warm_start_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def resolve_model_dir(path: str | None, task: Task) -> Path:
    """The model directory to train: ``path`` (must exist), or the demo's cached warm-started tiny model."""
    if path is None:
        return warm_start_model(task)
    model_dir = Path(path).expanduser()
    if not model_dir.is_dir():
        raise FileNotFoundError(f"model directory not found: {model_dir}")
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"not a Hugging Face model directory (no config.json): {model_dir}")
    return model_dir


def load_policy(model_dir: Path, dtype: str = "float32") -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Model and tokenizer through the Auto classes; the tokenizer gets a pad token if it has none."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[dtype])
    return model, tokenizer


def frozen_copy(model: PreTrainedModel) -> PreTrainedModel:
    """A frozen reference policy: a deep copy in eval mode with gradients off."""
    reference = copy.deepcopy(model).eval()
    reference.requires_grad_(False)
    return reference
