"""The update schedule over one rollout batch: epochs x optimizer steps, micro-batches, guards.

Model-agnostic: the caller supplies ``policy_logprobs(indices) -> (logprobs [n, T], entropy [n, T] | None)``
for the sequences at ``indices`` (the current policy, with grad). The trainer turns its model into
such a function; tests use plain parameter tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch
from torch import Tensor

from grpolab.algorithms import AlgorithmSpec
from grpolab.losses import NonFiniteError, PolicyLossInput, TokenMetrics, policy_loss, step_denominators

PolicyLogprobs = Callable[[Tensor], tuple[Tensor, Tensor | None]]
# rows of an optimizer step [n] -> their micro-batches (index tensors); None = consecutive slices of micro_batch_size
MicroBatchPlan = Callable[[Tensor], list[Tensor]]
# sums a tensor over the data-parallel ranks, in place (``grpolab.distributed``); None = one process
Reduce = Callable[[Tensor], Tensor]


@dataclass
class UpdateData:
    """One rollout batch, flattened to N = B x G sequences.

    advantages [N]; response_mask [N, T]; old_logprobs [N, T] frozen before the first update, or None
    for a single-update schedule, where the current log-probs detached are exactly those (the policy has
    not moved yet) and no extra forward pass is needed; ref_logprobs / engine_logprobs [N, T] or None.
    """

    advantages: Tensor
    response_mask: Tensor
    old_logprobs: Tensor | None
    ref_logprobs: Tensor | None = None
    engine_logprobs: Tensor | None = None

    def loss_input(self, indices: Tensor, logprobs: Tensor) -> PolicyLossInput:
        pick = lambda t: None if t is None else t[indices]  # noqa: E731
        old = logprobs.detach() if self.old_logprobs is None else self.old_logprobs[indices]
        return PolicyLossInput(logprobs=logprobs, old_logprobs=old,
                               advantages=self.advantages[indices], response_mask=self.response_mask[indices],
                               ref_logprobs=pick(self.ref_logprobs), engine_logprobs=pick(self.engine_logprobs))


@dataclass
class UpdateResult:
    """Counts and merged metrics of all optimizer steps on one rollout batch."""

    attempted: int = 0
    actual: int = 0
    grad_norms: list[float] = field(default_factory=list)
    tokens: TokenMetrics = field(default_factory=TokenMetrics)
    first_step: dict[str, float] = field(default_factory=dict)

    def metrics(self) -> dict[str, float]:
        out = self.tokens.means()
        out.update(attempted_updates=self.attempted, actual_updates=self.actual)
        if self.grad_norms:
            out["grad_norm"] = sum(self.grad_norms) / len(self.grad_norms)
            out["grad_norm_max"] = max(self.grad_norms)
        out.update({f"first_update/{k}": v for k, v in self.first_step.items()})
        return out


def check_schedule(spec: AlgorithmSpec, n_sequences: int, micro_batch_size: int,
                   old_logprobs_missing: bool = False) -> None:
    """Raise ValueError when the batch cannot be split as the schedule asks."""
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    if old_logprobs_missing and not spec.is_single_update:
        raise ValueError("old_logprobs are required for more than one optimizer step per rollout batch")
    if n_sequences % spec.steps_per_epoch:
        raise ValueError(f"rollout batch of {n_sequences} sequences cannot be split into "
                         f"{spec.steps_per_epoch} equal optimizer steps")


def minibatches(spec: AlgorithmSpec, n: int, generator: torch.Generator | None,
                device: torch.device | str = "cpu") -> Iterable[Tensor]:
    """Index tensors [n / steps_per_epoch] on ``device`` of every optimizer step: epochs x steps_per_epoch
    equal slices of [0, n). The shuffle is drawn on the CPU generator, so it is the same on every device."""
    size = n // spec.steps_per_epoch
    for _ in range(spec.epochs):
        shuffle = spec.shuffle_minibatches and spec.steps_per_epoch > 1
        order = torch.randperm(n, generator=generator) if shuffle else torch.arange(n)
        yield from order.to(device).split(size)


@dataclass
class StepGradients:
    """What one optimizer step's accumulation did: its token metrics, and whether any loss was
    backpropagated (False: the step's whole loss is identically zero, nothing to update)."""

    metrics: TokenMetrics
    backward: bool


def rows_with_gradient(spec: AlgorithmSpec, data: UpdateData, indices: Tensor) -> Tensor:
    """Bool [n], on the device of ``indices``: the rows of one step that need a backward pass.

    A row's loss is A_i x (surrogate) + beta x KL: it is identically zero, with zero gradient, when its
    advantage is 0 and there is no KL penalty. Without pruning every row is fed, unless the whole
    step's loss is zero.
    """
    nonzero = data.advantages[indices] != 0
    has_kl = spec.beta > 0 and data.ref_logprobs is not None
    if has_kl or (not spec.prune_zero_advantage and bool(nonzero.any())):
        return torch.ones_like(nonzero)
    return nonzero


def accumulate_gradients(spec: AlgorithmSpec, data: UpdateData, indices: Tensor, policy_logprobs: PolicyLogprobs,
                         micro_batch_size: int, max_new_tokens: int, full_metrics: bool = True,
                         plan: MicroBatchPlan | None = None, reduce: Reduce | None = None) -> StepGradients:
    """Backward the loss of one optimizer step over ``indices`` [n], micro-batch by micro-batch
    (``plan``'s, or slices of ``micro_batch_size``). With ``reduce`` the rows are this rank's share of the
    step: the denominators count the whole step, and ``backward`` is True when any rank's loss is not zero.

    Rows whose loss is identically zero (``rows_with_gradient``) are not backpropagated: their
    gradient is exactly 0 and the denominators still count them, so the gradient is identical. With
    ``full_metrics`` they get a no-grad forward instead, so the token metrics (entropy, KL, ratio)
    cover every response token of the step.
    """
    denominators = step_denominators(spec, data.response_mask[indices], max_new_tokens, reduce)
    grad_rows = rows_with_gradient(spec, data, indices)
    parts = [(indices[grad_rows], True)] + ([(indices[~grad_rows], False)] if full_metrics else [])
    merged = TokenMetrics()
    for rows, with_grad in parts:
        for micro in (plan(rows) if plan else rows.split(micro_batch_size)) if len(rows) else ():
            with torch.set_grad_enabled(with_grad):
                logprobs, entropy = policy_logprobs(micro)
                loss, metrics = policy_loss(data.loss_input(micro, logprobs), spec, denominators)
            if with_grad:
                loss.backward()
            if entropy is not None:
                metrics.add("entropy", entropy, data.response_mask[micro].to(entropy.dtype))
            merged = merged.merge(metrics)
    backward = torch.tensor([float(grad_rows.any())])
    return StepGradients(merged, backward=bool((reduce(backward) if reduce else backward) > 0))


def run_update(spec: AlgorithmSpec, data: UpdateData, policy_logprobs: PolicyLogprobs,
               optimizer: torch.optim.Optimizer, parameters: list[Tensor], *, micro_batch_size: int,
               max_new_tokens: int, max_grad_norm: float | None = 1.0,
               generator: torch.Generator | None = None, full_metrics: bool = True,
               plan: MicroBatchPlan | None = None, reduce: Reduce | None = None) -> UpdateResult:
    """Every optimizer step the schedule asks for on one rollout batch.

    A step whose whole loss is zero (all advantages 0 and no KL penalty) is skipped: counted as
    attempted, not actual, parameters untouched (its metrics are still measured with ``full_metrics``).
    Gradient norm is clipped to ``max_grad_norm`` (None = no clipping); a non-finite norm raises
    NonFiniteError before the optimizer step. Index tensors live on the device of ``data``.

    Data parallel (``reduce``): ``data`` holds this rank's whole groups; each rank accumulates its own
    micro-batches without communicating, then the gradients are summed over the ranks (the loss already
    divides by the global step's denominators), so every rank steps with the gradient one process would
    compute on the global batch and clips by its global norm. Every rank makes the same collective calls
    in the same order (counts, the skip decision, the gradients), whatever its micro-batch count.
    """
    check_schedule(spec, data.advantages.shape[0], micro_batch_size, data.old_logprobs is None)
    result = UpdateResult()
    for indices in minibatches(spec, data.advantages.shape[0], generator, data.advantages.device):
        result.attempted += 1
        optimizer.zero_grad(set_to_none=True)
        step = accumulate_gradients(spec, data, indices, policy_logprobs, micro_batch_size, max_new_tokens,
                                    full_metrics, plan, reduce)
        result.tokens = result.tokens.merge(step.metrics)
        if not step.backward:
            continue
        if reduce is not None:  # a rank without gradient rows still joins the sum, with zeros
            for p in parameters:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                reduce(p.grad)
        grad_norm = torch.nn.utils.clip_grad_norm_(parameters, max_grad_norm if max_grad_norm else float("inf"))
        if not torch.isfinite(grad_norm):
            optimizer.zero_grad(set_to_none=True)
            raise NonFiniteError(f"non-finite gradient norm ({grad_norm.item()}) before optimizer step "
                                 f"{result.actual + 1}")
        optimizer.step()
        result.actual += 1
        result.grad_norms.append(float(grad_norm))
        if result.actual == 1:
            result.first_step = step.metrics.means()
    optimizer.zero_grad(set_to_none=True)
    return result
