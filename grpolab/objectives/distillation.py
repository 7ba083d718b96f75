"""On-policy distillation's per-token advantage (pure tensor functions).

The student samples, a frozen teacher scores every sampled token, and each token's advantage is minus the
sampled reverse KL of the sampling policy to the teacher at that token (Agarwal et al. 2024, GKD; Thinking
Machines' "On-Policy Distillation" 2025 and its tinker cookbook, ``kl_discount_factor`` 0), optionally beside
the task's sequence advantage:

    A_it = reward_coef * A_i + teacher_kl_coef * (log pi_teacher(y_it) - log pi_old(y_it))

pi_old is the policy that sampled (frozen before the first update on the batch), so A_it is a constant of the
update; the weighting of ``AlgorithmSpec.weight`` (importance ratio, clip) then applies to it token by token.
Shapes: N sequences, T token positions, as in ``grpolab.objectives.losses``.
"""

from __future__ import annotations

import torch
from torch import Tensor


def sampled_reverse_kl(old_logprobs: Tensor, teacher_logprobs: Tensor, mask: Tensor) -> Tensor:
    """[N, T]: log pi_old(y_t) - log pi_teacher(y_t) on response tokens (whose mean over tokens sampled from
    pi_old estimates KL(pi_old || pi_teacher) per token), 0 elsewhere; detached."""
    diff = old_logprobs.detach() - teacher_logprobs.to(old_logprobs.dtype)
    return torch.where(mask.bool(), diff, torch.zeros_like(diff))


def distill_advantages(
    advantages: Tensor,
    old_logprobs: Tensor,
    teacher_logprobs: Tensor,
    mask: Tensor,
    teacher_kl_coef: float,
    reward_coef: float,
) -> Tensor:
    """Per-token advantages [N, T] (module docstring) from the sequence advantages [N], the sampling policy's
    and the teacher's log-probs of the sampled tokens [N, T] and the response mask [N, T]; 0 off the mask,
    detached (no gradient flows through the teacher's signal)."""
    kl = sampled_reverse_kl(old_logprobs, teacher_logprobs, mask)
    reward = reward_coef * advantages.detach().to(kl.dtype)[:, None] if reward_coef else torch.zeros_like(kl)
    return torch.where(mask.bool(), reward - teacher_kl_coef * kl, torch.zeros_like(kl))
