"""Rollout: sampling completions from the policy and grading them. The engine contract (``base``), the
engines by name (``engines``: ``hf/``, ``vllm/``; what each can do: ``capabilities``), wrappers over any
engine (``lockstep`` under FSDP, ``multiturn`` for tools), collecting a rollout batch (``collect``), evaluation
(``evaluation``) and the per-step check that engine and trainer log-probs agree (``sync_check``).

May import: ``grpolab.models`` and every layer below it (docs/architecture.md).
"""

from grpolab.rollout.base import Completion, FinishReason, RolloutEngine, SamplingParams

__all__ = ["Completion", "FinishReason", "RolloutEngine", "SamplingParams", "HFEngine"]


def __getattr__(name: str):
    # Lazy so that importing the contract does not import transformers.
    if name == "HFEngine":
        from grpolab.rollout.hf.engine import HFEngine

        return HFEngine
    raise AttributeError(name)
