"""The plain policy gradient: REINFORCE on the sampled tokens (weight none), and its importance-sampled form (noclip).

Shapes as in :class:`~grpolab.objectives.surrogates.registry.SurrogateInput`: N sequences, T token positions.
"""

from __future__ import annotations

from grpolab.objectives.surrogates.registry import SurrogateInput, SurrogateOutput, register


@register("none", formula="-A * logp  (REINFORCE)", summary="REINFORCE")
def reinforce(x: SurrogateInput) -> SurrogateOutput:
    """-A * logp per token [N, T]: no ratio, so samples of an older policy are taken as the current one's."""
    return SurrogateOutput(-x.advantages * x.masked_logprobs, x.ratio)


@register("noclip", formula="-A * w", summary="importance ratio")
def importance_sampled(x: SurrogateInput) -> SurrogateOutput:
    """-A * w per token [N, T], w = pi / pi_old: unbiased off-policy, and unbounded."""
    return SurrogateOutput(-x.advantages * x.ratio, x.ratio)
