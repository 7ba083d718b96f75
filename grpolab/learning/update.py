"""The update schedule over one rollout batch: epochs x optimizer steps, micro-batches, guards.

Model-agnostic: the caller supplies ``policy_logprobs(indices) -> (logprobs [n, T], entropy [n, T] | None)``
for the sequences at ``indices`` (the current policy, with grad), or, for a loss term beside the objective,
``(logprobs, entropy, extra)``: ``extra`` a 0-dim tensor summed over the forward's response tokens, which the
step adds divided by its response tokens. The trainer turns its model into such a function; tests use
plain parameter tensors.

How an update is composed: ``run_update`` draws the optimizer steps (``minibatches``) and, for each, builds a
``StepContext`` (the step's rows, this rank's ``DataParallelShare``, the entropy bonus's coefficient, the first
step's ``ForwardRecord``). ``accumulate_gradients`` turns it into a ``StepPlan`` once (denominators over the whole
step, its token selection, which rows need a gradient, the ``MicroBatch`` list with the ranks' padding) and runs
one loop over that list, each micro-batch by ``MicroBatchPass``. Then the step's metrics are gathered and checked,
the entropy bonus observes them, and ``Trainee.step`` clips and steps.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import cached_property

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
# after a step's forwards, before its optimizer step: (log-probs [N, T] detached, bool [N] rows they cover)
StepCheck = Callable[[Tensor, Tensor], None]


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

    @classmethod
    def solo(cls, n_rows: int) -> DataParallelShare:
        """One process's share of a batch of ``n_rows``: every row, nothing to agree on with anyone."""
        return cls(Ranks(), range(n_rows), n_rows)

    def local(self, indices: Tensor) -> Tensor:
        """Global row indices [k] -> the positions in this rank's data of those it holds, in order."""
        if not self.ranks.parallel and self.rows == range(self.n_rows):  # all of them, where they are
            return indices
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

    def denominator_sum(self) -> Callable[[Tensor], Tensor] | None:
        """How a step's counts are summed over the ranks (None: one process's are the step's)."""
        return self.ranks.sum_ if self.ranks.parallel else None


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


@dataclass(frozen=True)
class UpdateSchedule:
    """How an update splits and steps: micro-batches of at most ``micro_batch_size`` rows (``plan``'s, when
    given), the constant denominator's ``max_new_tokens``, the gradient norm clipped to ``max_grad_norm`` (None:
    no clipping), ``full_metrics``: the rows without a gradient get a no-grad forward, so the token metrics
    cover every response token. ``generator`` draws the mini-batches' shuffle and Clip-Cov's tokens (a run's,
    saved in its checkpoints; None: Clip-Cov draws on a generator seeded 0 per step)."""

    micro_batch_size: int
    max_new_tokens: int
    max_grad_norm: float | None = 1.0
    full_metrics: bool = True
    plan: MicroBatchPlan | None = None
    generator: torch.Generator | None = None

    def split(self, rows: Tensor) -> list[Tensor]:
        """The micro-batches (index tensors) of ``rows`` [n]."""
        return self.plan(rows) if self.plan else list(rows.split(self.micro_batch_size))


@dataclass(frozen=True)
class Trainee:
    """The policy an update trains: ``logprobs`` its training forward (module docstring), ``parameters`` the
    tensors ``optimizer`` steps; ``extra_loss``: ``logprobs`` returns a loss term beside the objective (an MoE's
    load-balancing loss), so every row has a gradient. ``cast_scope``: the context one optimizer step's
    micro-batches and backwards run in, between two optimizer steps (``accumulate_gradients``; the learner's is
    ``grpolab.learning.learner.BatchForward.cast_scope``): with float32 master weights and bf16 compute, one
    autocast context, so that each weight is cast to bf16 once per optimizer step (autocast keeps a cast until its
    outermost context ends) instead of once per micro-batch."""

    logprobs: PolicyLogprobs
    optimizer: torch.optim.Optimizer
    parameters: list[Tensor]
    extra_loss: bool = False
    cast_scope: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def step(self, max_grad_norm: float | None, number: int) -> float:
        """Clip the accumulated gradient to ``max_grad_norm`` (None: no clipping) and step optimizer step
        ``number``; returns the norm before clipping (sharded: the global one). A non-finite norm raises
        NonFiniteError with the gradients cleared and nothing updated."""
        grad_norm = torch.nn.utils.clip_grad_norm_(self.parameters, max_grad_norm if max_grad_norm else float("inf"))
        grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
        if not math.isfinite(grad_norm):
            self.zero_grad()
            raise NonFiniteError(f"non-finite gradient norm ({grad_norm}) before optimizer step {number}")
        self.optimizer.step()
        return grad_norm


