"""Group-relative advantages (pure tensor functions).

Rewards come as a [B, G] tensor: B prompts (groups), G sampled completions each.
"""

from __future__ import annotations

import torch
from torch import Tensor

from grpolab.objectives.beta_norm import beta_density_scale


def group_advantages(rewards: Tensor, baseline: str, normalizer: str, eps: float = 1e-6) -> Tensor:
    """Advantage of every sample relative to its group.

    rewards: [B, G]. Returns [B, G] in the rewards' dtype.
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
    With baseline "mean", a group whose rewards are all equal gets advantage exactly 0.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [B, G], got shape {tuple(rewards.shape)}")
    group_size = rewards.shape[1]
    if normalizer == "batch_std" and rewards.numel() < 2:
        raise ValueError("normalizer 'batch_std' needs a batch of at least 2 rewards")
    if normalizer == "std" and group_size < 2:
        raise ValueError("normalizer 'std' needs a group size of at least 2")
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
            f"got {rewards.min().item():g} to {rewards.max().item():g}; use another normalizer (e.g. --algo grpo)"
        )
    mean = rewards.mean(dim=1, keepdim=True)
    if baseline == "mean":
        centered = rewards - mean
        all_equal = (rewards == rewards[:, :1]).all(dim=1, keepdim=True)
        centered = torch.where(all_equal, torch.zeros_like(centered), centered)
    elif baseline == "none":
        centered = rewards
    else:
        raise ValueError(f"unknown baseline {baseline!r}")

    if normalizer == "std":
        return centered / (rewards.std(dim=1, keepdim=True, unbiased=True) + eps)
    if normalizer == "batch_std":
        return centered / (rewards.std(unbiased=True) + eps)
    if normalizer == "mean":
        scaled = centered / (mean + eps)
        return torch.where(mean == 0, torch.zeros_like(scaled), scaled)
    if normalizer == "none":
        return centered
    if normalizer == "beta_density":
        return centered * beta_density_scale(mean[:, 0])
    raise ValueError(f"unknown normalizer {normalizer!r}")


def informative_groups(rewards: Tensor) -> Tensor:
    """[B] bool: groups whose rewards are not all equal (DAPO dynamic sampling keeps these)."""
    return ~(rewards == rewards[:, :1]).all(dim=1)


def advantage_metrics(rewards: Tensor, advantages: Tensor) -> dict[str, float]:
    """Summary of one rollout batch's rewards [B, G] and advantages [B, G]."""
    return {
        "reward_mean": rewards.float().mean().item(),
        "advantage_mean": advantages.float().mean().item(),
        "advantage_std": advantages.float().std(unbiased=False).item(),
        "zero_advantage_group_frac": (advantages == 0).all(dim=1).float().mean().item(),
    }
