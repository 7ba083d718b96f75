"""Loading the policy (and a frozen reference) exactly as a user's local Hugging Face model."""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from grpolab.common.progress import Reporter
from grpolab.common.provenance import native_bf16
from grpolab.models.dropout import disable_dropout
from grpolab.models.fidelity import attention_implementation
from grpolab.models.gguf import GGUF_PREFIX, absolute_spec, gguf_file, gguf_model_dir, gguf_source
from grpolab.models.hub import check_available, is_hub_id, resolve, snapshot_of
from grpolab.models.like import LIKE_PREFIX, is_like_dir, like_model_dir
from grpolab.models.routing import check_router_layout
from grpolab.models.tinymodel import warm_start_model, warm_start_settings
from grpolab.tasks.base import Task

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


def resolve_model_dir(
    path: str | None,
    task: Task,
    like_overrides: dict[str, int] | None = None,
    reporter: Reporter | None = None,
    warm_start: dict[str, Any] | None = None,
    revision: str | None = None,
) -> Path:
    """The model directory to train: ``path`` (must exist), the snapshot folder of a hub id ``org/name`` at
    ``revision`` (``grpolab.models.hub``: the Hugging Face cache first, else downloaded), the cached folder of a
    ``like:NAME`` model (random weights at a reference model's shapes; ``like_overrides`` may shrink it), the
    cached conversion of a ``gguf:FILE`` model (``grpolab.models.gguf``), or the demo's cached warm-started tiny
    model with the task's and then ``warm_start``'s changes to its recipe (its warm start, a download or a
    conversion, shown on ``reporter``)."""
    is_like = path is not None and path.startswith(LIKE_PREFIX)
    if like_overrides and not is_like:
        raise ValueError("model.like_overrides applies only to like: models")
    if is_like:
        return like_model_dir(path[len(LIKE_PREFIX) :], task, like_overrides)
    if path is None:
        return warm_start_model(task, warm_start_settings(task, warm_start), reporter=reporter)
    if path.startswith(GGUF_PREFIX):
        return gguf_model_dir(path[len(GGUF_PREFIX) :], reporter)
    if is_hub_id(path):
        return check_model_path(str(resolve(path, revision, reporter).folder))
    return check_model_path(path)


def check_model_spec(path: str | None, revision: str | None = None) -> None:
    """Refuse, before anything is converted or written, a ``model.path`` that cannot load: a missing
    directory, a missing GGUF file or short name, a hub id not in the cache while offline, a
    ``revision`` for anything but a hub id (``like:`` names are checked when built)."""
    if revision is not None and not (path and is_hub_id(path)):
        raise ValueError(
            f"model.revision {revision} applies to a Hugging Face hub id (org/name), and model.path "
            f"{path} is {'a local folder' if path and Path(path).expanduser().exists() else 'not one'}"
        )
    if not path or path.startswith(LIKE_PREFIX):
        return
    if path.startswith(GGUF_PREFIX):
        gguf_file(path[len(GGUF_PREFIX) :])
    elif is_hub_id(path):
        check_available(path, revision)
    else:
        check_model_path(path)


def absolute_model_spec(path: str) -> str:
    """``model.path`` naming the same model from any working directory (a suite's runs start elsewhere); a
    hub id is one already."""
    if path.startswith(LIKE_PREFIX) or is_hub_id(path):
        return path
    if path.startswith(GGUF_PREFIX):
        return GGUF_PREFIX + absolute_spec(path[len(GGUF_PREFIX) :])
    return str(Path(path).resolve())


def check_model_path(path: str) -> Path:
    """A local model directory ``path`` as a Path; raises FileNotFoundError when it is not one."""
    model_dir = Path(path).expanduser()
    if not model_dir.is_dir():
        raise FileNotFoundError(f"model directory not found: {model_dir} (a Hugging Face hub id has the form org/name)")
    if (model_dir / "adapter_config.json").is_file():  # a LoRA run's checkpoint: its base must still be there
        check_model_path(json.loads((model_dir / "adapter_config.json").read_text())["base_model_name_or_path"])
        return model_dir
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"not a Hugging Face model directory (no config.json): {model_dir}")
    return model_dir


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
    hub = snapshot_of(model_dir)
    revision = hub[1] if hub else getattr(model.config, "_commit_hash", None)
    return {
        "dir": str(model_dir),
        "hub_id": hub[0] if hub else None,
        "config_sha256": hashlib.sha256(config.encode()).hexdigest(),
        "revision": revision,
        "architecture": type(model).__name__,
        "parameters": sum(p.numel() for p in model.parameters()),
        "gguf_source": gguf_source(model_dir),
    }


def frozen_copy(model: PreTrainedModel) -> PreTrainedModel:
    """A frozen reference policy: a deep copy in eval mode with gradients off."""
    reference = copy.deepcopy(model).eval()
    reference.requires_grad_(False)
    return reference