@dataclass(frozen=True)
class UpdateHooks:
    """What an update works with beside its policy: ``dp`` this rank's share of a data-parallel batch (None: one
    process); ``entropy_control`` the entropy bonus's coefficient (the run's controller, saved in its checkpoints;
    None: a fresh one, for this call only); ``first_step_check`` sees the first step's own forward before that
    step updates anything (it may raise to stop the update)."""

    dp: DataParallelShare | None = None
    entropy_control: AdaptiveEntropy | None = None
    first_step_check: StepCheck | None = None


class ForwardRecord:
    """The detached log-probs [N, T] (float32) of every row a step forwarded, and which rows bool [N] they cover."""

    def __init__(self, response_mask: Tensor):
        self.logprobs = torch.zeros(response_mask.shape, dtype=torch.float32, device=response_mask.device)
        self.covered = torch.zeros(response_mask.shape[0], dtype=torch.bool, device=response_mask.device)

    def __call__(self, rows: Tensor, logprobs: Tensor) -> None:
        self.logprobs[rows] = logprobs.detach().to(self.logprobs.dtype)
        self.covered[rows] = True


class EntropyBonus:
    """The entropy bonus of an update of ``spec``: each step's coefficient (None: no bonus), then the step's
    entropy observed by ``control`` (Skywork-OR1's adaptive coefficient)."""

    def __init__(self, spec: AlgorithmSpec, control: AdaptiveEntropy | None):
        self.spec, self.enabled = spec, bonus_enabled(spec)
        self.control = control if control is not None else AdaptiveEntropy()

    def coef(self) -> float | None:
        return self.control.applied(self.spec) if self.enabled else None

    def observe(self, coef: float | None, metrics: TokenMetrics, result: UpdateResult) -> None:
        """The step applied ``coef`` and measured ``metrics`` (on the host, all ranks'): logged, then observed."""
        if self.enabled:
            result.entropy_coefs.append(coef)
            self.control.observe(self.spec, metrics.sums["bonus_entropy"] / max(metrics.sums["bonus_tokens"], 1.0))


@dataclass(frozen=True)
class StepContext:
    """One optimizer step of ``spec`` over ``data`` as the update hands it over: ``indices`` [n] this rank's rows of
    the step (positions in ``data``), split by ``schedule``; ``dp`` this rank's share (None: one process's); ``entropy_coef`` the entropy
    bonus's coefficient (None: no bonus; with it every row has a gradient); ``extra_loss`` as ``Trainee``'s;
    ``record`` receives the detached log-probs of every row forwarded (None: nobody reads them)."""

    spec: AlgorithmSpec
    data: UpdateData
    indices: Tensor
    schedule: UpdateSchedule
    dp: DataParallelShare | None = None
    entropy_coef: float | None = None
    extra_loss: bool = False
    record: Callable[[Tensor, Tensor], None] | None = None

    @cached_property
    def share(self) -> DataParallelShare:
        """``dp``, or one process's share of ``data``."""
        return self.dp if self.dp is not None else DataParallelShare.solo(self.data.advantages.shape[0])

    def remember(self, rows: Tensor, logprobs: Tensor) -> None:
        if self.record is not None:
            self.record(rows, logprobs)


