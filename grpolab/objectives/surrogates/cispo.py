"""CISPO (MiniMax-M1, 2025): REINFORCE with each token weighted by its ratio truncated from above and held
constant, so no token's gradient is dropped by a clip.

Shapes as in :class:`~grpolab.objectives.surrogates.registry.SurrogateInput`: N sequences, T token positions.
"""

from __future__ import annotations

from grpolab.objectives.surrogates.registry import SurrogateInput, SurrogateOutput, register


@register(
    "cispo",
    formula="-sg(min(w, 1+eps_high)) * A * logp",
    summary="clipped, stop-gradient ratio",
    reads=("eps_high",),
)
def cispo(x: SurrogateInput, eps_high: float) -> SurrogateOutput:
    """-sg(min(w, 1 + eps_high)) * A * logp per token [N, T]; the tokens above the cap marked high [N, T]."""
    truncated_weight = x.ratio.clamp(max=1 + eps_high).detach()
    return SurrogateOutput(-truncated_weight * x.advantages * x.masked_logprobs, x.ratio, None, x.ratio > 1 + eps_high)
