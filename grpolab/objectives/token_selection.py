"""Token selection over a whole optimizer step and the entropy bonus (pure tensor functions).

Every selection here is decided over ALL the response tokens of one optimizer step (all its micro-batches,
all data-parallel ranks), flattened in the step's canonical order: rows by their index in the rollout batch,
then each row's response tokens by position. Flat tensors are [K], K = the step's response tokens.

- 80/20 (Wang et al., 2025; TRL ``top_entropy_quantile``): keep the tokens whose entropy is at least the
  (1 - rho) quantile of the step's entropies (linear interpolation, as ``torch.quantile``).
- Clip-Cov (Cui et al., 2025; verl ``clip_cov``): cov_t = (logp_t - mean logp)(A_t - mean A), means over the
  step's tokens; of the tokens with lb < cov < ub whose PPO clip is not already active, a random
  max(1, int(ratio K)) lose their surrogate (and so their gradient); they still count in every denominator.
- KL-Cov (same paper; verl ``kl_cov``): the top max(1, int(ratio K)) tokens by cov get
  coef x |logp - logp_old| added to their surrogate.
- The entropy bonus: minus coef x sum_t H_t m_t / (the step's bonus tokens); with 80/20 only over the kept tokens
  (as TRL's). ``AdaptiveEntropy`` is Skywork-OR1's coefficient, one update per optimizer step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from grpolab.objectives.algorithms import AlgorithmSpec


def entropy_quantile_keep(entropy: Tensor, rho: float) -> Tensor:
    """Bool [K]: the tokens whose entropy [K] is at least the (1 - rho) quantile of all K (rho = 1: all), the
    quantile interpolated linearly between the sorted values (``torch.quantile``'s, without its size limit of
    2^24 elements: a step may hold more tokens)."""
    if rho >= 1 or entropy.numel() == 0:
        return torch.ones_like(entropy, dtype=torch.bool)
    values = entropy.double()
    ordered = values.sort().values
    position = (1 - rho) * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    threshold = ordered[low] + (ordered[high] - ordered[low]) * (position - low)
    return values >= threshold


def token_covariance(logprobs: Tensor, advantages: Tensor) -> Tensor:
    """[K] float64: (logp - mean logp) (A - mean A), the means over the K tokens (A repeated per token)."""
    lp, adv = logprobs.double(), advantages.double()
    return (lp - lp.mean()) * (adv - adv.mean())


def selection_count(ratio: float, k: int) -> int:
    """How many of ``k`` tokens a covariance selection picks: max(1, int(ratio k)), as verl."""
    return max(1, int(ratio * k))


def clip_cov_detached(
    cov: Tensor, clipped: Tensor, ratio: float, lb: float, ub: float, generator: torch.Generator | None
) -> Tensor:
    """Bool [K]: Clip-Cov's tokens to detach. ``clipped`` [K]: the PPO clip already holds the token.

    Candidates: lb < cov < ub and not clipped, in canonical order; the first max(1, int(ratio K)) of
    ``torch.randperm(#candidates, generator)`` (drawn on the CPU generator: the same on every device and rank).
    No candidate: nothing drawn, nothing detached.
    """
    candidates = torch.nonzero((cov > lb) & (cov < ub) & ~clipped.to(cov.device)).flatten()
    out = torch.zeros_like(cov, dtype=torch.bool)
    if len(candidates):
        pick = torch.randperm(len(candidates), generator=generator)[: selection_count(ratio, cov.numel())]
        out[candidates[pick.to(candidates.device)]] = True
    return out


def kl_cov_penalised(cov: Tensor, ratio: float) -> Tensor:
    """Bool [K]: KL-Cov's top max(1, int(ratio K)) tokens by covariance (ties: the earlier token first)."""
    out = torch.zeros_like(cov, dtype=torch.bool)
    if cov.numel():
        order = torch.sort(cov, descending=True, stable=True).indices
        out[order[: selection_count(ratio, cov.numel())]] = True
    return out


def ppo_clip_active(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, eps_low: float, eps_high: float
) -> Tensor:
    """Bool [K]: the PPO clip holds the token: -A clip(w) > -A w (verl's ``clip_by_origin``), w = exp(logp - old)."""
    ratio = torch.exp(logprobs.double() - old_logprobs.double())
    adv = advantages.double()
    return -adv * ratio.clamp(1 - eps_low, 1 + eps_high) > -adv * ratio


@dataclass
class FlatSelection:
    """The decisions over the step's K tokens: ``keep`` bool [K] (the surrogate counts; False: 0 there),
    ``penalise`` bool [K] or None (KL-Cov's |log ratio| penalty), ``bonus`` bool [K] (the entropy bonus's tokens)."""

    keep: Tensor
    penalise: Tensor | None
    bonus: Tensor


def select_flat(
    spec: AlgorithmSpec,
    entropy: Tensor,
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    generator: torch.Generator | None,
) -> FlatSelection:
    """``spec``'s selection over one step's K tokens: entropy, current log-probs (detached), frozen old log-probs
    and per-token advantages, each [K] in canonical order."""
    everything = torch.ones_like(logprobs, dtype=torch.bool)
    if spec.top_entropy_quantile < 1:
        keep = entropy_quantile_keep(entropy, spec.top_entropy_quantile)
        return FlatSelection(keep=keep, penalise=None, bonus=keep)
    if spec.cov_selection == "clip_cov":
        cov = token_covariance(logprobs, advantages)
        clipped = ppo_clip_active(logprobs, old_logprobs, advantages, spec.eps_low, spec.eps_high)
        detached = clip_cov_detached(cov, clipped, spec.clip_cov_ratio, spec.clip_cov_lb, spec.clip_cov_ub, generator)
        return FlatSelection(keep=~detached, penalise=None, bonus=everything)
    if spec.cov_selection == "kl_cov":
        cov = token_covariance(logprobs, advantages)
        return FlatSelection(keep=everything, penalise=kl_cov_penalised(cov, spec.kl_cov_ratio), bonus=everything)
    return FlatSelection(keep=everything, penalise=None, bonus=everything)


def needs_step_pass(spec: AlgorithmSpec) -> bool:
    """The step's tokens are selected from the current policy's statistics over the whole step (one no-grad
    forward of its rows before the first backward)."""
    return spec.top_entropy_quantile < 1 or spec.cov_selection != "none"


def bonus_enabled(spec: AlgorithmSpec) -> bool:
    """The loss has an entropy bonus (a fixed or an adaptive coefficient)."""
    return spec.entropy_coef > 0 or spec.use_adaptive_entropy


def apply_selection(
    surrogate: Tensor,
    logprobs: Tensor,
    old_logprobs: Tensor,
    keep: Tensor | None,
    penalise: Tensor | None,
    kl_coef: float,
) -> Tensor:
    """The per-token surrogate [N, T]: 0 where ``keep`` [N, T] is False (not 0 x inf), plus
    kl_coef x |logp - logp_old| where ``penalise`` [N, T] is True; either may be None (nothing to do)."""
    if keep is not None:
        surrogate = torch.where(keep.bool(), surrogate, torch.zeros_like(surrogate))
    if penalise is not None:
        penalty = kl_coef * (logprobs - old_logprobs).abs()
        surrogate = surrogate + torch.where(penalise.bool(), penalty, torch.zeros_like(penalty))
    return surrogate


def entropy_bonus(entropy: Tensor, mask: Tensor, coef: float, tokens: float) -> Tensor:
    """coef x sum(H m) / tokens: this micro-batch's share of the step's bonus (subtracted from the loss);
    entropy, mask [N, T]; ``tokens`` the step's bonus tokens (all ranks)."""
    return coef * torch.where(mask.bool(), entropy, torch.zeros_like(entropy)).sum() / max(tokens, 1.0)


class AdaptiveEntropy:
    """Skywork-OR1's adaptive entropy coefficient (He et al., 2025), updated once per optimizer step.

    ``applied(spec)``: the coefficient of the next step, c_k if the last step's entropy e_{k-1} <= target (else 0;
    no step yet: 0, as TRL's); ``observe(spec, e_k)``: c_{k+1} = clip(c_k + delta if e_k <= target else
    c_k - delta, [min, max]), c_0 = entropy_coef. Without ``use_adaptive_entropy`` the coefficient is
    ``entropy_coef`` at every step and nothing changes. Its state (c_k, e_{k-1}) goes into the run's checkpoint,
    so that a resumed run continues exactly.
    """

    def __init__(self) -> None:
        self.coef: float | None = None  # c_k; None: no step yet (c_0 = the spec's entropy_coef)
        self.last_entropy = math.inf

    def applied(self, spec: AlgorithmSpec) -> float:
        if not spec.use_adaptive_entropy:
            return float(spec.entropy_coef)
        coef = spec.entropy_coef if self.coef is None else self.coef
        return float(coef) if self.last_entropy <= spec.entropy_target else 0.0

    def observe(self, spec: AlgorithmSpec, entropy: float) -> None:
        if not spec.use_adaptive_entropy:
            return
        coef = spec.entropy_coef if self.coef is None else self.coef
        delta = spec.entropy_coef_delta if entropy <= spec.entropy_target else -spec.entropy_coef_delta
        self.coef = min(max(coef + delta, spec.entropy_coef_min), spec.entropy_coef_max)
        self.last_entropy = float(entropy)

    def state_dict(self) -> dict[str, float | None]:
        return {"coef": self.coef, "last_entropy": self.last_entropy}

    def load_state_dict(self, state: dict[str, float | None]) -> None:
        """``state`` of ``state_dict``; empty (a checkpoint from before the adaptive entropy): no step yet."""
        self.coef, self.last_entropy = state.get("coef"), float(state.get("last_entropy", math.inf))
