"""The policy loss around the per-token surrogate: its exact reduction, the KL terms, the rollout correction, token
selection and the metrics (pure tensor functions). The surrogate itself is the spec's weight, looked up in
``grpolab.objectives.surrogates``.

Shapes: N sequences, T token positions. Position t of every [N, T] tensor refers to the same token;
``response_mask`` is 1 only on tokens the policy generated (EOS included) and 0 on prompt, padding,
tool observations and anything after EOS. Values at masked positions never reach the loss or gradient.

Reductions are exact under micro-batching: the denominators (:class:`Denominators`) are computed once
for the whole optimizer step, and each micro-batch contributes ``sum(...) / denominator``, so summing
micro-batch gradients gives the whole-batch gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from grpolab.objectives.algorithms import AlgorithmSpec
from grpolab.objectives.distillation import distill_advantages, sampled_reverse_kl
from grpolab.objectives.rollout_correction import (
    AUTO,
    Correction,
    engine_kl_k3,
    off_policy_sequence_mask,
    raw_ratio,
    rollout_correction,
)
from grpolab.objectives.surrogates import Surrogate, SurrogateInput, SurrogateOutput, get_surrogate
from grpolab.objectives.token_selection import apply_selection, entropy_bonus


class NonFiniteError(FloatingPointError):
    """A loss, ratio or gradient norm is NaN or infinite; raised before any optimizer step."""


@dataclass
class PolicyLossInput:
    """The data contract of one (micro-)batch of an update.

    logprobs:        [N, T] current policy, requires grad
    old_logprobs:    [N, T] frozen before the first update on this rollout batch
    advantages:      [N]    one per sequence
    response_mask:   [N, T] 1 on policy-generated tokens, else 0
    ref_logprobs:    [N, T] reference policy, optional (KL penalty / metric)
    engine_logprobs: [N, T] rollout engine's log-probs of the sampled tokens, optional
    token selection and entropy (grpolab.objectives.token_selection), decided over the whole step:
    keep:            [N, T] bool, the surrogate counts (False: 0 there; 80/20, Clip-Cov), optional
    penalise:        [N, T] bool, KL-Cov's |logp - logp_old| penalty there, optional
    entropy:         [N, T] the policy's entropy (with grad), for the entropy bonus
    bonus:           (coefficient, the step's bonus tokens, bool [N, T] tokens or None = response_mask)
    teacher_logprobs: [N, T] a frozen teacher's log-probs of the sampled tokens (on-policy distillation), optional
    """

    logprobs: Tensor
    old_logprobs: Tensor
    advantages: Tensor
    response_mask: Tensor
    ref_logprobs: Tensor | None = None
    engine_logprobs: Tensor | None = None
    keep: Tensor | None = None
    penalise: Tensor | None = None
    entropy: Tensor | None = None
    bonus: tuple[float, float, Tensor | None] | None = None
    teacher_logprobs: Tensor | None = None


@dataclass(frozen=True)
class Denominators:
    """Divisors of one optimizer step: of the policy objective and of the KL term (its token count)."""

    policy: float
    kl: float


def step_denominators(
    spec: AlgorithmSpec,
    response_mask: Tensor,
    max_new_tokens: int,
    reduce: Callable[[Tensor], Tensor] | None = None,
    advantages: Tensor | None = None,
) -> Denominators:
    """Denominators for an optimizer step over the sequences of ``response_mask`` [n, T].

    Count every sequence of the step that has a trained token, including those later pruned for zero advantage
    (a row with none, a failed sample's or a rollout's that never called the model, counts in no denominator).
    sequence, sequence_sum -> n; token -> total response tokens; constant -> Z (spec.loss_denominator, else
    n x max_new_tokens: independent of response lengths). Under data parallelism ``reduce`` sums the
    counts over the ranks (``grpolab.parallel.ranks``), so each rank divides by the global step's.
    With ``spec.filter_zero_advantages`` the sequences whose ``advantages`` [n] are 0 are not counted.
    """
    if spec.filter_zero_advantages:
        if advantages is None:
            raise ValueError("filter_zero_advantages: the step's denominators need its advantages")
        response_mask = response_mask[advantages != 0]
    per_row = response_mask.sum(dim=1)
    counts = torch.stack([(per_row > 0).sum().to(torch.float64), per_row.sum().to(torch.float64)]).cpu()
    if reduce is not None:
        counts = reduce(counts)
    n_seqs, n_tokens = max(int(counts[0]), 1), max(float(counts[1]), 1.0)  # a filtered step may count none
    if spec.aggregation in ("sequence", "sequence_sum"):
        policy = float(n_seqs)
    elif spec.aggregation == "token":
        policy = n_tokens
    else:
        policy = spec.loss_denominator or float(n_seqs * max_new_tokens)
    return Denominators(policy=policy, kl=n_tokens)


Number = float | Tensor  # a Python float, or a 0-dim float64 tensor still on the device


@dataclass
class TokenMetrics:
    """Token-summed diagnostics of one or more micro-batches, kept on the device: ``add`` and ``merge``
    never wait for it; ``on_host`` reads them all in one transfer (once per optimizer step), then ``means``.

    loss: the summed objective of the micro-batches (not a token mean); nonfinite: how many of them had a
    non-finite loss or ratio (the update raises ``NonFiniteError`` before its optimizer step).
    """

    tokens: Number = 0.0
    sums: dict[str, Number] = field(default_factory=dict)
    ratio_min: Number = float("inf")
    ratio_max: Number = float("-inf")
    loss: Number = 0.0
    nonfinite: Number = 0.0
    maxima: dict[str, Number] = field(default_factory=dict)  # named maxima over tokens (rollout_is_ratio_max)

    def add(self, name: str, per_token: Tensor, mask: Tensor) -> None:
        self.sums[name] = self.sums.get(name, 0.0) + (per_token.detach().double() * mask).sum()

    def merge(self, other: TokenMetrics) -> TokenMetrics:
        sums = dict(self.sums)
        for k, v in other.sums.items():
            sums[k] = sums.get(k, 0.0) + v
        maxima = dict(self.maxima)
        for k, v in other.maxima.items():
            maxima[k] = _extreme(max, maxima[k], v) if k in maxima else v
        return TokenMetrics(
            self.tokens + other.tokens,
            sums,
            _extreme(min, self.ratio_min, other.ratio_min),
            _extreme(max, self.ratio_max, other.ratio_max),
            self.loss + other.loss,
            self.nonfinite + other.nonfinite,
            maxima,
        )

    def on_host(self) -> TokenMetrics:
        """The same metrics as Python floats, read from the device in one transfer."""
        values = [self.tokens, self.ratio_min, self.ratio_max, self.loss, self.nonfinite, *self.sums.values()]
        values += list(self.maxima.values())
        on_device = [v for v in values if isinstance(v, Tensor)]
        if on_device:
            device = on_device[0].device
            values = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device) for v in values]).tolist()
        tokens, ratio_min, ratio_max, loss, nonfinite, *rest = values
        sums, maxima = rest[: len(self.sums)], rest[len(self.sums) :]
        return TokenMetrics(
            tokens, dict(zip(self.sums, sums)), ratio_min, ratio_max, loss, nonfinite, dict(zip(self.maxima, maxima))
        )

    def means(self) -> dict[str, float]:
        """Per-token means of the sums (read from the device first, if they are still there)."""
        self = self.on_host()
        out = {name: total / max(self.tokens, 1.0) for name, total in self.sums.items()}
        if "clip_low_frac" in out:
            out["clip_frac"] = out["clip_low_frac"] + out["clip_high_frac"]
        if self.tokens:
            out["ratio_min"], out["ratio_max"] = self.ratio_min, self.ratio_max
            out.update(self.maxima)
        out["metric_tokens"] = self.tokens  # response tokens the metrics cover
        return out


def _extreme(pick: Callable, a: Number, b: Number) -> Number:
    """min or max of two numbers, on the device when either is a tensor (without waiting for it)."""
    if not isinstance(a, Tensor) and not isinstance(b, Tensor):
        return pick(a, b)
    tensor_pick = torch.minimum if pick is min else torch.maximum
    device = (a if isinstance(a, Tensor) else b).device
    return tensor_pick(*(torch.as_tensor(x, dtype=torch.float64, device=device) for x in (a, b)))


def _masked(x: Tensor, mask: Tensor) -> Tensor:
    """x where mask is set, else 0 (so garbage at masked positions cannot make NaN/inf)."""
    return torch.where(mask.bool(), x, torch.zeros_like(x))


def token_ratio(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor) -> Tensor:
    """w = exp(logp - logp_old) per token [N, T]; exactly 1 at masked positions."""
    return torch.exp(_masked(logprobs - old_logprobs, mask))


def sequence_ratio(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor) -> Tensor:
    """GSPO's s = exp(mean over response tokens of (logp - logp_old)), [N]."""
    log_ratio = _masked(logprobs - old_logprobs, mask).sum(1) / mask.sum(1).clamp(min=1)
    return torch.exp(log_ratio)


def token_advantages(inp: PolicyLossInput, spec: AlgorithmSpec) -> Tensor:
    """The advantage each token's surrogate reads: the sequence's [N, 1], or with on-policy distillation
    (``spec.needs_teacher``) each token's own [N, T] (``grpolab.objectives.distillation``)."""
    if not spec.needs_teacher:
        return inp.advantages[:, None]
    if inp.teacher_logprobs is None:
        raise ValueError(
            f"algorithm {spec.name} (teacher_kl_coef {spec.teacher_kl_coef:g}) needs the teacher's log-probs"
        )
    return distill_advantages(
        inp.advantages,
        inp.old_logprobs,
        inp.teacher_logprobs,
        inp.response_mask,
        spec.teacher_kl_coef,
        spec.reward_coef,
    )


def per_token_surrogate(inp: PolicyLossInput, spec: AlgorithmSpec) -> SurrogateOutput:
    """Per-token loss [N, T] (to be minimised) and the ratio, low-clip and high-clip indicators [N, T] of the spec's
    weight (``grpolab.objectives.surrogates``).

    The clip indicators mark tokens whose gradient the clip (or CISPO's truncation, DPPO's mask) changed; SAPO's
    gate and VESPO's weight are smooth and mark none.
    """
    weight = get_surrogate(spec.weight)
    mask = inp.response_mask
    logp = _masked(inp.logprobs, mask)
    if weight.ratio == "sequence":
        ratio = sequence_ratio(inp.logprobs, inp.old_logprobs, mask)[:, None].expand_as(logp)
    else:
        ratio = token_ratio(inp.logprobs, inp.old_logprobs, mask)
    x = SurrogateInput(
        logprobs=inp.logprobs,
        old_logprobs=inp.old_logprobs,
        masked_logprobs=logp,
        mask=mask,
        advantages=token_advantages(inp, spec).to(inp.logprobs.dtype),
        sequence_advantages=inp.advantages,
        ratio=ratio,
        folded_correction=_folded_correction(inp, spec, weight),
    )
    out = weight.function(x, **weight.parameters(spec))
    no_clip = torch.zeros_like(logp, dtype=torch.bool)
    low = no_clip if out.clipped_low is None else out.clipped_low
    high = no_clip if out.clipped_high is None else out.clipped_high
    return SurrogateOutput(out.loss, out.ratio, low, high)


def _folded_correction(inp: PolicyLossInput, spec: AlgorithmSpec, weight: Surrogate) -> Tensor | None:
    """log of the rollout-correction weight [N, T] that ``weight`` folds into its own (VESPO's sequence ratio, TRL's
    way: W = pi / pi_engine, not a factor on the loss); None without engine log-probs or that correction."""
    mode = weight.folds_correction
    if mode is None or inp.engine_logprobs is None or spec.rollout_correction != mode:
        return None
    return torch.log(_engine_correction(inp, spec, mode).weight.to(inp.logprobs.dtype))


def _engine_correction(inp: PolicyLossInput, spec: AlgorithmSpec, mode: str) -> Correction:
    """The rollout correction ``mode`` of ``inp``'s batch, r = pi_old / pi_engine, with ``spec``'s bounds."""
    return rollout_correction(
        inp.old_logprobs - inp.engine_logprobs,
        inp.response_mask,
        mode,
        spec.rollout_correction_upper,
        spec.rollout_correction_lower,
    )


def aggregate(per_token: Tensor, mask: Tensor, aggregation: str, denominator: float) -> Tensor:
    """Reduce [N, T] to a scalar: this micro-batch's share of the optimizer step's objective.

    sequence: sum_i(sum_t l*m / sum_t m) / denominator (= sequences in the step)
    sequence_sum: sum_i(sum_t l*m) / denominator (= sequences in the step; LUSPO: a sequence weighs its length)
    token / constant: sum(l*m) / denominator (= tokens in the step, or Z)
    """
    per_token = _masked(per_token, mask)
    if aggregation == "sequence":
        return (per_token.sum(1) / mask.sum(1).clamp(min=1)).sum() / denominator
    return per_token.sum() / denominator


def kl_k3(logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor) -> Tensor:
    """k3 estimator of KL(policy || ref) per token [N, T]: exp(ref - logp) - (ref - logp) - 1."""
    delta = _masked(ref_logprobs - logprobs, mask)
    return torch.exp(delta) - delta - 1


def squared_log_ratio(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor) -> Tensor:
    """(log pi / pi_old)^2 per token [N, T], 0 at masked positions: prime-rl's ``kl_loss`` (times kl_tau, Kimi K2.5's
    penalty toward the sampling policy)."""
    return _masked(logprobs - old_logprobs, mask) ** 2


def apply_rollout_correction(
    surrogate: Tensor, inp: PolicyLossInput, spec: AlgorithmSpec, metrics: TokenMetrics
) -> Tensor:
    """The per-token surrogate [N, T] times the rollout correction's weight, 0 on the tokens it or the
    off-policy sequence mask drops (they still count in the denominators); their metrics go to ``metrics``:
    with engine log-probs always the engine / trainer k3 and the ratio pi_old / pi_engine (mean, max), with a
    correction on its applied weight (mean, max) and the fractions truncated and masked.

    Without engine log-probs the rollout correction is inert (nothing to correct); the off-policy mask then
    measures the sampling policy by ``old_logprobs``.
    """
    mask = inp.response_mask.to(inp.logprobs.dtype)
    keep = None
    if inp.engine_logprobs is not None:  # every step of a run: how far the engine is from the trainer
        log_ratio = inp.old_logprobs.detach().double() - inp.engine_logprobs.double()  # float64: no overflow
        metrics.add("rollout_kl_k3", engine_kl_k3(log_ratio, mask), mask)
        ratio = raw_ratio(log_ratio, mask, "token")  # pi_old / pi_engine, before any correction
        metrics.add("rollout_is_ratio_mean", ratio, mask)
        metrics.maxima["rollout_is_ratio_max"] = ratio.masked_fill(~mask.bool(), float("-inf")).amax()
    # "auto" is a run's to resolve (grpolab.run.parts, from the engine's precision); a spec used on its own
    # keeps what "auto" replaced as the default, none
    mode = "none" if spec.rollout_correction == AUTO else spec.rollout_correction
    folded = get_surrogate(spec.weight).folds_correction is not None  # in the weight (_folded_correction)
    if mode != "none" and inp.engine_logprobs is not None and not folded:
        corr = _engine_correction(inp, spec, mode)
        surrogate, keep = surrogate * corr.weight.to(surrogate.dtype), corr.kept
        metrics.add("rollout_is_weight_mean", corr.weight, mask)
        metrics.maxima["rollout_is_weight_max"] = corr.weight.double().masked_fill(~mask.bool(), float("-inf")).amax()
        metrics.add("rollout_truncated_frac", corr.truncated, mask)
        metrics.add("rollout_masked_frac", ~corr.kept, mask)
    if spec.off_policy_mask_delta is not None:
        sampling = inp.engine_logprobs if inp.engine_logprobs is not None else inp.old_logprobs
        kept = off_policy_sequence_mask(sampling, inp.logprobs, inp.advantages, mask, spec.off_policy_mask_delta)
        metrics.add("off_policy_masked_frac", ~kept, mask)
        keep = kept if keep is None else keep & kept
    if keep is None:
        return surrogate
    return torch.where(keep, surrogate, torch.zeros_like(surrogate))  # 0, not 0 * inf, on dropped tokens


def policy_loss(inp: PolicyLossInput, spec: AlgorithmSpec, denominators: Denominators) -> tuple[Tensor, TokenMetrics]:
    """Scalar loss of one micro-batch (its share of the step) and its token metrics.

    loss = aggregate(surrogate) + beta * sum(k3 * m) / (tokens in the step), k3 times w = pi / pi_old with
    ``use_bias_correction_kl``
    Nothing here waits for the device: a non-finite loss or ratio is counted in ``metrics.nonfinite``
    (``raise_if_nonfinite`` reads it once the step's metrics are on the host).
    """
    mask = inp.response_mask.to(inp.logprobs.dtype)
    surrogate, ratio, clip_low, clip_high = per_token_surrogate(inp, spec)
    metrics = TokenMetrics(tokens=mask.sum().double())
    if inp.keep is not None or inp.penalise is not None:  # 80/20, Clip-Cov, KL-Cov (the step's selection)
        surrogate = apply_selection(surrogate, inp.logprobs, inp.old_logprobs, inp.keep, inp.penalise, spec.kl_cov_coef)
        _selection_metrics(inp, metrics, mask)
    surrogate = apply_rollout_correction(surrogate, inp, spec, metrics)
    loss = aggregate(surrogate, mask, spec.aggregation, denominators.policy)
    if inp.bonus is not None:  # the entropy bonus, a mean over the step's bonus tokens
        coef, bonus_tokens, bonus_mask = inp.bonus
        if inp.entropy is None:
            raise ValueError("the entropy bonus needs the policy's entropies; this forward computes none")
        bonus_mask = mask if bonus_mask is None else mask * bonus_mask.to(mask.dtype)
        loss = loss - entropy_bonus(inp.entropy, bonus_mask, coef, bonus_tokens)
        metrics.add("bonus_entropy", inp.entropy, bonus_mask)
        metrics.add("bonus_tokens", torch.ones_like(mask), bonus_mask)

    # the KL terms' tokens: without the zero-advantage sequences when they leave the step
    in_step = mask * (inp.advantages != 0)[:, None].to(mask.dtype) if spec.filter_zero_advantages else mask
    if inp.ref_logprobs is not None:
        kl = kl_k3(inp.logprobs, inp.ref_logprobs, mask)
        metrics.add("kl_ref", kl, mask)
        if spec.beta > 0:
            if spec.use_bias_correction_kl:  # DeepSeek-V3.2: k3 of samples of pi_old, weighted by pi / pi_old
                kl = kl * token_ratio(inp.logprobs, inp.old_logprobs, mask)
            loss = loss + spec.beta * _masked(kl, in_step).sum() / denominators.kl
    if spec.kl_tau > 0:  # prime-rl's penalty toward the sampling policy, a per-token mean as the KL's
        squared = squared_log_ratio(inp.logprobs, inp.old_logprobs, mask)
        metrics.add("log_ratio_sq", squared, mask)
        loss = loss + spec.kl_tau * (squared * in_step).sum() / denominators.kl

    on_mask = mask.bool()
    finite = torch.isfinite(loss.detach()) & (torch.isfinite(ratio.detach()) | ~on_mask).all()
    metrics.loss, metrics.nonfinite = loss.detach().double(), (~finite).double()

    token_w = token_ratio(inp.logprobs.detach(), inp.old_logprobs, mask)
    metrics.add("ratio_mean", ratio, mask)
    metrics.add("clip_low_frac", clip_low.to(mask.dtype), mask)
    metrics.add("clip_high_frac", clip_high.to(mask.dtype), mask)
    metrics.add("approx_kl_old_new", (token_w - 1) - torch.log(token_w), mask)
    if inp.teacher_logprobs is not None:  # on-policy distillation: how far the sampling policy is from the teacher
        metrics.add("teacher_kl", sampled_reverse_kl(inp.old_logprobs, inp.teacher_logprobs, mask), mask)
    if inp.engine_logprobs is not None:  # trainer vs rollout-engine log-prob mismatch
        metrics.add("engine_logprob_absdiff", (_masked(inp.logprobs.detach() - inp.engine_logprobs, mask)).abs(), mask)
    masked_ratio = ratio.detach().double()
    metrics.ratio_min = masked_ratio.masked_fill(~on_mask, float("inf")).amin()
    metrics.ratio_max = masked_ratio.masked_fill(~on_mask, float("-inf")).amax()
    return loss, metrics


def _selection_metrics(inp: PolicyLossInput, metrics: TokenMetrics, mask: Tensor) -> None:
    """The fractions of response tokens the step's selection kept (80/20, Clip-Cov) and penalised (KL-Cov)."""
    if inp.keep is not None:
        metrics.add("token_keep_frac", inp.keep.to(mask.dtype), mask)
    if inp.penalise is not None:
        metrics.add("kl_cov_frac", inp.penalise.to(mask.dtype), mask)


def raise_if_nonfinite(metrics: TokenMetrics) -> None:
    """NonFiniteError when a micro-batch's loss or ratio was NaN or infinite (``metrics`` on the host)."""
    if metrics.nonfinite:
        raise NonFiniteError(f"non-finite loss ({metrics.loss}) or ratio in the policy update")
