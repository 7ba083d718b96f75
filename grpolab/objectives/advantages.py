"""Group-relative advantages (pure tensor functions).

Rewards come as a [B, G] tensor: B prompts (groups), G sampled completions each. ``valid`` [B, G] bool marks the
samples whose rollout and reward succeeded (None: all): a failed sample's reward is unknown, not 0, so it takes no
part in any statistic; its group is the group without it (re-normalised over its valid samples), and a group with
fewer valid samples than ``min_valid_samples`` is dropped (every advantage 0). A failed sample's advantage is 0.

Over a whole rollout batch (``batch_advantages``): the group advantages of the summed RL reward, or GDPO's
decoupled ones, then GPG's rescaling where the algorithm asks for it.

GDPO (Group reward-Decoupled Normalization Policy Optimization, Liu et al., NVIDIA, arXiv 2601.05242; TRL's
``multi_objective_aggregation = "normalize_then_sum"``)::

    A^k_ij = (r^k_ij - mean_i r^k) / (std_i r^k + eps)     each term k within its group i (unbiased std)
    S_ij   = sum_k w_k A^k_ij                              the weighted sum
    A_ij   = (S_ij - mean(S)) / (std(S) + eps)             whitened over the whole (global) batch

With GRPO's summed reward, two samples whose terms differ (format right and answer wrong against the reverse)
can get the same advantage; decoupled, each term keeps its own resolution.

GPG's advantage rescaling (Chu et al., 2025, "GPG: A Simple and Strong Reinforcement Learning Baseline for
Model Reasoning"): alpha = B / (B - M), B samples of the rollout batch, M of them in groups whose rewards are
all equal (their advantage is 0: they carry no gradient but still count in the loss's denominator, so alpha
restores the gradient's scale).
"""

from __future__ import annotations

import torch
from torch import Tensor

from grpolab.objectives.algorithms import AlgorithmSpec
from grpolab.objectives.beta_norm import beta_density_scale


def min_valid_samples(baseline: str, normalizer: str) -> int:
    """Valid samples a group needs to keep its advantages: 2 where the advantage is relative to the group (a
    mean baseline, or a group's std or mean as the scale: one sample has no one to be compared with, and its
    advantage would be exactly 0), else 1."""
    return 1 if baseline == "none" and normalizer in ("none", "batch_std") else 2


def group_advantages(
    rewards: Tensor, baseline: str, normalizer: str, eps: float = 1e-6, valid: Tensor | None = None
) -> Tensor:
    """Advantage of every sample relative to its group.

    rewards: [B, G]; valid: [B, G] bool or None (all valid). Returns [B, G] in the rewards' dtype.
    baseline:   "mean" -> r - mean_i ; "none" -> r
    normalizer: "std"  -> / (unbiased std_i + eps)
                "mean" -> / (mean_i + eps), and 0 for a group whose mean is 0 (MaxRL); defined for any
                          rewards >= 0, partial credit included (with a negative mean the sign flips): a
                          negative reward raises
                "batch_std" -> / (unbiased std of all B x G rewards + eps) (Lite PPO: the batch's scale, the
                          group's mean; the batch must be the whole, global rollout batch)
                "none" -> unchanged
                "beta_density" -> / Beta(mean_i; alpha, beta) density, alpha, beta fitted to the batch's group
                          means (BNPO, grpolab.objectives.beta_norm); rewards in [0, 1] only: others raise
    With baseline "mean", a group whose rewards are all equal gets advantage exactly 0. Every statistic (a
    group's mean and std, the batch's std, the Beta fit) is over the valid samples of the kept groups only
    (module docstring); the rewards of failed samples are never read.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [B, G], got shape {tuple(rewards.shape)}")
    if normalizer == "batch_std" and rewards.numel() < 2:
        raise ValueError("normalizer 'batch_std' needs a batch of at least 2 rewards")
    if normalizer == "std" and rewards.shape[1] < 2:
        raise ValueError("normalizer 'std' needs a group size of at least 2")
    if valid is None:
        valid = torch.ones_like(rewards, dtype=torch.bool)
    elif valid.shape != rewards.shape:
        raise ValueError(f"valid must be [B, G] like the rewards, got {tuple(valid.shape)}")
    counts = valid.sum(dim=1, keepdim=True)  # [B, 1]
    kept = counts >= min_valid_samples(baseline, normalizer)  # [B, 1]
    used = valid & kept  # [B, G]: the samples every statistic reads
    rewards = torch.where(used, rewards, torch.zeros_like(rewards))  # a failed sample's reward is never read
    _check_reward_range(rewards, used, normalizer)
    n = counts.clamp(min=1).to(rewards.dtype)
    whole = bool(used.all())  # every sample counts: the plain reductions (the same floats as ever)
    mean = rewards.mean(dim=1, keepdim=True) if whole else rewards.sum(dim=1, keepdim=True) / n
    centered = _centered(rewards, used, mean, baseline)
    scaled = _scaled(centered, rewards, used, kept, mean, n, normalizer, eps)
    return scaled if whole else torch.where(used, scaled, torch.zeros_like(scaled))


def _check_reward_range(rewards: Tensor, used: Tensor, normalizer: str) -> None:
    """Refuse rewards the normalizer is not defined for: negative ones for MaxRL's mean, any outside [0, 1] for
    BNPO's Beta density. rewards, used: [B, G] (failed samples' rewards already 0)."""
    if normalizer == "mean":
        negative = (rewards < 0).nonzero()
        if len(negative):
            b, g = negative[0].tolist()
            raise ValueError(
                f"normalizer 'mean' (MaxRL) needs rewards >= 0: group {b} sample {g} has "
                f"{rewards[b, g].item():g} (the advantage (r - mean) / mean changes sign when a "
                "group's mean is negative)"
            )
    if normalizer == "beta_density" and ((rewards < 0) | (rewards > 1)).any():
        raise ValueError(
            f"normalizer 'beta_density' (BNPO) needs rewards in [0, 1] (a group's mean is a success probability): "
            f"got {rewards[used].min().item():g} to {rewards[used].max().item():g}; use another normalizer "
            "(e.g. --algo grpo)"
        )


def _centered(rewards: Tensor, used: Tensor, mean: Tensor, baseline: str) -> Tensor:
    """[B, G] rewards less the baseline: r - mean_i (exactly 0 in a group whose used rewards are all equal), or r."""
    if baseline == "mean":
        centered = torch.where(used, rewards - mean, torch.zeros_like(rewards))
        first = rewards.gather(1, used.to(torch.int64).argmax(dim=1, keepdim=True))  # a valid sample's reward
        all_equal = ((rewards == first) | ~used).all(dim=1, keepdim=True)
        return torch.where(all_equal, torch.zeros_like(centered), centered)
    if baseline == "none":
        return rewards
    raise ValueError(f"unknown baseline {baseline!r}")


def _scaled(
    centered: Tensor, rewards: Tensor, used: Tensor, kept: Tensor, mean: Tensor, n: Tensor, normalizer: str, eps: float
) -> Tensor:
    """[B, G] centered advantages divided by the normalizer's scale (``group_advantages``' table). mean, n, kept:
    [B, 1] the groups' means over their used samples, their valid counts, whether they are kept."""
    if normalizer == "std":
        if bool(used.all()):
            std = rewards.std(dim=1, keepdim=True, unbiased=True)
        else:
            deviation = torch.where(used, rewards - mean, torch.zeros_like(rewards))
            std = (deviation.square().sum(dim=1, keepdim=True) / (n - 1).clamp(min=1)).sqrt()
        return centered / (std + eps)
    if normalizer == "batch_std":  # fewer than 2 valid samples in the batch: no scale, and no contrast
        spread = rewards[used].std(unbiased=True) if int(used.sum()) >= 2 else torch.tensor(float("inf"))
        return centered / (spread + eps)
    if normalizer == "mean":
        scaled = centered / (mean + eps)
        return torch.where(mean == 0, torch.zeros_like(scaled), scaled)
    if normalizer == "none":
        return centered
    if normalizer == "beta_density":
        scale = torch.ones_like(mean)
        rows = kept[:, 0]
        if rows.any():
            scale[rows] = beta_density_scale(mean[rows, 0])
        return centered * scale
    raise ValueError(f"unknown normalizer {normalizer!r}")


