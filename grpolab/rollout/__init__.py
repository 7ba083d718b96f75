"""Rollout engines: sample completions from the policy (see ``base`` for the contract)."""

from grpolab.rollout.base import Completion, FinishReason, RolloutEngine, SamplingParams

__all__ = ["Completion", "FinishReason", "RolloutEngine", "SamplingParams", "HFEngine"]


def __getattr__(name: str):
    # Lazy so that importing the contract does not import transformers.
    if name == "HFEngine":
        from grpolab.rollout.hf.engine import HFEngine

        return HFEngine
    raise AttributeError(name)
