"""Normalizing learned reward scores before they enter the RL reward (pure tensor functions).

* ``batch``: the z-score over the rollout batch, ``(s - mean(s)) / (std(s) + eps)`` with the
  population std; a batch of one, or of equal scores, gives zeros.
* ``running``: the z-score with the mean and population std of every score seen so far, this batch
  included (the moments are updated first, then applied), merged batch by batch with Chan et al.'s
  parallel formula in float64, so the state is three numbers a checkpoint keeps.

``clip`` then clamps the normalized score to ``[-clip, clip]`` (with ``none``, the raw score).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

import torch
from torch import Tensor

EPS = 1e-6
Normalize = Literal["none", "batch", "running"]


def zscore(scores: Tensor, mean: Tensor | float, std: Tensor | float, eps: float = EPS) -> Tensor:
    """[N] -> [N]: ``(scores - mean) / (std + eps)``."""
    return (scores - mean) / (std + eps)


def batch_zscore(scores: Tensor, eps: float = EPS) -> Tensor:
    """[N] -> [N] z-scores with the batch's own mean and population std."""
    return zscore(scores, scores.mean(), scores.std(correction=0), eps)


@dataclass
class RunningMoments:
    """Count, mean and sum of squared deviations (M2) of every score merged so far."""

    count: int = 0
    mean: float = 0.0
    m2: float = 0.0

    def update(self, scores: Tensor) -> None:
        """Merge a batch [N] (Chan, Golub & LeVeque's pairwise update, in float64)."""
        batch = scores.detach().to(torch.float64)
        n = batch.numel()
        if n == 0:
            return
        batch_mean = batch.mean().item()
        batch_m2 = ((batch - batch_mean) ** 2).sum().item()
        total = self.count + n
        delta = batch_mean - self.mean
        self.mean += delta * n / total
        self.m2 += batch_m2 + delta * delta * self.count * n / total
        self.count = total

    @property
    def std(self) -> float:
        """Population standard deviation (0 before any score)."""
        return (self.m2 / self.count) ** 0.5 if self.count else 0.0

    def state_dict(self) -> dict[str, float]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.count, self.mean, self.m2 = int(state["count"]), float(state["mean"]), float(state["m2"])


def normalize_scores(
    scores: Tensor, how: Normalize, moments: RunningMoments | None = None, clip: float | None = None
) -> Tensor:
    """[N] raw scores -> [N] the RL reward's term before its weight; ``running`` updates ``moments`` first."""
    if how == "batch":
        out = batch_zscore(scores)
    elif how == "running":
        moments.update(scores)
        out = zscore(scores, moments.mean, moments.std)
    else:
        out = scores
    return out.clamp(-clip, clip) if clip is not None else out