@dataclass(frozen=True)
class MicroBatch:
    """One forward of a step: ``rows`` [m] of this rank's data (None: a row of its own that only joins the ranks'
    collectives, with a zero loss); ``backward``: its loss is backpropagated, the step's last backward
    (``synchronise``) summing the ranks' gradients, the others accumulating; ``precomputed``: the token
    selection's pass already holds its log-probs and entropies (no forward)."""

    rows: Tensor | None
    backward: bool
    synchronise: bool = False
    precomputed: bool = False

    def context(self, share: DataParallelShare) -> contextlib.AbstractContextManager:
        """The context it runs in: no gradients, the ranks' local accumulation, or the synchronising backward."""
        if not self.backward:
            return torch.no_grad()
        return contextlib.nullcontext() if self.synchronise else share.accumulate()


@dataclass(frozen=True)
class StepPlan:
    """What a step decides before its gradient forwards: ``denominators`` over the whole step (all ranks),
    ``selection`` its tokens (80/20, Clip-Cov, KL-Cov; None: every token), ``micro_batches`` in the order they
    run, ``backward``: some rank backpropagates (False: the step's whole loss is identically zero)."""

    step: StepContext
    denominators: Denominators
    selection: StepSelection | None
    micro_batches: list[MicroBatch]
    backward: bool

    def loss_input(self, rows: Tensor, logprobs: Tensor, entropy: Tensor | None) -> PolicyLossInput:
        """The loss input of ``rows`` [m] with the step's token selection and entropy bonus (over all the step's
        response tokens when no selection narrows it)."""
        inp, coef = self.step.data.loss_input(rows, logprobs), self.step.entropy_coef
        if self.selection is not None:
            return self.selection.loss_input(inp, rows, entropy, coef)
        if coef is not None:
            inp.entropy, inp.bonus = entropy, (coef, self.denominators.kl, None)
        return inp


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


def plan_step(step: StepContext, policy_logprobs: PolicyLogprobs) -> StepPlan:
    """The step's plan: its denominators (counting every row of the step on every rank), then, with token
    selection, the selection's no-grad pass and choice; the rows that need a gradient (``rows_with_gradient``,
    and KL-Cov's penalised rows, which have one at any advantage), decided for all ranks at once."""
    spec, data, indices, share = step.spec, step.data, step.indices, step.share
    denominators = step_denominators(
        spec,
        data.response_mask[indices],
        step.schedule.max_new_tokens,
        share.denominator_sum(),
        advantages=data.advantages[indices],
    )
    selection = step_selection(step, policy_logprobs) if needs_step_pass(spec) else None
    grad_rows = rows_with_gradient(
        spec, data, indices, share.ranks.any, step.extra_loss or step.entropy_coef is not None
    )
    if selection is not None and selection.penalise is not None:
        grad_rows = grad_rows | selection.penalise[indices].any(1)
    mine = bool(grad_rows.any())
    backward = share.ranks.any(mine)
    micro_batches = _micro_batches(step, grad_rows if mine else None, backward, selection is not None)
    return StepPlan(step, denominators, selection, micro_batches, backward)


def _micro_batches(step: StepContext, grad_rows: Tensor | None, backward: bool, precomputed: bool) -> list[MicroBatch]:
    """The step's micro-batches in the order they run: the backpropagated ones over the rows of ``grad_rows``
    bool [n] (None: this rank has none), then, with ``full_metrics``, the no-grad ones over the other rows (all of
    them when no rank backpropagates), each kind padded to this rank's share of forwards; when the token
    selection's pass (``precomputed``) already computed the other rows, they come last, without a forward."""
    indices, split, share = step.indices, step.schedule.split, step.share
    grad = split(indices[grad_rows]) if backward and grad_rows is not None else []
    rest = indices[~grad_rows] if backward and grad_rows is not None else indices
    metric = split(rest) if step.schedule.full_metrics and len(rest) else []
    forwarded = [] if precomputed else metric
    n_grad, n_metric = share.forwards(len(grad), len(forwarded), backward)
    fillers = lambda micros, n: micros + [None] * (n - len(micros))  # noqa: E731
    return [
        *(MicroBatch(rows, True, synchronise=i == n_grad - 1) for i, rows in enumerate(fillers(grad, n_grad))),
        *(MicroBatch(rows, False) for rows in fillers(forwarded, n_metric)),
        *(MicroBatch(rows, False, precomputed=True) for rows in (metric if precomputed else [])),
    ]


