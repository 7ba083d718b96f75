"""Length shaping of the RL reward (training only; evaluation grades answers alone).

* Truncation penalty: ``-p`` for a completion that hit the token limit, 0 otherwise.
* DAPO's soft overlong punishment (Yu et al., 2025, eq. 13), with ``L_max`` the token limit and
  ``L_cache`` the buffer::

      R_length(y) = 0                              if |y| <= L_max - L_cache
                  = ((L_max - L_cache) - |y|) / L_cache   if L_max - L_cache < |y| <= L_max
                  = -1                             if |y| > L_max

  times ``factor``. Both are off by default and are logged apart from the answer reward
  (``reward/truncation_penalty``, ``reward/overlong_penalty``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import Field

from grpolab.common.settings import Section
from grpolab.tasks.base import Grade

if TYPE_CHECKING:
    import torch

SHAPING_TERMS = ("truncation_penalty", "overlong_penalty")  # component names; they never fail


class RewardShapingConfig(Section):
    """Length shaping added to every task's RL reward in training (logged apart from the answer reward)."""

    truncation_penalty: float = Field(
        0.0, ge=0, description="subtracted from the reward of a completion that hit rollout.max_new_tokens (0 = off)"
    )
    overlong_buffer: int = Field(
        0,
        ge=0,
        description="DAPO's soft overlong punishment: the last this-many tokens "
        "before rollout.max_new_tokens cost up to overlong_factor, linearly (0 = off)",
    )
    overlong_factor: float = Field(1.0, gt=0, description="the soft overlong punishment at max_new_tokens")


def truncation_penalty(truncated: torch.Tensor, penalty: float) -> torch.Tensor:
    """[N] bool -> [N] float: ``-penalty`` where truncated, else 0."""
    import torch  # here: the config reads SHAPING_TERMS without torch

    return -penalty * truncated.to(torch.float64)


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer: int, factor: float = 1.0) -> torch.Tensor:
    """[N] completion lengths (tokens) -> [N] float64 penalties in [-factor, 0] (see the module docstring)."""
    import torch

    if buffer <= 0:
        return torch.zeros(lengths.shape, dtype=torch.float64)
    expected = max_len - buffer
    excess = lengths.to(torch.float64) - expected
    return -factor * torch.clamp(excess / buffer, min=0.0, max=1.0)


def shape_rewards(
    grades: list[Grade],
    lengths: list[int],
    truncated: list[bool],
    max_len: int,
    penalty: float,
    buffer: int,
    factor: float,
) -> list[Grade]:
    """``grades`` with the enabled length terms added to their RL reward as named components."""
    if penalty == 0 and buffer == 0:
        return grades
    import torch

    terms = []
    if penalty:
        terms.append((SHAPING_TERMS[0], truncation_penalty(torch.tensor(truncated), penalty)))
    if buffer:
        terms.append((SHAPING_TERMS[1], overlong_penalty(torch.tensor(lengths), max_len, buffer, factor)))
    shaped = []
    for i, grade in enumerate(grades):
        for name, values in terms:
            grade = grade.plus(name, float(values[i]))
        shaped.append(grade)
    return shaped
