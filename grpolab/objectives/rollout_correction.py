"""Rollout corrections: reweighting and masking for the rollout engine / trainer mismatch (pure tensor functions).

The tokens were sampled by the rollout engine (behaviour policy, log-probs ``logp_engine``), while the loss
treats them as samples of the trainer's ``logp_old``. Each correction turns the log ratio
``log r = logp_old - logp_engine`` [N, T] into a detached weight [N, T] that multiplies each token's surrogate,
and a kept mask [N, T]: a dropped token adds 0 to the loss's numerator and still counts in its denominators
(computed once per optimizer step, so the reduction stays exact under micro-batching), as in TRL and verl.

Modes (``upper`` the cap, ``lower`` the optional floor; None = no floor):
  token_truncate      w_t = clip(r_t, lower, upper)                          (TIS; TRL token_truncate)
  sequence_truncate   w_t = clip(R, lower, upper),   R = prod_t r_t          (TRL sequence_truncate)
  geometric_truncate  w_t = clip(G, lower, upper),   G = exp(mean_t log r_t)
  token_mask          w_t = r_t, dropped unless lower <= r_t <= upper        (TRL token_mask; verl token rejection)
  sequence_mask       w_t = R,   the sequence dropped unless lower <= R <= upper   (TRL's default mode)
  geometric_mask      w_t = G,   the sequence dropped unless lower <= G <= upper   (verl geometric rejection)
  icepop              token_mask with a required two-sided band [lower, upper]       (IcePop, Ring-1T)

Every function works row by row: a row's result depends only on that row, so splitting a batch into
micro-batches of rows changes nothing.
"""

from __future__ import annotations

from typing import NamedTuple, get_args

import torch
from torch import Tensor

from grpolab.objectives.algorithms import RolloutCorrection

ROLLOUT_CORRECTIONS: tuple[str, ...] = get_args(RolloutCorrection)
AUTO = "auto"
AUTO_CORRECTION = "token_truncate"  # TIS / decoupled PPO's behaviour weight, clipped at rollout_correction_upper


def auto_rollout_correction(engine_differs: bool, stale: bool) -> tuple[str, str]:
    """What ``auto`` picks, and why (a phrase for the run's log and manifest).

    engine_differs: the engine samples in another precision than float32 trainer math (bf16 rollouts), so its
    log-probs differ from the trainer's by ~1e-2; stale: it samples from weights older than ``logp_old``'s
    (asynchronous rollouts). Neither: a float32 engine in sync agrees with the trainer to ~1e-5, a weight of
    1 +- 1e-5 changes nothing, so none.
    """
    if stale:
        return AUTO_CORRECTION, "the engine samples from stale weights"
    if engine_differs:
        return AUTO_CORRECTION, "the engine samples in another precision than float32"
    return "none", "the engine samples in float32 from the current weights"


def resolve_rollout_correction(setting: str, engine_differs: bool, stale: bool) -> str:
    """The mode a run uses for ``algorithm.rollout_correction`` = ``setting``: itself, or for ``auto``
    what :func:`auto_rollout_correction` picks."""
    return auto_rollout_correction(engine_differs, stale)[0] if setting == AUTO else setting


class Correction(NamedTuple):
    """One correction of a (micro-)batch; every tensor [N, T], detached.

    weight:    what multiplies each token's surrogate; 0 where the token is dropped or outside the mask
    kept:      bool, True on response tokens the correction keeps
    truncated: bool, True on response tokens whose weight a truncation moved to ``upper`` or ``lower``
    """

    weight: Tensor
    kept: Tensor
    truncated: Tensor


def _masked(x: Tensor, mask: Tensor) -> Tensor:
    return torch.where(mask.bool(), x, torch.zeros_like(x))


def raw_ratio(log_ratio: Tensor, mask: Tensor, level: str) -> Tensor:
    """The untruncated importance ratio [N, T] (detached) of ``log_ratio`` [N, T] (logp_old - logp_engine).

    token: r_t = exp(log r_t); sequence: R = exp(sum_t log r_t) on every token of its row; geometric:
    G = exp(mean_t log r_t). Sums and means run over ``mask`` [N, T] only.
    """
    log_ratio = _masked(log_ratio.detach(), mask)
    if level == "sequence":
        log_ratio = log_ratio.sum(1, keepdim=True).expand_as(log_ratio)
    elif level == "geometric":
        count = mask.sum(1, keepdim=True).clamp(min=1).to(log_ratio.dtype)
        log_ratio = (log_ratio.sum(1, keepdim=True) / count).expand_as(log_ratio)
    elif level != "token":
        raise ValueError(f"unknown ratio level {level!r}")
    return torch.exp(log_ratio)


def rollout_correction(
    log_ratio: Tensor, mask: Tensor, mode: str, upper: float, lower: float | None = None
) -> Correction:
    """The correction ``mode`` (one of ROLLOUT_CORRECTIONS) of ``log_ratio`` [N, T] = logp_old - logp_engine.

    mask [N, T]: 1 on response tokens. Returns weight, kept and truncated, each [N, T] (see :class:`Correction`).
    A mask mode with ``lower`` None drops only ratios above ``upper``; icepop needs ``lower``.
    """
    on = mask.bool()
    if mode not in ROLLOUT_CORRECTIONS:
        hint = "; auto is resolved when the run starts (resolve_rollout_correction)" if mode == AUTO else ""
        raise ValueError(f"unknown rollout correction {mode!r}; choose one of: {', '.join(ROLLOUT_CORRECTIONS)}{hint}")
    if mode == "none":
        ones = torch.ones_like(log_ratio.detach())
        return Correction(_masked(ones, mask), on, torch.zeros_like(on))
    level, kind = ("token", "mask") if mode == "icepop" else mode.split("_")
    if mode == "icepop" and lower is None:
        raise ValueError("icepop needs a lower bound (algorithm.rollout_correction_lower, e.g. 0.5)")
    ratio = raw_ratio(log_ratio, mask, level)
    floor = float("-inf") if lower is None else lower
    if kind == "truncate":
        truncated = on & ((ratio > upper) | (ratio < floor))
        return Correction(_masked(ratio.clamp(min=lower, max=upper), mask), on, truncated)
    kept = on & (ratio <= upper) & (ratio >= floor)
    return Correction(_masked(ratio, kept), kept, torch.zeros_like(on))


def off_policy_sequence_mask(
    sampling_logprobs: Tensor, logprobs: Tensor, advantages: Tensor, mask: Tensor, delta: float
) -> Tensor:
    """DeepSeek-V3.2's off-policy sequence mask [N, T] (bool, detached): a sequence is dropped when its
    advantage is negative and its mean per-token log ratio of the sampling policy over the current one,
    (1/|o|) sum_t (log pi_sampling - log pi_theta), exceeds ``delta``; True on the kept response tokens.

    sampling_logprobs, logprobs, mask [N, T]; advantages [N].
    """
    diff = _masked(sampling_logprobs.detach() - logprobs.detach(), mask)
    kl = diff.sum(1) / mask.sum(1).clamp(min=1).to(diff.dtype)
    drop = (advantages.detach() < 0) & (kl > delta)
    return mask.bool() & ~drop[:, None]


def engine_kl_k3(log_ratio: Tensor, mask: Tensor) -> Tensor:
    """k3 estimate [N, T] of KL(engine || trainer) per token from samples of the engine:
    r - 1 - log r with log r = logp_old - logp_engine (>= 0; 0 where they agree and outside ``mask``)."""
    log_ratio = _masked(log_ratio.detach(), mask)
    return torch.exp(log_ratio) - 1 - log_ratio
