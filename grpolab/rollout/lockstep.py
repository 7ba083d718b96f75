"""Generation in lockstep over data-parallel ranks, for an engine whose forwards are collectives (the hf
engine on an FSDP-sharded model: every forward gathers the weights from all ranks)."""

from __future__ import annotations

from grpolab.models.weights import PolicyWeights
from grpolab.parallel.ranks import Ranks
from grpolab.rollout.base import Completion, RolloutEngine, SamplingParams


class LockstepEngine:
    """``RolloutEngine`` that pads each call's prompts to the longest list over the ranks (with copies of
    its own first prompt, or ``filler`` when it has none) and drops the extra completions: every rank
    then runs the same generation batches, and the engine's synced decoding keeps their steps together.
    Every rank must make the same calls in the same order."""

    def __init__(self, engine: RolloutEngine, ranks: Ranks, filler: list[int]):
        self.engine, self.ranks, self.filler = engine, ranks, filler

    def generate(self, prompts: list[list[int]], n: int, params: SamplingParams) -> list[list[Completion]]:
        most = self.ranks.max(len(prompts))
        if most == 0:
            return []
        padded = list(prompts) + [prompts[0] if prompts else self.filler] * (most - len(prompts))
        return self.engine.generate(padded, n, params)[: len(prompts)]

    def sync_weights(self, weights: PolicyWeights) -> None:
        self.engine.sync_weights(weights)

    def close(self) -> None:
        self.engine.close()
