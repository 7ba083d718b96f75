"""An MoE policy's routing around the learner's forwards over one training batch: the routing record the
training forwards are compared with (and, with Rollout Routing Replay, routed by), the router metrics of the
training forwards, and the load-balancing loss they add to the objective.

The learner asks the part of its batch (``batch_routing``) for a context and a watch per forward, and never
branches on the kind of policy: a dense policy's part (``DenseRouting``) watches nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, contextmanager, nullcontext
from functools import partial

import torch
from torch import Tensor, nn

from grpolab.learning.shared_prefix import UnitLayout
from grpolab.learning.update import PolicyLogprobs
from grpolab.models.routing import RouterTally, RoutingTable, routers
from grpolab.objectives.algorithms import AlgorithmSpec

__all__ = [
    "DenseRouting",
    "ForwardWatch",
    "MoeRouting",
    "batch_routing",
    "completion_routing",
    "is_moe",
    "routing_mismatch",
    "watch_routing",
]

# around one forward: its layout -> the context it runs in
ForwardWatch = Callable[[UnitLayout], AbstractContextManager]
# a sum over the data-parallel ranks, in place (``Ranks.sum_``)
Total = Callable[[Tensor], Tensor]


def is_moe(model: nn.Module) -> bool:
    """Whether ``model`` routes through routers whose layout is tested (``grpolab.models.routing.routers``)."""
    return bool(routers(model))


@contextmanager
def watch_routing(tally: RouterTally | None, table: RoutingTable | None, layout: UnitLayout):
    """Around a training forward of an MoE policy: its routing of the completion tokens tallied, and compared
    with (or replaying) the old forward's record in ``table``. Without ``tally`` (a data-parallel filler row's
    forward) nothing counts; the record is still replayed."""
    counted = (
        layout.completion_masks()
        if tally is not None
        else [torch.zeros(len(places[0]), dtype=torch.bool) for places in layout.token_places()]
    )
    if table is not None:
        table.at(layout.token_places(), counted)
    with tally.forward(counted) if tally is not None else nullcontext():
        yield


def routing_mismatch(table: RoutingTable, total: Total) -> dict[str, float]:
    """``router/mismatch``: the share of (completion token, layer) expert choices of the training forwards that
    differed from the old forward's, over every rank (``total``: the sum over the ranks)."""
    counts = total(torch.stack([table.differing, table.compared]))
    return {"router/mismatch": float(counts[0] / counts[1])} if counts[1] > 0 else {}


def completion_routing(model: nn.Module, frozen: Callable[[ForwardWatch], object]) -> dict[str, float]:
    """An MoE ``model``'s ``router/...`` metrics over the completion tokens of the forwards ``frozen(watch)`` runs
    (without gradients, each within ``watch(layout)``)."""
    tally = RouterTally(model)
    frozen(lambda layout: tally.forward(layout.completion_masks()))
    return tally.metrics()


class DenseRouting:
    """A dense policy's part: no routing to watch, record or replay, no loss beside the objective, no metric."""

    old_watch: ForwardWatch | None = None  # around each forward of the old log-probs
    counted: ForwardWatch | None = None  # around each training forward
    uncounted: ForwardWatch | None = None  # around a data-parallel filler row's forward
    extra_loss = False  # the training forward returns a loss term beside the objective

    def old_forward(self) -> AbstractContextManager:
        """The context the old log-probs' forwards run in."""
        return nullcontext()

    def training(self) -> AbstractContextManager:
        """The context the update's forwards (and their backward passes) run in."""
        return nullcontext()

    def with_aux_loss(self, policy: PolicyLogprobs) -> PolicyLogprobs:
        """The training forward ``policy``, with the loss term beside the objective where there is one."""
        return policy

    def metrics(self, total: Total) -> dict[str, float]:
        """The batch's routing metrics after the update, summed over the ranks by ``total``."""
        return {}


class MoeRouting(DenseRouting):
    """An MoE policy's routing over one training batch of ``shape`` [N, T] whose rows the engine routed as
    ``routed`` (``Completion.routed_experts``, None where it made no record).

    The record (``RoutingTable``): the engine's where it made one for every row (the old log-probs' forward then
    follows it too), else the old log-probs' forward's; none with one optimizer step and no engine record.
    Within ``training()`` every training forward is compared with the record and, with ``spec.routing_replay``,
    routed by it. The training forwards' routing is tallied (``RouterTally``) over the completion tokens, and with
    ``aux_loss_coef`` > 0 each adds that times its load-balancing loss to the objective."""

    def __init__(
        self,
        model: nn.Module,
        spec: AlgorithmSpec,
        aux_loss_coef: float,
        shape: tuple[int, int],
        routed: list[Tensor | None],
    ):
        engine_routed = all(r is not None for r in routed)
        self.replay, self.balance = spec.routing_replay, aux_loss_coef
        self.table = RoutingTable(model, shape) if engine_routed or not spec.is_single_update else None
        self.tally = RouterTally(model, balance=aux_loss_coef > 0)
        self.extra_loss = aux_loss_coef > 0
        self.engine_routed = engine_routed
        if engine_routed:
            self.table.fill(routed)
        self.counted = partial(watch_routing, self.tally, self.table)
        self.uncounted = partial(watch_routing, None, self.table)
        if engine_routed:  # the old log-probs follow the engine's routing too (with replay)
            self.old_watch = self.uncounted
        elif self.table is not None:
            self.old_watch = lambda layout: self.table.record(layout.token_places())

    def old_forward(self) -> AbstractContextManager:
        return self.table.attach(self.replay) if self.engine_routed else nullcontext()

    def training(self) -> AbstractContextManager:
        return self.table.attach(self.replay) if self.table is not None else nullcontext()

    def with_aux_loss(self, policy: PolicyLogprobs) -> PolicyLogprobs:
        if not self.balance:
            return policy

        def with_loss(indices: Tensor):
            logprobs, entropy = policy(indices)
            return logprobs, entropy, self.balance * self.tally.balance_sum

        return with_loss

    def metrics(self, total: Total) -> dict[str, float]:
        return {**self.tally.metrics(total), **(routing_mismatch(self.table, total) if self.table is not None else {})}


def batch_routing(
    model: nn.Module, spec: AlgorithmSpec, aux_loss_coef: float, shape: tuple[int, int], routed: list[Tensor | None]
) -> DenseRouting:
    """The routing part of one training batch: ``MoeRouting`` for an MoE ``model``, else ``DenseRouting``."""
    return MoeRouting(model, spec, aux_loss_coef, shape, routed) if is_moe(model) else DenseRouting()
