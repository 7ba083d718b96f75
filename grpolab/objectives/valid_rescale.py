"""GPG's advantage rescaling (Chu et al., 2025, "GPG: A Simple and Strong Reinforcement Learning Baseline for
Model Reasoning"): alpha = B / (B - M), B samples of the rollout batch, M of them in groups whose rewards are
all equal (their advantage is 0: they carry no gradient but still count in the loss's denominator, so alpha
restores the gradient's scale). A pure tensor function.
"""

from __future__ import annotations

import torch
from torch import Tensor

from grpolab.objectives.advantages import informative_groups


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
