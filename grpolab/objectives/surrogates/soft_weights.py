"""Smooth replacements of the PPO clip: SAPO's sigmoid gate (weight sapo) and VESPO's gamma weight (weight vespo).

Shapes as in :class:`~grpolab.objectives.surrogates.registry.SurrogateInput`: N sequences, T token positions;
``mask`` [N, T] is 1 on the response tokens. Both are written from their papers and checked against TRL 1.16's
``_compute_loss`` (tests/test_objectives_trl.py).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from grpolab.objectives.surrogates.registry import SurrogateInput, SurrogateOutput, register

if TYPE_CHECKING:
    from torch import Tensor

# VESPO's clamps of the log-ratios (TRL's, from the authors' code): each token's log ratio to [-20, 20], the
# sequence's to [log 1e-8, 20]; inert on any ratio that trains (phi is ~0 far outside them anyway)
TOKEN_LOG_RATIO_LIMIT = 20.0
SEQUENCE_LOG_RATIO_FLOOR = math.log(1e-8)


def _by_sign(condition: Tensor, if_true: float, if_false: float, like: Tensor) -> Tensor:
    """if_true where ``condition`` else if_false, in ``like``'s dtype and device (not rounded through float32)."""
    import torch  # here: listing and checking the algorithms loads no torch

    on = torch.tensor(if_true, dtype=like.dtype, device=like.device)
    return torch.where(condition, on, torch.tensor(if_false, dtype=like.dtype, device=like.device))


def sapo_surrogate(ratio: Tensor, advantages: Tensor, tau_pos: float, tau_neg: float) -> Tensor:
    """SAPO's per-token loss [N, T]: -A * (4 / tau) * sigmoid(tau * (w - 1)), tau = tau_pos where A > 0 else
    tau_neg. ratio: w [N, T] (with gradient); advantages: [N, 1]. Its gradient is A * 4 s (1 - s) * dw, s the
    sigmoid: exactly the policy gradient at w = 1, fading smoothly (no hard cut) as w leaves 1."""
    import torch

    tau = _by_sign(advantages > 0, tau_pos, tau_neg, ratio)
    return -advantages * (4 / tau) * torch.sigmoid(tau * (ratio - 1))


def vespo_phi(
    log_ratio: Tensor,
    mask: Tensor,
    advantages: Tensor,
    k_pos: float,
    lambda_pos: float,
    k_neg: float,
    lambda_neg: float,
    extra_log_weight: Tensor | None = None,
) -> Tensor:
    """VESPO's detached sequence weight phi(W) = e^lam * W^k * e^(-lam W) [N, 1] (1 at W = 1), computed in log space.

    log_ratio: [N, T] log(pi / pi_old) per token; W = exp(sum over the response of log_ratio) (the product of the
    token ratios, not GSPO's geometric mean); (k, lam) = (k_pos, lambda_pos) where A >= 0, else the _neg pair.
    advantages: [N, 1]. extra_log_weight: [N, T] optional log of a per-token rollout-correction weight
    (pi_old / pi_engine, truncated), added into log W as TRL does.
    """
    import torch

    on = mask.bool()
    per_token = torch.where(on, log_ratio.detach(), torch.zeros_like(log_ratio)).clamp(
        -TOKEN_LOG_RATIO_LIMIT, TOKEN_LOG_RATIO_LIMIT
    )
    log_w = per_token.sum(1, keepdim=True)
    if extra_log_weight is not None:
        extra = extra_log_weight.detach().clamp(SEQUENCE_LOG_RATIO_FLOOR, TOKEN_LOG_RATIO_LIMIT)
        log_w = log_w + torch.where(on, extra, torch.zeros_like(extra)).sum(1, keepdim=True)
    log_w = log_w.clamp(SEQUENCE_LOG_RATIO_FLOOR, TOKEN_LOG_RATIO_LIMIT)
    nonneg = advantages >= 0
    k = _by_sign(nonneg, k_pos, k_neg, log_w)
    lam = _by_sign(nonneg, lambda_pos, lambda_neg, log_w)
    log_phi = lam + k * log_w - lam * torch.exp(log_w)
    return torch.exp(log_phi)


@register(
    "sapo",
    formula="-A * 4/tau * sigmoid(tau*(w-1)), tau = sapo_temperature_pos if A > 0 else _neg",
    summary="a sigmoid gate of the ratio",
    reads=("sapo_temperature_pos", "sapo_temperature_neg"),
)
def sapo(x: SurrogateInput, sapo_temperature_pos: float, sapo_temperature_neg: float) -> SurrogateOutput:
    """SAPO's gate of each token's ratio; it cuts no token's gradient, so it marks none as clipped."""
    return SurrogateOutput(sapo_surrogate(x.ratio, x.advantages, sapo_temperature_pos, sapo_temperature_neg), x.ratio)


@register(
    "vespo",
    formula="-sg(e^lam * W^k * e^(-lam*W)) * A * logp, W = prod_t w (k, lam: vespo_*_pos if A >= 0 else _neg)",
    summary="a stop-gradient gamma weight of the sequence's ratio",
    reads=("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"),
    folds_correction="token_truncate",  # TRL's way: W = pi / pi_engine, not a factor on the loss
)
def vespo(
    x: SurrogateInput, vespo_k_pos: float, vespo_lambda_pos: float, vespo_k_neg: float, vespo_lambda_neg: float
) -> SurrogateOutput:
    """REINFORCE weighted by VESPO's phi of the sequence's ratio, the rollout correction folded into it."""
    phi = vespo_phi(
        x.logprobs - x.old_logprobs,
        x.mask,
        x.advantages,
        vespo_k_pos,
        vespo_lambda_pos,
        vespo_k_neg,
        vespo_lambda_neg,
        extra_log_weight=x.folded_correction,
    )
    return SurrogateOutput(-phi * x.advantages * x.masked_logprobs, x.ratio)
