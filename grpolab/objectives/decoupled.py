"""Advantages over a rollout batch as an algorithm asks for them (pure tensor functions): the group advantages of
the summed RL reward (``grpolab.objectives.advantages.group_advantages``), or GDPO's decoupled ones, where each
reward term is normalised within its group before the weighted sum.

GDPO (Group reward-Decoupled Normalization Policy Optimization, Liu et al., NVIDIA, arXiv 2601.05242; TRL's
``multi_objective_aggregation = "normalize_then_sum"``)::

    A^k_ij = (r^k_ij - mean_i r^k) / (std_i r^k + eps)     each term k within its group i (unbiased std)
    S_ij   = sum_k w_k A^k_ij                              the weighted sum
    A_ij   = (S_ij - mean(S)) / (std(S) + eps)             whitened over the whole (global) batch

With GRPO's summed reward, two samples whose terms differ (format right and answer wrong against the reverse)
can get the same advantage; decoupled, each term keeps its own resolution.
"""

from __future__ import annotations

import torch
from torch import Tensor

from grpolab.objectives.advantages import group_advantages, min_valid_samples
from grpolab.objectives.algorithms import AlgorithmSpec


def decoupled_advantages(
    terms: Tensor, weights: Tensor, baseline: str, normalizer: str, eps: float, valid: Tensor | None = None
) -> Tensor:
    """GDPO's advantages. ``terms``: [B, G, K] unweighted reward terms, ``weights``: [K], ``valid``: [B, G] bool
    (None: all; ``grpolab.objectives.advantages``: a failed sample takes no part and gets 0). Returns [B, G] in the
    terms' dtype.

    Each term is a group advantage of its own (``group_advantages`` with ``baseline`` and ``normalizer``: a
    group whose term is all equal gets exactly 0 for it), the weighted sum is whitened over the batch (unbiased
    std). A group whose sum is 0 at every sample keeps exactly 0: the batch mean of S is 0 in exact arithmetic
    (each group's S sums to 0), and its float rounding would otherwise give that group a spurious gradient."""
    if terms.dim() != 3 or weights.shape != terms.shape[2:]:
        raise ValueError(
            f"terms must be [B, G, K] and weights [K], got {tuple(terms.shape)} and {tuple(weights.shape)}"
        )
    if terms.numel() // terms.shape[2] < 2:
        raise ValueError("decoupled advantages need a batch of at least 2 samples")
    per_term = torch.stack(
        [group_advantages(terms[:, :, k], baseline, normalizer, eps, valid) for k in range(terms.shape[2])], dim=2
    )
    summed = (per_term * weights.to(terms.dtype)).sum(dim=2)  # [B, G]
    silent = (summed == 0).all(dim=1, keepdim=True)
    if valid is None:
        whitened = (summed - summed.mean()) / (summed.std(unbiased=True) + eps)
        return torch.where(silent, torch.zeros_like(whitened), whitened)
    used = valid & (valid.sum(dim=1, keepdim=True) >= min_valid_samples(baseline, normalizer))
    if int(used.sum()) < 2:  # no two samples to whiten over: no contrast
        return torch.zeros_like(summed)
    whitened = (summed - summed[used].mean()) / (summed[used].std(unbiased=True) + eps)
    return torch.where(silent | ~used, torch.zeros_like(whitened), whitened)


def batch_advantages(
    spec: AlgorithmSpec,
    rewards: Tensor,
    terms: Tensor | None = None,
    weights: Tensor | None = None,
    valid: Tensor | None = None,
) -> Tensor:
    """[B, G] advantages of a whole rollout batch as ``spec`` forms them: of the summed RL reward ``rewards``
    [B, G] (``multi_objective_aggregation`` "sum_then_normalize"), or of its terms ``terms`` [B, G, K] weighted
    by ``weights`` [K] ("normalize_then_sum", GDPO); over the ``valid`` [B, G] samples only (None: all)."""
    if spec.multi_objective_aggregation == "sum_then_normalize":
        return group_advantages(rewards, spec.baseline, spec.normalizer, spec.adv_eps, valid)
    if terms is None or weights is None:
        raise ValueError("multi_objective_aggregation 'normalize_then_sum' needs the reward terms and their weights")
    return decoupled_advantages(terms, weights, spec.baseline, spec.normalizer, spec.adv_eps, valid)
