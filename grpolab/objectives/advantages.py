"""Group-relative advantages (pure tensor functions).

Rewards come as a [B, G] tensor: B prompts (groups), G sampled completions each. ``valid`` [B, G] bool marks the
samples whose rollout and reward succeeded (None: all): a failed sample's reward is unknown, not 0, so it takes no
part in any statistic; its group is the group without it (re-normalised over its valid samples), and a group with
fewer valid samples than ``min_valid_samples`` is dropped (every advantage 0). A failed sample's advantage is 0.
"""

from __future__ import annotations

import torch
from torch import Tensor

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
    group_size = rewards.shape[1]
    if normalizer == "batch_std" and rewards.numel() < 2:
        raise ValueError("normalizer 'batch_std' needs a batch of at least 2 rewards")
    if normalizer == "std" and group_size < 2:
        raise ValueError("normalizer 'std' needs a group size of at least 2")
    if valid is None:
        valid = torch.ones_like(rewards, dtype=torch.bool)
    elif valid.shape != rewards.shape:
        raise ValueError(f"valid must be [B, G] like the rewards, got {tuple(valid.shape)}")
    counts = valid.sum(dim=1, keepdim=True)  # [B, 1]
    kept = counts >= min_valid_samples(baseline, normalizer)  # [B, 1]
    used = valid & kept  # [B, G]: the samples every statistic reads
    rewards = torch.where(used, rewards, torch.zeros_like(rewards))  # a failed sample's reward is never read
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
    n = counts.clamp(min=1).to(rewards.dtype)
    whole = bool(used.all())  # every sample counts: the plain reductions (the same floats as ever)
    mean = rewards.mean(dim=1, keepdim=True) if whole else rewards.sum(dim=1, keepdim=True) / n
    if baseline == "mean":
        centered = torch.where(used, rewards - mean, torch.zeros_like(rewards))
        first = rewards.gather(1, used.to(torch.int64).argmax(dim=1, keepdim=True))  # a valid sample's reward
        all_equal = ((rewards == first) | ~used).all(dim=1, keepdim=True)
        centered = torch.where(all_equal, torch.zeros_like(centered), centered)
    elif baseline == "none":
        centered = rewards
    else:
        raise ValueError(f"unknown baseline {baseline!r}")

    if normalizer == "std":
        if whole:
            std = rewards.std(dim=1, keepdim=True, unbiased=True)
        else:
            deviation = torch.where(used, rewards - mean, torch.zeros_like(rewards))
            std = (deviation.square().sum(dim=1, keepdim=True) / (n - 1).clamp(min=1)).sqrt()
        scaled = centered / (std + eps)
    elif normalizer == "batch_std":  # fewer than 2 valid samples in the batch: no scale, and no contrast
        spread = rewards[used].std(unbiased=True) if int(used.sum()) >= 2 else torch.tensor(float("inf"))
        scaled = centered / (spread + eps)
    elif normalizer == "mean":
        scaled = centered / (mean + eps)
        scaled = torch.where(mean == 0, torch.zeros_like(scaled), scaled)
    elif normalizer == "none":
        scaled = centered
    elif normalizer == "beta_density":
        scale = torch.ones_like(mean)
        rows = kept[:, 0]
        if rows.any():
            scale[rows] = beta_density_scale(mean[rows, 0])
        scaled = centered * scale
    else:
        raise ValueError(f"unknown normalizer {normalizer!r}")
    return scaled if whole else torch.where(used, scaled, torch.zeros_like(scaled))


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
