"""PPO's clipped ratio, per token (weight clip) or per sequence (weight gspo, GSPO: Zheng et al., 2025), with
INTELLECT-2's two-sided clip (``clip_delta``: the unclipped ratio capped too, so a negative advantage's loss stays
bounded).

Shapes as in :class:`~grpolab.objectives.surrogates.registry.SurrogateInput`: N sequences, T token positions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from grpolab.objectives.surrogates.registry import SurrogateInput, SurrogateOutput, register

if TYPE_CHECKING:
    from torch import Tensor

CLIP_READS = ("eps_low", "eps_high", "clip_delta")


def clipped_surrogate(
    ratio: Tensor, advantages: Tensor, eps_low: float, eps_high: float, clip_delta: float | None
) -> SurrogateOutput:
    """-min(w*A, clip(w, 1-eps_low, 1+eps_high)*A) per token [N, T], w = min(ratio, clip_delta) in the first term
    when ``clip_delta`` is set; the low / high clip indicators [N, T] (A < 0 below the range, A > 0 above it).

    ratio: [N, T] (a sequence's ratio repeated on its tokens for GSPO); advantages: [N, 1] or [N, T].
    """
    import torch  # here: listing and checking the algorithms loads no torch

    clipped = ratio.clamp(1 - eps_low, 1 + eps_high)
    # the two-sided clip: the unclipped term capped at delta (> 1 + eps_high: only A < 0 changes)
    unclipped = ratio if clip_delta is None else ratio.clamp(max=clip_delta)
    loss = -torch.minimum(unclipped * advantages, clipped * advantages)
    low = (advantages < 0) & (ratio < 1 - eps_low)
    high = (advantages > 0) & (ratio > 1 + eps_high)
    return SurrogateOutput(loss, ratio, low, high)


def check_clip_delta(eps_low: float, eps_high: float, clip_delta: float | None) -> None:
    """A two-sided clip at or below the upper clip bound would cap positive advantages' ratios too."""
    if clip_delta is not None and clip_delta <= 1 + eps_high:
        raise ValueError(
            f"clip_delta {clip_delta:g} must exceed 1 + eps_high ({1 + eps_high:g}), else it also "
            "caps positive advantages' ratios; raise clip_delta (INTELLECT-2 uses 4)"
        )


def _formula(ratio: str, suffix: str = "") -> Callable[..., str]:
    """The clipped formula over ``ratio`` (w or s), its unclipped term shown capped when clip_delta is set."""

    def line(clip_delta: float | None = None, **clip_range: float) -> str:
        unclipped = ratio if clip_delta is None else f"min({ratio}, delta)"
        return f"-min({unclipped}*A, clip({ratio}, 1-eps_low, 1+eps_high)*A){suffix}"

    return line


@register(
    "clip",
    formula=_formula("w"),
    summary="PPO",
    reads=CLIP_READS,
    check=check_clip_delta,
    clip_cov=True,
)
def ppo_clip(x: SurrogateInput, eps_low: float, eps_high: float, clip_delta: float | None) -> SurrogateOutput:
    """PPO's clip of each token's ratio."""
    return clipped_surrogate(x.ratio, x.advantages, eps_low, eps_high, clip_delta)


@register(
    "gspo",
    formula=_formula("s", ", s = exp(mean_t(logp - logp_old))"),
    summary="sequence ratio, clipped",
    reads=CLIP_READS,
    check=check_clip_delta,
    ratio="sequence",
)
def gspo(x: SurrogateInput, eps_low: float, eps_high: float, clip_delta: float | None) -> SurrogateOutput:
    """GSPO: PPO's clip of each sequence's ratio s (``x.ratio``, the geometric mean of its token ratios)."""
    return clipped_surrogate(x.ratio, x.advantages, eps_low, eps_high, clip_delta)
