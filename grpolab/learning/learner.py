"""Learning from a rollout batch (steps 3-4 of the loop): group advantages, the frozen log-probs the
objective needs (old policy, reference), the per-step sync check, and the update schedule.

Data parallel: the rollout batch is the global one on every rank; a rank computes the advantages of all
groups, trains on its own block of whole groups through the DDP-wrapped forward, and checks the sync
and reports metrics over the global batch."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from contextlib import AbstractContextManager, contextmanager, nullcontext
from functools import partial
from typing import Any

import torch
from torch import nn

from grpolab.objectives.advantages import advantage_metrics, group_advantages
from grpolab.learning.batching import TrainBatch, collate
from grpolab.rollout.base import Completion
from grpolab.rollout.collect import RolloutBatch
from grpolab.config import RunConfig
from grpolab.parallel.ranks import Ranks, no_sync, wrap_ddp
from grpolab.parallel.fsdp import drop_stale_weights, is_sharded
from grpolab.learning.packing import MicroBatchPlanner, prompt_keys
from grpolab.models.precision import TrainingPrecision
from grpolab.rollout.sync_check import SyncMonitor
from grpolab.models.fidelity import forward_fidelity
from grpolab.models.routing import RouterTally, RoutingTable, routers
from grpolab.learning.shared_prefix import UnitLayout, layout_units, unit_logprobs
from grpolab.learning.update import DataParallelShare, UpdateData, run_update


# the name under which an FSDP-sharded model carries ``unit_logprobs`` as a weight-gathering method
SHARDED_FORWARD = "grpolab_unit_logprobs"


class PolicyForward(nn.Module):
    """The training forward of ``model`` as a module (so that DDP wraps it): a ``UnitLayout`` ->
    (log-probs, entropy or None) [n_rows, width] (``grpolab.learning.shared_prefix.unit_logprobs``; through the
    model's ``SHARDED_FORWARD`` method when FSDP shards it)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, layout: UnitLayout, n_rows: int, width: int, temperature: float, with_entropy: bool,
                chunk_tokens: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        fn = getattr(self.model, SHARDED_FORWARD, None) or (lambda *a, **k: unit_logprobs(self.model, *a, **k))
        stats = fn(layout, n_rows, width, temperature=temperature, with_entropy=with_entropy, chunk_tokens=chunk_tokens)
        return stats.logprobs, stats.entropy


class BatchForward:
    """Training forwards over the rows of one collated batch: micro-batches as planned, rows that share a
    prompt computed as one unit (``grpolab.learning.shared_prefix``) when ``share``."""

    def __init__(self, cfg: RunConfig, batch: TrainBatch, precision: TrainingPrecision, device: torch.device,
                 share: bool, lockstep: Ranks | None = None):
        self.cfg, self.batch, self.precision, self.device = cfg, batch, precision, device
        self.lockstep = lockstep  # every forward a collective over these ranks (FSDP): equal counts
        prompt_lens, seq_lens = batch.prompt_lens.tolist(), batch.attention_mask.sum(1).tolist()
        self.planner = MicroBatchPlanner(
            keys=prompt_keys(batch.input_ids, batch.prompt_lens) if share else list(range(len(batch))),
            prompt_lens=prompt_lens, seq_lens=seq_lens, share=share,
            max_sequences=cfg.optim.micro_batch_size, max_tokens=cfg.optim.micro_batch_tokens)
        # every planned micro-batch of this batch, by id (the tensor is kept, so that its id stays its own)
        self._planned: dict[int, tuple[torch.Tensor, list[int]]] = {}

    def plan(self, rows: torch.Tensor) -> list[torch.Tensor]:
        """The planner's micro-batches of ``rows`` (index tensors on their device). Their rows are read to
        the host here, once per optimizer step, so that the micro-batches' forwards wait for nothing."""
        micros = self.planner.plan(rows)
        host = torch.cat(micros).tolist() if micros else []
        starts = itertools.accumulate((len(m) for m in micros), initial=0)
        self._planned.update((id(m), (m, host[start:start + len(m)])) for m, start in zip(micros, starts))
        return micros

    def _rows(self, indices: torch.Tensor) -> list[int]:
        planned = self._planned.get(id(indices))
        return planned[1] if planned is not None else indices.tolist()

    def logprobs(self, forward: nn.Module, indices: torch.Tensor, with_entropy: bool,
                 around: Callable[[UnitLayout], AbstractContextManager] | None = None):
        """Log-probs (and entropy) [n, T] of the rows ``indices`` (in that order) at the batch width T, by
        ``forward`` (a ``PolicyForward``, DDP-wrapped or not); consecutive rows with the same prompt share
        its computation. ``around(layout)``: a context the forward runs in (an MoE model's routing watch)."""
        units = self.planner.runs(self._rows(indices))
        layout = layout_units(self.batch.input_ids, self.planner.prompt_lens, self.planner.seq_lens, units,
                              shared=any(len(u) > 1 for u in units))
        with self.precision.autocast(self.device), (around(layout) if around is not None else nullcontext()):
            return forward(layout, len(indices), self.batch.input_ids.shape[1], self.cfg.rollout.temperature,
                           with_entropy, self.cfg.model.logprob_chunk_size * len(indices))

    @torch.no_grad()
    def frozen(self, model: nn.Module, around: Callable[[UnitLayout], AbstractContextManager] | None = None):
        """[N, T] log-probs of every row by ``model``, micro-batch by micro-batch as planned, without gradients,
        each forward within ``around(layout)`` (e.g. an MoE model's routing recorded)."""
        forward = PolicyForward(model)
        out = torch.zeros(self.batch.input_ids.shape, dtype=torch.float32, device=self.batch.input_ids.device)
        micros = self.plan(torch.arange(len(self.batch), device=out.device))
        for micro in micros:
            out[micro] = self.logprobs(forward, micro, False, around)[0]
        for _ in range(self.lockstep.max(len(micros)) - len(micros) if self.lockstep else 0):
            self.logprobs(forward, micros[0][:1], False)  # joins the busiest rank's weight gathers
        return out


@contextmanager
def watch_routing(tally: RouterTally | None, table: RoutingTable | None, layout: UnitLayout):
    """Around a training forward of an MoE policy: its routing of the completion tokens tallied, and compared
    with (or replaying) the old forward's record in ``table``. Without ``tally`` (a data-parallel filler row's
    forward) nothing counts; the record is still replayed."""
    counted = layout.completion_masks() if tally is not None else [
        torch.zeros(len(places[0]), dtype=torch.bool) for places in layout.token_places()]
    if table is not None:
        table.at(layout.token_places(), counted)
    with tally.forward(counted) if tally is not None else nullcontext():
        yield


def routing_mismatch(table: RoutingTable, ranks: Ranks) -> dict[str, float]:
    """``router/mismatch``: the share of (completion token, layer) expert choices of the training forwards that
    differed from the old forward's, over every rank."""
    counts = ranks.sum_(torch.stack([table.differing, table.compared]))
    return {"router/mismatch": float(counts[0] / counts[1])} if counts[1] > 0 else {}


def refuse_nonbinary_rewards(rollout: RolloutBatch) -> None:
    """MaxRL's advantage (normalizer 'mean') is defined for RL rewards in {0, 1}: refuse, in one line naming its
    reward terms, the first other reward (the config refuses the settings known to give one; a user function or
    task class shows its values only here)."""
    for example, grades in zip(rollout.examples, rollout.grades):
        for j, grade in enumerate(grades):
            if grade.reward not in (0.0, 1.0):
                terms = ", ".join(f"{n} {v:g}" for n, v in grade.components) or f"answer_reward {grade.answer_reward:g}"
                raise ValueError(f"normalizer 'mean' (MaxRL) needs RL rewards in {{0, 1}}: example {example.id} "
                                 f"sample {j} got {grade.reward:g} (its reward terms: {terms}), and (r - mean) / mean "
                                 "changes sign when a group's mean is negative; make that term 0 or 1, or use "
                                 "another normalizer (e.g. --algo grpo)")


class PolicyLearner:
    """Updates ``model`` with ``optimizer`` from rollout batches (the reference policy is ``reference``,
    computed within ``reference_context``: with LoRA the policy itself with its adapter off); ``updates``
    counts attempted and actual optimizer steps (the run state's counters, updated in place). With several
    ``ranks`` the training forward is wrapped in DDP (which broadcasts rank 0's weights here), unless FSDP
    sharded ``model``."""

    def __init__(self, cfg: RunConfig, model, reference, optimizer: torch.optim.Optimizer,
                 precision: TrainingPrecision, device: torch.device, pad_token_id: int,
                 minibatch_gen: torch.Generator, sync_monitor: SyncMonitor, updates: dict[str, int],
                 ranks: Ranks = Ranks(), reference_context: Callable[[], AbstractContextManager] = nullcontext):
        self.cfg, self.spec, self.ranks = cfg, cfg.algorithm, ranks
        self.model, self.reference, self.optimizer = model, reference, optimizer
        self.reference_context = reference_context  # within it, ``reference`` computes the reference policy
        self.sharded = is_sharded(model)
        if self.sharded:
            optimizer.register_step_post_hook(lambda *_: drop_stale_weights(model))
        self.train_forward = PolicyForward(model)
        if ranks.parallel and not self.sharded:
            self.train_forward = wrap_ddp(self.train_forward, device)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.precision, self.device, self.pad_token_id = precision, device, pad_token_id
        self.minibatch_gen, self.sync_monitor, self.updates = minibatch_gen, sync_monitor, updates
        blocker = None
        if cfg.optim.shared_prompts:  # FSDP gathers weights at every backbone pass: a unit takes two, a lone row one
            blocker = ("FSDP ranks must run the same forwards" if self.sharded
                       else forward_fidelity(model).share_blocker)
        self.share_prompts = cfg.optim.shared_prompts and blocker is None
        # said once, at start: why every sequence is computed on its own
        self.sharing_note = None if blocker is None else f"shared prompts off: {blocker}"

    def forward(self, batch: TrainBatch) -> BatchForward:
        return BatchForward(self.cfg, batch, self.precision, self.device, self.share_prompts,
                            self.ranks if self.sharded else None)

    def routing_of(self, completions: list[Completion]) -> dict[str, float]:
        """An MoE policy's ``router/...`` metrics over the completion tokens of ``completions`` (one forward
        without gradients; every rank passes the same completions, so FSDP ranks run the same forwards);
        nothing for a dense policy."""
        if not routers(self.model) or not completions:
            return {}
        tally = RouterTally(self.model)
        forward = self.forward(collate(completions, self.pad_token_id).to(self.device))
        forward.frozen(self.model, lambda layout: tally.forward(layout.completion_masks()))
        return tally.metrics()

    def learn(self, rollout: RolloutBatch) -> dict[str, Any]:
        """Advantages, sync check and the update schedule over one rollout batch; returns its metrics."""
        if self.spec.normalizer == "mean":
            refuse_nonbinary_rewards(rollout)
        rewards = rollout.rewards()  # [B, G], all groups
        advantages = group_advantages(rewards, self.spec.baseline, self.spec.normalizer, self.spec.adv_eps)
        groups, group_size = self.ranks.groups(len(rollout.completions)), rewards.shape[1]
        mine = [c for group in rollout.completions[groups.start:groups.stop] for c in group]
        batch = collate(mine, self.pad_token_id).to(self.device)
        # With one optimizer step the policy is still the sampling policy: old = current, detached
        # (exactly the log-probs frozen before the update, without a second forward pass), and the sync
        # check reads the update's own forward before its optimizer step.
        forward = self.forward(batch)
        moe = bool(routers(self.model))
        # an MoE policy: its routing in the training forwards, compared with (or replaying) the record of the
        # engine that generated the batch where it made one, else the old-log-prob forward's
        engine_routed = moe and all(c.routed_experts is not None for c in mine)
        table = None
        if moe and (engine_routed or not self.spec.is_single_update):
            table = RoutingTable(self.model, tuple(batch.input_ids.shape))
        balance = self.cfg.model.router_aux_loss_coef
        routing = RouterTally(self.model, balance=balance > 0) if moe else None
        if engine_routed:
            table.fill([c.routed_experts for c in mine])
        if self.spec.is_single_update:
            old = None
        elif engine_routed:  # the old log-probs follow the engine's routing too (with replay)
            with table.attach(self.spec.routing_replay):
                old = forward.frozen(self.model, partial(watch_routing, None, table))
        else:
            old = forward.frozen(self.model, (lambda layout: table.record(layout.token_places())) if table is not None
                                 else None)
        sync: dict[str, float] = {}

        def check_sync(trainer: torch.Tensor, covered: torch.Tensor) -> None:
            # over the global batch, so that every rank takes the same decision
            mask = batch.response_mask * covered.unsqueeze(1).to(batch.response_mask.dtype)
            sync.update(self.sync_monitor.check(*map(self.ranks.stack_rows, (batch.engine_logprobs, trainer, mask))))

        check = self.cfg.rollout.sync_check
        if check and old is not None:
            check_sync(old, torch.ones(len(batch), dtype=torch.bool, device=old.device))
        ref = None
        if self.reference is not None:
            with self.reference_context():
                ref = forward.frozen(self.reference)
        data = UpdateData(advantages=advantages[groups.start:groups.stop].flatten().to(self.device),
                          response_mask=batch.response_mask, old_logprobs=old, ref_logprobs=ref,
                          engine_logprobs=batch.engine_logprobs)
        rows = range(groups.start * group_size, groups.stop * group_size)
        around = partial(watch_routing, routing, table) if moe else None
        filler = partial(watch_routing, None, table) if moe else None
        dp = DataParallelShare(self.ranks, rows, rewards.numel(), lambda: no_sync(self.train_forward),
                               lockstep=self.sharded,
                               filler_logprobs=lambda idx: forward.logprobs(self.train_forward, idx, True, filler)
                               ) if self.ranks.parallel else None
        self.model.train()
        try:
            with table.attach(self.spec.routing_replay) if table is not None else nullcontext():
                def policy(indices: torch.Tensor):
                    logprobs, entropy = forward.logprobs(self.train_forward, indices, True, around)
                    return (logprobs, entropy, balance * routing.balance_sum) if balance else (logprobs, entropy)

                result = run_update(self.spec, data, policy, self.optimizer, self.params, plan=forward.plan,
                                    micro_batch_size=self.cfg.optim.micro_batch_size,
                                    max_new_tokens=self.cfg.rollout.max_new_tokens,
                                    max_grad_norm=self.cfg.optim.max_grad_norm, generator=self.minibatch_gen,
                                    full_metrics=self.cfg.optim.full_metrics, dp=dp,
                                    first_step_check=check_sync if check and old is None else None,
                                    extra_loss=balance > 0)
        finally:
            self.model.eval()
        self.updates["attempted"] += result.attempted
        self.updates["actual"] += result.actual
        return {**advantage_metrics(rewards, advantages), **result.metrics(), **sync,
                **self.ranks.sum_counts(batch.token_counts()),
                **(routing.metrics(self.ranks.sum_) if routing is not None else {}),
                **(routing_mismatch(table, self.ranks) if table is not None else {})}