class MicroBatchPass:
    """Runs one micro-batch of ``plan`` through ``policy_logprobs``: its forward (or the selection's pass's
    values), the loss over the step's denominators, the backward when it has one; its token metrics."""

    def __init__(self, plan: StepPlan, policy_logprobs: PolicyLogprobs):
        self.plan, self.policy_logprobs = plan, policy_logprobs
        self.filler_logprobs = plan.step.share.filler_logprobs or policy_logprobs

    def __call__(self, micro: MicroBatch) -> TokenMetrics | None:
        """The token metrics of ``micro`` (on the device), or None for a filler row."""
        if micro.rows is None:
            self._join_collectives(micro)
            return None
        logprobs, entropy, extra = self._forward(micro)
        plan, rows = self.plan, micro.rows
        loss, metrics = policy_loss(plan.loss_input(rows, logprobs, entropy), plan.step.spec, plan.denominators)
        if micro.backward:
            backward(loss + extra / plan.denominators.kl if extra is not None else loss)
        return _with_entropy(metrics, entropy, plan.step.data.response_mask[rows])

    def _forward(self, micro: MicroBatch) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """(log-probs [m, T], entropy [m, T] or None, the extra loss term or None) of the micro-batch's rows."""
        if micro.precomputed:
            selection = self.plan.selection
            return selection.logprobs[micro.rows], selection.entropy[micro.rows], None
        logprobs, entropy, *extra = self.policy_logprobs(micro.rows)
        self.plan.step.remember(micro.rows, logprobs)
        return logprobs, entropy, extra[0] if extra and micro.backward else None

    def _join_collectives(self, micro: MicroBatch) -> None:
        """A forward (and backward of a zero loss) on a row of this rank's, as many as the busiest rank's."""
        filler = torch.zeros(1, dtype=torch.long, device=self.plan.step.indices.device)
        logprobs = self.filler_logprobs(filler)[0]
        if micro.backward:
            backward(logprobs.sum() * 0.0)


def backward(loss: Tensor) -> None:
    """``loss.backward()`` with autocast off. Within a step's ``cast_scope`` (an autocast context around its
    forwards) a backward would otherwise run under autocast, which casts the backward's own float32 matmuls to
    bf16: the gradient would no longer be the one the graph recorded."""
    with torch.autocast(loss.device.type, enabled=False):
        loss.backward()


def _with_entropy(metrics: TokenMetrics, entropy: Tensor | None, mask: Tensor) -> TokenMetrics:
    if entropy is not None:
        metrics.add("entropy", entropy, mask.to(entropy.dtype))
    return metrics


