"""GPG's advantage rescaling (Chu et al., 2025, "GPG: A Simple and Strong Reinforcement Learning Baseline for
Model Reasoning"): alpha = B / (B - M), B samples of the rollout batch, M of them in groups whose rewards are
all equal (their advantage is 0: they carry no gradient but still count in the loss's denominator, so alpha
restores the gradient's scale). A pure tensor function.
"""

from __future__ import annotations

import torch
from torch import Tensor

from grpolab.objectives.advantages import informative_groups


def valid_sample_scale(rewards: Tensor) -> Tensor:
    """alpha = B / B_valid as a 0-dim tensor in the rewards' dtype, for rewards [groups, G].

    B_valid counts the samples of groups whose rewards are not all equal; a batch without such a group
    gets 1 (its advantages are all 0 anyway).
    """
    valid = int(informative_groups(rewards).sum())
    return torch.tensor(rewards.shape[0] / valid if valid else 1.0, dtype=rewards.dtype)
