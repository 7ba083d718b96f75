"""Weights that bound the update by other means than PPO's per-token ratio clip (verl's geo_mean and dppo_tv).

- GMPO (Zhao et al., 2025; weight gmpo): the geometric mean over a sequence's tokens of their clipped ratios, each
  ratio clipped in log space into [-eps_low, eps_high].
- DPPO (Qi et al., 2026, "Rethinking the Trust Region in LLM Reinforcement Learning"; weight dppo), its Binary-TV
  form: tokens whose probability moved more than a threshold in the advantage's direction are masked; the rest
  carry r x A, r = pi / pi_old, optionally truncated from above (``ratio_cap``).

Shapes as in :class:`~grpolab.objectives.surrogates.registry.SurrogateInput`: N sequences, T positions, ``mask``
[N, T] 1 on response tokens. Masked positions never reach a value or a gradient.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from grpolab.objectives.surrogates.registry import SurrogateInput, SurrogateOutput, register

if TYPE_CHECKING:
    from torch import Tensor


def _log_ratio(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor) -> Tensor:
    """log(pi / pi_old) [N, T], 0 at masked positions (so garbage there cannot make NaN or inf)."""
    import torch  # here: listing and checking the algorithms loads no torch

    diff = logprobs - old_logprobs
    return torch.where(mask.bool(), diff, torch.zeros_like(diff))


def gmpo_sequence_ratio(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, eps_low: float, eps_high: float
) -> tuple[Tensor, Tensor, Tensor]:
    """GMPO's clipped geometric-mean ratio of each sequence [N] and its low / high clip indicators [N, T].

    With l_t = log(pi_t / pi_old_t) and s = sign(A):
        ratio = exp( mean_t  s * min(s * l_t, s * clip(l_t, -eps_low, eps_high)) )
    so that A * ratio = sign(A) * (prod_t |min(r_t A, clip(r_t, e^-eps_low, e^eps_high) A)|)^(1/|o|), the paper's
    objective. A token's gradient is cut where the clip is the pessimistic side: l_t > eps_high with A > 0
    (high) or l_t < -eps_low with A < 0 (low). A = 0 gives ratio 1 (and a zero loss).
    """
    import torch

    log_ratio = _log_ratio(logprobs, old_logprobs, mask)
    sign = torch.sign(advantages)[:, None].to(log_ratio.dtype)
    clipped = log_ratio.clamp(-eps_low, eps_high)
    pessimistic = sign * torch.minimum(sign * log_ratio, sign * clipped)
    mean_log = (pessimistic * mask).sum(1) / mask.sum(1).clamp(min=1)
    on = mask.bool()
    low = on & (sign < 0) & (log_ratio < -eps_low)
    high = on & (sign > 0) & (log_ratio > eps_high)
    return torch.exp(mean_log), low, high


def dppo_surrogate(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    eps_low: float,
    eps_high: float,
    ratio_cap: float | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """DPPO-Binary-TV's per-token loss [N, T] (to be minimised), the ratio r [N, T] and the masked-low /
    masked-high indicators [N, T].

    With p = pi(token), p_old = pi_old(token) (probabilities of the sampled token) and r = p / p_old:
        masked high: A > 0 and p - p_old > eps_high   (the token already went up by more than the region)
        masked low:  A < 0 and p - p_old < -eps_low   (it already went down by more than the region)
        loss = -(1 - masked) * r_C * A,   r_C = r truncated at ``ratio_cap`` (value min(r, C), gradient
               min(r, C) * grad log p: truncated importance sampling), r_C = r without a cap.
    The mask is a constant of the step (no gradient flows through it).
    """
    import torch

    log_ratio = _log_ratio(logprobs, old_logprobs, mask)
    ratio = torch.exp(log_ratio)
    on = mask.bool()
    prob = torch.exp(torch.where(on, logprobs, torch.zeros_like(logprobs))).detach()
    old_prob = torch.exp(torch.where(on, old_logprobs, torch.zeros_like(old_logprobs)))
    moved = prob - old_prob
    adv = advantages[:, None].to(log_ratio.dtype)
    high = on & (adv > 0) & (moved > eps_high)
    low = on & (adv < 0) & (moved < -eps_low)
    weight = ratio
    if ratio_cap is not None:
        # exp(l - sg(relu(l - log C))): value min(r, C), gradient min(r, C) * dl; no inf * 0 when r overflows
        weight = torch.exp(log_ratio - (log_ratio - math.log(ratio_cap)).clamp(min=0).detach())
    per_token = -weight * adv
    return torch.where(low | high, torch.zeros_like(per_token), per_token), ratio, low, high


@register(
    "gmpo",
    formula="-A * exp(mean_t sgn(A)*min(sgn(A)*log w, sgn(A)*clip(log w, -eps_low, eps_high)))  (per sequence)",
    summary="geometric mean of the token ratios clipped in log space into [-eps_low, eps_high]",
    reads=("eps_low", "eps_high"),
)
def gmpo(x: SurrogateInput, eps_low: float, eps_high: float) -> SurrogateOutput:
    """GMPO's loss: one value per sequence, -A * its clipped geometric-mean ratio, on each of its tokens [N, T]."""
    seq, low, high = gmpo_sequence_ratio(x.logprobs, x.old_logprobs, x.sequence_advantages, x.mask, eps_low, eps_high)
    loss = (-x.advantages * seq[:, None].to(x.advantages.dtype)).expand_as(x.masked_logprobs)
    return SurrogateOutput(loss, x.ratio, low, high)


def check_dppo_bounds(eps_low: float, eps_high: float, ratio_cap: float | None) -> None:
    """A probability cannot rise by 1 or more: such an eps_high would mask nothing."""
    if eps_high >= 1:
        raise ValueError(
            f"weight dppo reads eps_high as a bound on a probability's rise; {eps_high:g} never masks: "
            "use a value below 1 (e.g. 0.2)"
        )


def _dppo_formula(ratio_cap: float | None = None, **clip_range: float) -> str:
    cap = f"; w truncated at {ratio_cap:g}" if ratio_cap is not None else ""
    return f"-M * w * A, M = 0 where A>0 and p-p_old > eps_high or A<0 and p-p_old < -eps_low{cap}"


@register(
    "dppo",
    formula=_dppo_formula,
    summary="ratio, tokens whose probability moved more than eps_high up / eps_low down in the advantage's "
    "direction masked",
    reads=("eps_low", "eps_high", "ratio_cap"),
    check=check_dppo_bounds,
)
def dppo(x: SurrogateInput, eps_low: float, eps_high: float, ratio_cap: float | None) -> SurrogateOutput:
    """DPPO-Binary-TV's loss; its masks are the clip indicators."""
    loss, _, low, high = dppo_surrogate(
        x.logprobs, x.old_logprobs, x.sequence_advantages, x.mask, eps_low, eps_high, ratio_cap
    )
    return SurrogateOutput(loss, x.ratio, low, high)
