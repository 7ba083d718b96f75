"""BNPO's advantage normalization (Xiao et al., 2025, arXiv 2506.02864): a pure tensor function.

For a binary reward the group's mean p estimates the prompt's success probability; across the batch the p are fitted
by a Beta(a, b) (method of moments), and each advantage r - p is divided by the density of Beta(alpha, beta) at p,
with alpha = 1 + a / 3, beta = 1 + b / 3 (the paper's variance-minimising choice, at least 1 as the authors' code
clamps). alpha = beta = 1 is REINFORCE with a baseline; alpha = beta = 3/2 is GRPO's std up to a constant.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

MAX_SCALE = 1e6  # the authors' cap on 1 / density (the density is 0 at p = 0 or 1, where r - p = 0)


def beta_parameters(group_means: Tensor) -> tuple[float, float]:
    """(alpha, beta) from the groups' mean rewards [B] (values in [0, 1]): the batch's Beta fit a, b by their mean m
    and unbiased variance v, alpha = max(1 + a/3, 1), beta = max(1 + b/3, 1); (1, 1) with one group or v = 0."""
    p = group_means.double()
    if p.numel() < 2:
        return 1.0, 1.0
    m, v = float(p.mean()), float(p.var(unbiased=True))
    if v <= 0:
        return 1.0, 1.0
    common = m * (1 - m) / v - 1
    return max(1 + m * common / 3, 1.0), max(1 + (1 - m) * common / 3, 1.0)


def beta_density_scale(group_means: Tensor) -> Tensor:
    """1 / Beta(p; alpha, beta) density per group [B, 1] (capped at 1e6), alpha, beta from ``beta_parameters``."""
    alpha, beta = beta_parameters(group_means)
    p = group_means.double()
    log_norm = math.lgamma(alpha + beta) - math.lgamma(alpha) - math.lgamma(beta)
    # xlogy: 0 * log(0) = 0, so alpha = 1 at p = 0 (or beta = 1 at p = 1) gives a finite density
    log_density = (
        log_norm + torch.xlogy(torch.full_like(p, alpha - 1), p) + torch.xlogy(torch.full_like(p, beta - 1), 1 - p)
    )
    scale = torch.exp(-log_density).clamp(max=MAX_SCALE)
    return scale.to(group_means.dtype)[:, None]