def informative_groups(rewards: Tensor, valid: Tensor | None = None) -> Tensor:
    """[B] bool: groups whose rewards are not all equal (DAPO dynamic sampling keeps these); with ``valid`` [B, G]
    bool, over each group's valid samples (a group of fewer than 2 valid samples carries no contrast)."""
    if valid is None:
        return ~(rewards == rewards[:, :1]).all(dim=1)
    low = torch.where(valid, rewards, torch.full_like(rewards, float("inf"))).amin(dim=1)
    high = torch.where(valid, rewards, torch.full_like(rewards, float("-inf"))).amax(dim=1)
    return (valid.sum(dim=1) >= 2) & (low < high)


def advantage_metrics(rewards: Tensor, advantages: Tensor, valid: Tensor | None = None) -> dict[str, float]:
    """Summary of one rollout batch's rewards [B, G] and advantages [B, G], over its ``valid`` [B, G] samples (None:
    all; a batch with none valid: NaN means)."""
    if valid is None:
        valid = torch.ones_like(rewards, dtype=torch.bool)
    picked = advantages.float()[valid]
    return {
        "reward_mean": rewards.float()[valid].mean().item(),
        "advantage_mean": picked.mean().item(),
        "advantage_std": picked.std(unbiased=False).item(),
        "zero_advantage_group_frac": (advantages == 0).all(dim=1).float().mean().item(),
    }


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
    by ``weights`` [K] ("normalize_then_sum", GDPO); over the ``valid`` [B, G] samples only (None: all); then
    scaled by GPG's B / B_valid over the whole batch where ``spec.valid_rescale``."""
    if spec.multi_objective_aggregation == "sum_then_normalize":
        advantages = group_advantages(rewards, spec.baseline, spec.normalizer, spec.adv_eps, valid)
    elif terms is None or weights is None:
        raise ValueError("multi_objective_aggregation 'normalize_then_sum' needs the reward terms and their weights")
    else:
        advantages = decoupled_advantages(terms, weights, spec.baseline, spec.normalizer, spec.adv_eps, valid)
    return advantages * valid_sample_scale(rewards, valid) if spec.valid_rescale else advantages


def valid_sample_scale(rewards: Tensor, valid: Tensor | None = None) -> Tensor:
    """alpha = B / B_valid as a 0-dim tensor in the rewards' dtype, for rewards [groups, G].

    B_valid counts the samples of groups whose rewards are not all equal; a batch without such a group
    gets 1 (its advantages are all 0 anyway). With ``valid`` [groups, G] bool (samples whose rollout and reward
    succeeded), B counts the valid samples (the failed ones count in no denominator) and B_valid the valid
    samples of the informative groups.
    """
    if valid is None:
        informative = int(informative_groups(rewards).sum())
        return torch.tensor(rewards.shape[0] / informative if informative else 1.0, dtype=rewards.dtype)
    counted = int(valid.sum())
    informative = int((valid & informative_groups(rewards, valid)[:, None]).sum())
    return torch.tensor(counted / informative if informative else 1.0, dtype=rewards.dtype)
