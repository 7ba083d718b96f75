"""What each rollout engine can do (``EngineCapabilities``), declared apart from its code: an engine's class
holds its declaration as ``capabilities``, and ``grpolab.rollout.engines`` registers it beside the engine's
factory, so that checking a config against its engine (``check_settings``, ``grpolab config``) imports
neither torch nor the engines."""

from __future__ import annotations

from grpolab.rollout.base import EngineCapabilities

HF_CAPABILITIES = EngineCapabilities(
    shares_training_model=True,
    max_temperature=None,
    truncated_sampling=True,
    graceful_stop=True,
    records_routing=True,
    serves_adapters=False,
    batch_refill=True,
    bounded_batch=True,
    runs_apart=True,
)
"""What the ``hf`` engine (``grpolab.rollout.hf.engine.HFEngine``) can do."""

VLLM_MAX_TEMPERATURE = 2.0
"""Highest sampling temperature vLLM accepts: above it ``SamplingParams._verify_args``
(vllm/sampling_params.py, vLLM 0.32) raises ``VLLMValidationError`` (not a ValueError) "temperature
must be in [0, 2], got ..."."""
VLLM_CAPABILITIES = EngineCapabilities(
    shares_training_model=False,
    max_temperature=VLLM_MAX_TEMPERATURE,
    truncated_sampling=False,  # it reports log-probs renormalised over the truncated set
    graceful_stop=False,  # its engine processes share the terminal's process group and die of the same Ctrl-C
    records_routing=False,
    serves_adapters=True,
    batch_refill=False,
    bounded_batch=False,
    runs_apart=True,  # started as a process of its own, its weights by version in checkpoint folders
)
"""What vLLM can do, in this process or in a process of its own (``grpolab.rollout.vllm.apart``)."""
