"""The update schedule over one rollout batch: epochs x optimizer steps, micro-batches, guards.

Model-agnostic: the caller supplies ``policy_logprobs(indices) -> (logprobs [n, T], entropy [n, T] | None)``
for the sequences at ``indices`` (the current policy, with grad), or, for a loss term beside the objective,
``(logprobs, entropy, extra)``: ``extra`` a 0-dim tensor summed over the forward's response tokens, which the
step adds divided by its response tokens. The trainer turns its model into such a function; tests use
plain parameter tensors.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from grpolab.learning.step_selection import StepSelection, step_selection
from grpolab.objectives.algorithms import AlgorithmSpec
from grpolab.objectives.losses import (
    Denominators,
    NonFiniteError,
    PolicyLossInput,
    TokenMetrics,
    policy_loss,
    raise_if_nonfinite,
    step_denominators,
)
from grpolab.objectives.token_selection import AdaptiveEntropy, bonus_enabled, needs_step_pass
from grpolab.parallel.ranks import Ranks

PolicyLogprobs = Callable[[Tensor], tuple[Tensor, Tensor | None] | tuple[Tensor, Tensor | None, Tensor]]
# rows of an optimizer step [n] -> their micro-batches (index tensors); None = consecutive slices of micro_batch_size
MicroBatchPlan = Callable[[Tensor], list[Tensor]]


@dataclass(frozen=True)
class DataParallelShare:
    """This rank's part of a data-parallel update: its rows ``rows`` of the global batch of ``n_rows``
    sequences (``UpdateData`` holds exactly those, in order), and ``accumulate``: the context in which a
    backward pass only accumulates locally (DDP's ``no_sync``); the step's last backward synchronises.
    ``lockstep``: every forward is a collective (FSDP gathers the weights), so every rank runs as many
    as the busiest rank, the extra ones on a row of its own with a zero loss. ``filler_logprobs``: the forward
    of such a row (None: ``policy_logprobs``), e.g. one that counts in no diagnostic of the caller's."""

    ranks: Ranks
    rows: range
    n_rows: int
    accumulate: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    lockstep: bool = False
    filler_logprobs: PolicyLogprobs | None = None

    def local(self, indices: Tensor) -> Tensor:
        """Global row indices [k] -> the positions in this rank's data of those it holds, in order."""
        inside = (indices >= self.rows.start) & (indices < self.rows.stop)
        return indices[inside] - self.rows.start

    def forwards(self, n_grad: int, n_metric: int, backward: bool) -> tuple[int, int]:
        """How many forwards with and without a backward pass this rank runs in a step where it has ``n_grad``
        and ``n_metric`` micro-batches (``backward``: some rank backpropagates): in lockstep the busiest rank's
        counts; else at least one backward while any rank backpropagates, to join the gradients' all-reduce."""
        if self.lockstep:
            counts = self.ranks.gather((n_grad, n_metric))
            return max(c[0] for c in counts), max(c[1] for c in counts)
        return (max(n_grad, 1) if backward and self.ranks.parallel else n_grad), n_metric


@dataclass
class UpdateData:
    """One rollout batch, flattened to N = B x G sequences.

    advantages [N]; response_mask [N, T]; old_logprobs [N, T] frozen before the first update, or None
    for a single-update schedule, where the current log-probs detached are exactly those (the policy has
    not moved yet) and no extra forward pass is needed; ref_logprobs / engine_logprobs / teacher_logprobs
    [N, T] or None.
    """

    advantages: Tensor
    response_mask: Tensor
    old_logprobs: Tensor | None
    ref_logprobs: Tensor | None = None
    engine_logprobs: Tensor | None = None
    teacher_logprobs: Tensor | None = None

    def loss_input(self, indices: Tensor, logprobs: Tensor) -> PolicyLossInput:
        pick = lambda t: None if t is None else t[indices]  # noqa: E731
        old = logprobs.detach() if self.old_logprobs is None else self.old_logprobs[indices]
        return PolicyLossInput(
            logprobs=logprobs,
            old_logprobs=old,
            advantages=self.advantages[indices],
            response_mask=self.response_mask[indices],
            ref_logprobs=pick(self.ref_logprobs),
            engine_logprobs=pick(self.engine_logprobs),
            teacher_logprobs=pick(self.teacher_logprobs),
        )


@dataclass
class UpdateResult:
    """Counts and merged metrics of all optimizer steps on one rollout batch."""

    attempted: int = 0
    actual: int = 0
    losses: list[float] = field(default_factory=list)  # each optimizer step's loss (skipped ones: 0)
    grad_norms: list[float] = field(default_factory=list)
    tokens: TokenMetrics = field(default_factory=TokenMetrics)
    first_step: dict[str, float] = field(default_factory=dict)
    entropy_coefs: list[float] = field(default_factory=list)  # the entropy bonus's coefficient of each step

    def metrics(self) -> dict[str, float]:
        out = _bonus_mean(self.tokens.means())
        if self.entropy_coefs:
            out["entropy_coef"] = self.entropy_coefs[-1]
        out.update(attempted_updates=self.attempted, actual_updates=self.actual)
        if self.losses:
            out["loss"] = sum(self.losses) / len(self.losses)
        if self.grad_norms:
            out["grad_norm"] = sum(self.grad_norms) / len(self.grad_norms)
            out["grad_norm_max"] = max(self.grad_norms)
        out.update({f"first_update/{k}": v for k, v in self.first_step.items()})
        return out


def _bonus_mean(means: dict[str, float]) -> dict[str, float]:
    """``means`` with ``bonus_entropy`` the mean entropy over the bonus's tokens (the adaptive coefficient's e_k),
    not over all response tokens."""
    if means.get("bonus_tokens"):
        means["bonus_entropy"] = means["bonus_entropy"] / means["bonus_tokens"]
    return means


def check_schedule(
    spec: AlgorithmSpec, n_sequences: int, micro_batch_size: int, old_logprobs_missing: bool = False
) -> None:
    """Raise ValueError when the batch cannot be split as the schedule asks."""
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    if old_logprobs_missing and not spec.is_single_update:
        raise ValueError("old_logprobs are required for more than one optimizer step per rollout batch")
    if n_sequences % spec.steps_per_epoch:
        raise ValueError(
            f"rollout batch of {n_sequences} sequences cannot be split into "
            f"{spec.steps_per_epoch} equal optimizer steps"
        )


def minibatches(
    spec: AlgorithmSpec, n: int, generator: torch.Generator | None, device: torch.device | str = "cpu"
) -> Iterable[Tensor]:
    """Index tensors [n / steps_per_epoch] on ``device`` of every optimizer step: epochs x steps_per_epoch
    equal slices of [0, n). The shuffle is drawn on the CPU generator, so it is the same on every device."""
    size = n // spec.steps_per_epoch
    for _ in range(spec.epochs):
        shuffle = spec.shuffle_minibatches and spec.steps_per_epoch > 1
        order = torch.randperm(n, generator=generator) if shuffle else torch.arange(n)
        yield from order.to(device).split(size)


@dataclass
class StepGradients:
    """What one optimizer step's accumulation did: its token metrics (still on the device; their ``loss``
    is this rank's part of the step's, which the ranks' parts add up to), and whether any loss was
    backpropagated (False: the step's whole loss is identically zero, nothing to update)."""

    metrics: TokenMetrics
    backward: bool


def rows_with_gradient(
    spec: AlgorithmSpec,
    data: UpdateData,
    indices: Tensor,
    any_rank: Callable[[bool], bool] = bool,
    extra_loss: bool = False,
) -> Tensor:
    """Bool [n], on the device of ``indices``: the rows of one step that need a backward pass.

    A row's loss is A_i x (surrogate) + beta x KL (+ its ``extra_loss`` term): it is identically zero, with
    zero gradient, when its advantage is 0 and there is no KL penalty nor extra term (on-policy distillation
    gives every token an advantage of its own: every row is fed). Without pruning every
    row is fed, unless the whole step's loss (on every rank: ``any_rank``) is zero.
    """
    nonzero = data.advantages[indices] != 0
    has_kl = spec.beta > 0 and data.ref_logprobs is not None
    # kl_tau's (log pi / pi_old)^2 has a gradient on every row once the policy moved (with no old log-probs
    # the update is the first and only one: the log-ratio is exactly 0)
    has_kl = has_kl or (spec.kl_tau > 0 and data.old_logprobs is not None)
    has_kl = has_kl and not spec.filter_zero_advantages  # zero-advantage rows then carry no term at all
    if has_kl or extra_loss or spec.needs_teacher or (not spec.prune_zero_advantage and any_rank(bool(nonzero.any()))):
        return torch.ones_like(nonzero)
    return nonzero


# after a step's forwards, before its optimizer step: (log-probs [N, T] detached, bool [N] rows they cover)
StepCheck = Callable[[Tensor, Tensor], None]


def accumulate_gradients(
    spec: AlgorithmSpec,
    data: UpdateData,
    indices: Tensor,
    policy_logprobs: PolicyLogprobs,
    micro_batch_size: int,
    max_new_tokens: int,
    full_metrics: bool = True,
    plan: MicroBatchPlan | None = None,
    dp: DataParallelShare | None = None,
    seen: tuple[Tensor, Tensor] | None = None,
    extra_loss: bool = False,
    generator: torch.Generator | None = None,
    entropy_coef: float | None = None,
) -> StepGradients:
    """Backward the loss of one optimizer step over ``indices`` [n], micro-batch by micro-batch
    (``plan``'s, or slices of ``micro_batch_size``).

    Rows whose loss is identically zero (``rows_with_gradient``) are not backpropagated: their
    gradient is exactly 0 and the denominators still count them, so the gradient is identical. With
    ``full_metrics`` they get a no-grad forward instead, so the token metrics (entropy, KL, ratio)
    cover every response token of the step.

    Data parallel (``dp``): ``indices`` are this rank's rows of the step; the denominators count the whole
    step, and ``backward`` is decided for all ranks at once. Every backward but the last only accumulates;
    the last one synchronises the gradients (summed over the ranks). A rank with no row to backpropagate
    still joins that synchronisation, with a backward of a zero loss on one of its rows (in lockstep,
    every rank pads its forwards to the busiest rank's counts).

    ``seen`` (log-probs [N, T], covered bool [N]) receives the detached log-probs of every row forwarded.
    ``extra_loss``: ``policy_logprobs`` returns an extra term (module docstring), so every row has a gradient.

    Token selection (80/20, Clip-Cov, KL-Cov: ``grpolab.learning.step_selection``): a no-grad pass over the
    step's rows first, the selection over the whole step (Clip-Cov's draw on ``generator``). ``entropy_coef``:
    the entropy bonus's coefficient this step (None: no bonus); with it every row has a gradient.
    """
    ranks = dp.ranks if dp is not None else Ranks()
    denominators = step_denominators(
        spec,
        data.response_mask[indices],
        max_new_tokens,
        ranks.sum_ if ranks.parallel else None,
        advantages=data.advantages[indices],
    )
    split = lambda rows: plan(rows) if plan else list(rows.split(micro_batch_size))  # noqa: E731
    # token selection and the entropy bonus: decided over the whole step
    chosen = None
    if needs_step_pass(spec):
        chosen = step_selection(spec, data, indices, policy_logprobs, split, dp, generator, _recorder(seen))
    grad_rows = rows_with_gradient(spec, data, indices, ranks.any, extra_loss or entropy_coef is not None)
    if chosen is not None and chosen.penalise is not None:  # KL-Cov's penalty has a gradient at any advantage
        grad_rows = grad_rows | chosen.penalise[indices].any(1)
    backward = ranks.any(bool(grad_rows.any()))
    grad_micros = split(indices[grad_rows]) if backward and bool(grad_rows.any()) else []
    rest = indices[~grad_rows] if backward else indices
    metric_micros = split(rest) if full_metrics and len(rest) else []
    accumulate = dp.accumulate if dp is not None else contextlib.nullcontext
    # the selection's pass already computed the metric rows: no second forward of theirs
    n_grad, n_metric = len(grad_micros), 0 if chosen is not None else len(metric_micros)
    if dp is not None:
        n_grad, n_metric = dp.forwards(n_grad, n_metric, backward)
    filler = torch.zeros(1, dtype=torch.long, device=indices.device)  # a row of this rank's, for a zero loss
    filler_logprobs = dp.filler_logprobs if dp is not None and dp.filler_logprobs else policy_logprobs
    merged = TokenMetrics()
    for i in range(n_grad):
        with contextlib.nullcontext() if i == n_grad - 1 else accumulate():
            if i >= len(grad_micros):  # joins the collectives with a zero gradient
                (filler_logprobs(filler)[0].sum() * 0.0).backward()
                continue
            micro = grad_micros[i]
            logprobs, entropy, *extra = policy_logprobs(micro)
            _record(seen, micro, logprobs)
            inp = _selected(data.loss_input(micro, logprobs), chosen, micro, entropy, entropy_coef, denominators)
            loss, metrics = policy_loss(inp, spec, denominators)
            (loss + extra[0] / denominators.kl if extra else loss).backward()
        merged = merged.merge(_with_entropy(metrics, entropy, data.response_mask[micro]))
    for i in range(n_metric):
        with torch.no_grad():
            if i >= len(metric_micros):
                filler_logprobs(filler)
                continue
            micro = metric_micros[i]
            logprobs, entropy, *_ = policy_logprobs(micro)
            _record(seen, micro, logprobs)
            inp = _selected(data.loss_input(micro, logprobs), chosen, micro, entropy, entropy_coef, denominators)
            _, metrics = policy_loss(inp, spec, denominators)
        merged = merged.merge(_with_entropy(metrics, entropy, data.response_mask[micro]))
    for micro in metric_micros if chosen is not None else []:
        logprobs, entropy = chosen.logprobs[micro], chosen.entropy[micro]
        inp = _selected(data.loss_input(micro, logprobs), chosen, micro, entropy, entropy_coef, denominators)
        _, metrics = policy_loss(inp, spec, denominators)
        merged = merged.merge(_with_entropy(metrics, entropy, data.response_mask[micro]))
    return StepGradients(merged, backward=backward)


def _selected(
    inp: PolicyLossInput,
    chosen: StepSelection | None,
    rows: Tensor,
    entropy: Tensor | None,
    coef: float | None,
    denominators: Denominators,
) -> PolicyLossInput:
    """``inp`` with the step's token selection and entropy bonus (over all the step's response tokens when no
    selection narrows it)."""
    if chosen is not None:
        return chosen.loss_input(inp, rows, entropy, coef)
    if coef is not None:
        inp.entropy, inp.bonus = entropy, (coef, denominators.kl, None)
    return inp


def _recorder(seen: tuple[Tensor, Tensor] | None):
    return None if seen is None else (lambda rows, logprobs: _record(seen, rows, logprobs))


def _record(seen: tuple[Tensor, Tensor] | None, rows: Tensor, logprobs: Tensor) -> None:
    if seen is not None:
        seen[0][rows] = logprobs.detach().to(seen[0].dtype)
        seen[1][rows] = True


def _with_entropy(metrics: TokenMetrics, entropy: Tensor | None, mask: Tensor) -> TokenMetrics:
    if entropy is not None:
        metrics.add("entropy", entropy, mask.to(entropy.dtype))
    return metrics


def run_update(
    spec: AlgorithmSpec,
    data: UpdateData,
    policy_logprobs: PolicyLogprobs,
    optimizer: torch.optim.Optimizer,
    parameters: list[Tensor],
    *,
    micro_batch_size: int,
    max_new_tokens: int,
    max_grad_norm: float | None = 1.0,
    generator: torch.Generator | None = None,
    full_metrics: bool = True,
    plan: MicroBatchPlan | None = None,
    dp: DataParallelShare | None = None,
    first_step_check: StepCheck | None = None,
    extra_loss: bool = False,
    entropy_control: AdaptiveEntropy | None = None,
) -> UpdateResult:
    """Every optimizer step the schedule asks for on one rollout batch.

    A step whose whole loss is zero (all advantages 0 and no KL penalty) is skipped: counted as
    attempted, not actual, parameters untouched (its metrics are still measured with ``full_metrics``).
    Gradient norm is clipped to ``max_grad_norm`` (None = no clipping); a non-finite loss, ratio or norm
    raises NonFiniteError before the optimizer step. Index tensors live on the device of ``data``; the
    micro-batches' metrics stay there until the step reads them back, once, with the losses' finiteness.

    Data parallel (``dp``): ``data`` holds this rank's whole groups, ``policy_logprobs`` runs the
    DDP-wrapped forward. The mini-batches are drawn over the global batch (the same shuffle on every
    rank) and each rank takes its rows of each; every rank makes the same collective calls in the same
    order (counts, the skip decision, one synchronising backward, the metrics), whatever its micro-batch
    count, and steps with the gradient one process computes on the global batch, clipped by its norm.

    ``first_step_check`` sees the first step's own forward (the log-probs of the rows it ran, detached)
    before that step updates anything, e.g. the engine-vs-trainer sync check at no extra pass; it may
    raise to stop the update. ``extra_loss``: ``policy_logprobs`` returns an extra loss term (module docstring).

    The entropy bonus (``spec.entropy_coef``, ``use_adaptive_entropy``): each step applies
    ``entropy_control.applied``, which then observes the step's entropy (the run's controller, saved in its
    checkpoints; None: a fresh one, for this call only). Clip-Cov draws its tokens on ``generator``.
    """
    n_rows = dp.n_rows if dp is not None else data.advantages.shape[0]
    check_schedule(spec, n_rows, micro_batch_size, data.old_logprobs is None)
    ranks = dp.ranks if dp is not None else Ranks()
    result = UpdateResult()
    bonus = bonus_enabled(spec)
    entropy_control = entropy_control if entropy_control is not None else AdaptiveEntropy()
    for indices in minibatches(spec, n_rows, generator, data.advantages.device):
        result.attempted += 1
        optimizer.zero_grad(set_to_none=True)
        seen = None
        if first_step_check is not None and result.attempted == 1:
            seen = (
                torch.zeros(data.response_mask.shape, dtype=torch.float32, device=data.response_mask.device),
                torch.zeros(data.response_mask.shape[0], dtype=torch.bool, device=data.response_mask.device),
            )
        step = accumulate_gradients(
            spec,
            data,
            dp.local(indices) if dp is not None else indices,
            policy_logprobs,
            micro_batch_size,
            max_new_tokens,
            full_metrics,
            plan,
            dp,
            seen,
            extra_loss,
            generator,
            coef := entropy_control.applied(spec) if bonus else None,
        )
        metrics = _merge(ranks.gather(step.metrics.on_host()))  # the step's one wait for the device
        try:
            raise_if_nonfinite(metrics)  # on every rank alike: the metrics are the global step's
        except NonFiniteError:
            optimizer.zero_grad(set_to_none=True)
            raise
        if seen is not None:
            first_step_check(*seen)
        if bonus:  # the coefficient applied, then the controller's update from the step's entropy
            result.entropy_coefs.append(coef)
            entropy_control.observe(spec, metrics.sums["bonus_entropy"] / max(metrics.sums["bonus_tokens"], 1.0))
        result.tokens = result.tokens.merge(metrics)
        result.losses.append(metrics.loss)
        if not step.backward:
            continue
        grad_norm = torch.nn.utils.clip_grad_norm_(parameters, max_grad_norm if max_grad_norm else float("inf"))
        grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm  # sharded: global
        grad_norm = float(grad_norm)
        if not math.isfinite(grad_norm):
            optimizer.zero_grad(set_to_none=True)
            raise NonFiniteError(f"non-finite gradient norm ({grad_norm}) before optimizer step {result.actual + 1}")
        optimizer.step()
        result.actual += 1
        result.grad_norms.append(grad_norm)
        if result.actual == 1:
            result.first_step = _bonus_mean(metrics.means())
    optimizer.zero_grad(set_to_none=True)
    return result


def _merge(parts: list[TokenMetrics]) -> TokenMetrics:
    merged = TokenMetrics()
    for part in parts:
        merged = merged.merge(part)
    return merged