def accumulate_gradients(
    step: StepContext,
    policy_logprobs: PolicyLogprobs,
    cast_scope: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> StepGradients:
    """Backward the loss of one optimizer step over ``step.indices`` [n], micro-batch by micro-batch
    (``step.schedule``'s split), in one loop over the step's plan (``plan_step``), within ``cast_scope``
    (``Trainee.cast_scope``). The backpropagated micro-batches run first: a weight's cast is made, and kept, by a
    forward that records its gradient, never by a no-grad one (whose cast would carry no gradient).

    Rows whose loss is identically zero (``rows_with_gradient``) are not backpropagated: their
    gradient is exactly 0 and the denominators still count them, so the gradient is identical. With
    ``full_metrics`` they get a no-grad forward instead, so the token metrics (entropy, KL, ratio)
    cover every response token of the step.

    Data parallel (``step.dp``): ``indices`` are this rank's rows of the step; the denominators count the whole
    step, and ``backward`` is decided for all ranks at once. Every backward but the last only accumulates;
    the last one synchronises the gradients (summed over the ranks). A rank with no row to backpropagate
    still joins that synchronisation, with a backward of a zero loss on one of its rows (in lockstep,
    every rank pads its forwards to the busiest rank's counts).

    Token selection (80/20, Clip-Cov, KL-Cov: ``grpolab.learning.step_selection``): a no-grad pass over the
    step's rows first, the selection over the whole step (Clip-Cov's draw on the schedule's ``generator``); the
    rows that pass covered need no second forward for their metrics.
    """
    plan = plan_step(step, policy_logprobs)
    run = MicroBatchPass(plan, policy_logprobs)
    merged = TokenMetrics()
    with cast_scope():
        for micro in plan.micro_batches:
            with micro.context(step.share):
                metrics = run(micro)
            if metrics is not None:
                merged = merged.merge(metrics)
    return StepGradients(merged, backward=plan.backward)


def run_update(
    spec: AlgorithmSpec,
    data: UpdateData,
    trainee: Trainee,
    schedule: UpdateSchedule,
    hooks: UpdateHooks = UpdateHooks(),
) -> UpdateResult:
    """Every optimizer step the schedule asks for on one rollout batch.

    A step whose whole loss is zero (all advantages 0 and no KL penalty) is skipped: counted as
    attempted, not actual, parameters untouched (its metrics are still measured with ``full_metrics``).
    A non-finite loss, ratio or gradient norm raises NonFiniteError before the optimizer step. Index tensors
    live on the device of ``data``; the micro-batches' metrics stay there until the step reads them back,
    once, with the losses' finiteness.

    Data parallel (``hooks.dp``): ``data`` holds this rank's whole groups, ``trainee.logprobs`` runs the
    DDP-wrapped forward. The mini-batches are drawn over the global batch (the same shuffle on every
    rank) and each rank takes its rows of each; every rank makes the same collective calls in the same
    order (counts, the skip decision, one synchronising backward, the metrics), whatever its micro-batch
    count, and steps with the gradient one process computes on the global batch, clipped by its norm.

    The entropy bonus (``spec.entropy_coef``, ``use_adaptive_entropy``): each step applies the coefficient of
    ``hooks.entropy_control``, which then observes the step's entropy.
    """
    share = hooks.dp if hooks.dp is not None else DataParallelShare.solo(data.advantages.shape[0])
    check_schedule(spec, share.n_rows, schedule.micro_batch_size, data.old_logprobs is None)
    bonus, result = EntropyBonus(spec, hooks.entropy_control), UpdateResult()
    for indices in minibatches(spec, share.n_rows, schedule.generator, data.advantages.device):
        result.attempted += 1
        trainee.zero_grad()
        first_check = hooks.first_step_check if result.attempted == 1 else None
        record = ForwardRecord(data.response_mask) if first_check is not None else None
        coef = bonus.coef()
        step = StepContext(spec, data, share.local(indices), schedule, share, coef, trainee.extra_loss, record)
        gradients = accumulate_gradients(step, trainee.logprobs, trainee.cast_scope)
        metrics = _global_metrics(gradients.metrics, share.ranks, trainee)  # the step's one wait for the device
        if first_check is not None:
            first_check(record.logprobs, record.covered)
        bonus.observe(coef, metrics, result)
        result.tokens = result.tokens.merge(metrics)
        result.losses.append(metrics.loss)
        if gradients.backward:
            result.grad_norms.append(trainee.step(schedule.max_grad_norm, result.actual + 1))
            result.actual += 1
            if result.actual == 1:
                result.first_step = _bonus_mean(metrics.means())
    trainee.zero_grad()
    return result


def _global_metrics(metrics: TokenMetrics, ranks: Ranks, trainee: Trainee) -> TokenMetrics:
    """The step's token metrics over every rank, on the host; a non-finite loss or ratio raises NonFiniteError
    (on every rank alike: the metrics are the global step's) with the gradients cleared."""
    merged = TokenMetrics()
    for part in ranks.gather(metrics.on_host()):
        merged = merged.merge(part)
    try:
        raise_if_nonfinite(merged)
    except NonFiniteError:
        trainee.zero_grad()
        raise
    return merged
