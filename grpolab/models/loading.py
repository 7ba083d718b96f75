"""Loading the policy (and a frozen reference) exactly as a user's local Hugging Face model."""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from grpolab.common.provenance import native_bf16
from grpolab.models.dropout import disable_dropout
from grpolab.models.fidelity import attention_implementation
from grpolab.models.like import is_like_dir
from grpolab.models.routing import check_router_layout
from grpolab.models.sources import folder_record

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("model.device is 'cuda' but no CUDA device is available")
    return torch.device(device)


CPU_BF16_BY_DEFAULT = False
"""Whether ``model.dtype = "auto"`` computes in bf16 on a CPU with native bf16 (``native_bf16``). Off until
learning with bf16 compute on a CPU is measured to match float32's (``docs/precision.md``)."""


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """auto: BF16 compute on GPU; on CPU FP32, or BF16 on a CPU with native bf16 when ``CPU_BF16_BY_DEFAULT``
    (log-prob math is FP32 either way)."""
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16
        return torch.bfloat16 if CPU_BF16_BY_DEFAULT and native_bf16() else torch.float32
    return DTYPES[dtype]


def load_policy(
    model_dir: Path,
    dtype: torch.dtype = torch.float32,
    device: torch.device = torch.device("cpu"),
    attn_implementation: str = "sdpa",
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Model and tokenizer through the Auto classes; the tokenizer gets a pad token if it has none.

    The attention kernel is ``attn_implementation`` unless the model needs another to compute as designed
    (``grpolab.models.fidelity.attention_implementation``). A ``like:`` folder has no weights: its model is
    built with ``from_config`` from seed 0 (the same weights every time), in a forked RNG so that the
    caller's global torch RNG state is untouched. The model's own dropout is switched off for good
    (``grpolab.models.dropout``).
    """
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    config = AutoConfig.from_pretrained(model_dir)
    check_router_layout(config)  # an MoE family whose routers grpolab does not read: before any weight is read
    attn_implementation = attention_implementation(config, attn_implementation)
    if is_like_dir(model_dir):
        with torch.random.fork_rng(devices=[]):  # initialisation runs on the CPU
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation=attn_implementation)
    disable_dropout(model)  # the update's train-mode forwards compute the policy that sampled
    check_router_layout(config, model)
    return model.to(device), tokenizer


def model_record(model: PreTrainedModel, model_dir: Path) -> dict[str, Any]:
    """What identifies the starting model: its directory, a SHA-256 of its config, its revision if known (the
    commit of a Hugging Face cache snapshot, with its ``hub_id``), and for a converted GGUF file that file and
    its SHA-256."""
    config = json.dumps(model.config.to_dict(), sort_keys=True, default=str)
    return {
        "dir": str(model_dir),
        "hub_id": None,
        "config_sha256": hashlib.sha256(config.encode()).hexdigest(),
        "revision": getattr(model.config, "_commit_hash", None),
        "architecture": type(model).__name__,
        "parameters": sum(p.numel() for p in model.parameters()),
        "gguf_source": None,
    } | folder_record(model_dir)


def frozen_copy(model: PreTrainedModel) -> PreTrainedModel:
    """A frozen reference policy: a deep copy in eval mode with gradients off."""
    reference = copy.deepcopy(model).eval()
    reference.requires_grad_(False)
    return reference
