"""Learning from a rollout batch (steps 3-4 of the loop). ``PolicyLearner.learn`` reads as the loop: group
advantages, this rank's part of the batch, the frozen log-probs the objective needs (old policy, reference),
the per-step sync check, the update (``PolicyLearner.update``: per optimizer step its forwards, loss, backward
and step), the batch's metrics.

Two parts work around it: the batch's routing (``grpolab.learning.moe_routing``: an MoE policy's routing record,
replay, router metrics and load-balancing loss; nothing for a dense policy) and the data-parallel ranks'
lockstep (``grpolab.learning.lockstep``): the rollout batch is the global one on every rank; a rank computes the
advantages of all groups, trains on its own block of whole groups through the DDP-wrapped forward, and checks
the sync and reports metrics over the global batch."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn

from grpolab.learning.batching import TrainBatch, collate
from grpolab.learning.lockstep import RankPart, UpdateLockstep
from grpolab.learning.moe_routing import DenseRouting, batch_routing, completion_routing, is_moe
from grpolab.learning.packing import MicroBatchPlanner, prompt_keys
from grpolab.learning.settings import LearnerSettings
from grpolab.learning.shared_prefix import UnitLayout, layout_units, unit_logprobs
from grpolab.learning.update import (
    StepCheck,
    Trainee,
    UpdateData,
    UpdateHooks,
    UpdateResult,
    UpdateSchedule,
    run_update,
)
from grpolab.models.fidelity import forward_fidelity
from grpolab.models.grouped_attention import grouped_kv_attention
from grpolab.models.precision import TrainingPrecision
from grpolab.objectives.advantages import advantage_metrics, batch_advantages
from grpolab.objectives.algorithms import AlgorithmSpec
from grpolab.objectives.rollout_correction import AUTO
from grpolab.objectives.token_selection import AdaptiveEntropy
from grpolab.parallel.fsdp import drop_stale_weights, is_sharded
from grpolab.parallel.ranks import Ranks, wrap_ddp
from grpolab.rollout.base import Completion
from grpolab.rollout.collect import RolloutBatch
from grpolab.rollout.sync_check import SyncMonitor

# the name under which an FSDP-sharded model carries ``unit_logprobs`` as a weight-gathering method
SHARDED_FORWARD = "grpolab_unit_logprobs"


class PolicyForward(nn.Module):
    """The training forward of ``model`` as a module (so that DDP wraps it): a ``UnitLayout`` ->
    (log-probs, entropy or None) [n_rows, width] (``grpolab.learning.shared_prefix.unit_logprobs``; through the
    model's ``SHARDED_FORWARD`` method when FSDP shards it)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(
        self, layout: UnitLayout, n_rows: int, width: int, temperature: float, with_entropy: bool, chunk_tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        fn = getattr(self.model, SHARDED_FORWARD, None) or (lambda *a, **k: unit_logprobs(self.model, *a, **k))
        stats = fn(layout, n_rows, width, temperature=temperature, with_entropy=with_entropy, chunk_tokens=chunk_tokens)
        return stats.logprobs, stats.entropy


class BatchForward:
    """Training forwards over the rows of one collated batch: micro-batches as planned, rows that share a
    prompt computed as one unit (``grpolab.learning.shared_prefix``) when ``share``."""

    def __init__(
        self,
        cfg: LearnerSettings,
        batch: TrainBatch,
        precision: TrainingPrecision,
        device: torch.device,
        share: bool,
        lockstep: Ranks | None = None,
    ):
        self.cfg, self.batch, self.precision, self.device = cfg, batch, precision, device
        self.lockstep = lockstep  # every forward a collective over these ranks (FSDP): equal counts
        prompt_lens, seq_lens = batch.prompt_lens.tolist(), batch.attention_mask.sum(1).tolist()
        self.planner = MicroBatchPlanner(
            keys=prompt_keys(batch.input_ids, batch.prompt_lens) if share else list(range(len(batch))),
            prompt_lens=prompt_lens,
            seq_lens=seq_lens,
            share=share,
            max_sequences=cfg.optim.micro_batch_size,
            max_tokens=cfg.optim.micro_batch_tokens,
        )
        # every planned micro-batch of this batch, by id (the tensor is kept, so that its id stays its own)
        self._planned: dict[int, tuple[torch.Tensor, list[int]]] = {}

    @contextmanager
    def cast_scope(self, model: nn.Module) -> Iterator[None]:
        """The context a run of ``model``'s forwards over unchanging weights spans, backwards included (one
        optimizer step's micro-batches, a frozen pass): the precision's autocast, in which each float32 master
        weight is cast to bf16 once (autocast keeps a leaf weight's cast until its outermost context ends) and not
        at every forward, and the training ``attention``, so that a backward's recomputation (gradient
        checkpointing) attends as its forward did. No autocast where no weight is cast (float32, bf16 storage),
        nor under FSDP (``lockstep``), which gathers and frees the weights around each forward: a cast kept across
        forwards would keep a whole bf16 copy alive."""
        with nullcontext() if self.lockstep else self.precision.autocast(self.device), self.attention(model):
            yield

    def attention(self, model: nn.Module) -> AbstractContextManager:
        """In bf16 on a CPU, ``model``'s training forward attends through ``grpolab.models.grouped_attention``'s
        ``SDPA_GROUPED`` (grouped key/value heads as they are; with gradients, bf16 attention with a float32
        backward, the faster there); otherwise as the model's config says."""
        if self.precision.compute != torch.bfloat16:
            return nullcontext()
        return grouped_kv_attention(model)

    def plan(self, rows: torch.Tensor) -> list[torch.Tensor]:
        """The planner's micro-batches of ``rows`` (index tensors on their device). Their rows are read to
        the host here, once per optimizer step, so that the micro-batches' forwards wait for nothing."""
        micros = self.planner.plan(rows)
        host = torch.cat(micros).tolist() if micros else []
        starts = itertools.accumulate((len(m) for m in micros), initial=0)
        self._planned.update((id(m), (m, host[start : start + len(m)])) for m, start in zip(micros, starts))
        return micros

    def _rows(self, indices: torch.Tensor) -> list[int]:
        planned = self._planned.get(id(indices))
        return planned[1] if planned is not None else indices.tolist()

    def logprobs(
        self,
        forward: nn.Module,
        indices: torch.Tensor,
        with_entropy: bool,
        around: Callable[[UnitLayout], AbstractContextManager] | None = None,
    ):
        """Log-probs (and entropy) [n, T] of the rows ``indices`` (in that order) at the batch width T, by
        ``forward`` (a ``PolicyForward``, DDP-wrapped or not); consecutive rows with the same prompt share
        its computation. ``around(layout)``: a context the forward runs in (an MoE model's routing watch)."""
        units = self.planner.runs(self._rows(indices))
        layout = layout_units(
            self.batch.input_ids,
            self.planner.prompt_lens,
            self.planner.seq_lens,
            units,
            shared=any(len(u) > 1 for u in units),
        )
        with (
            self.precision.autocast(self.device),
            self.attention(getattr(forward, "module", forward).model),
            around(layout) if around is not None else nullcontext(),
        ):
            return forward(
                layout,
                len(indices),
                self.batch.input_ids.shape[1],
                self.cfg.rollout.temperature,
                with_entropy,
                self.cfg.model.logprob_chunk_size * len(indices),
            )

    @torch.no_grad()
    def frozen(self, model: nn.Module, around: Callable[[UnitLayout], AbstractContextManager] | None = None):
        """[N, T] log-probs of every row by ``model``, micro-batch by micro-batch as planned, without gradients,
        each forward within ``around(layout)`` (e.g. an MoE model's routing recorded)."""
        forward = PolicyForward(model)
        out = torch.zeros(self.batch.input_ids.shape, dtype=torch.float32, device=self.batch.input_ids.device)
        micros = self.plan(torch.arange(len(self.batch), device=out.device))
        with self.cast_scope(model):
            for micro in micros:
                out[micro] = self.logprobs(forward, micro, False, around)[0]
        for _ in range(self.lockstep.max(len(micros)) - len(micros) if self.lockstep else 0):
            self.logprobs(forward, micros[0][:1], False)  # joins the busiest rank's weight gathers
        return out


def refuse_negative_rewards(rollout: RolloutBatch) -> None:
    """MaxRL's advantage (normalizer 'mean') is defined for RL rewards >= 0 (partial credit included): refuse, in
    one line naming its reward terms, the first negative reward (the config refuses the settings known to give one;
    a user function, task class or environment shows its values only here)."""
    for example, grades in zip(rollout.examples, rollout.grades):
        for j, grade in enumerate(grades):
            if grade.ok and grade.reward < 0:
                terms = ", ".join(f"{n} {v:g}" for n, v in grade.components) or f"answer_reward {grade.answer_reward:g}"
                raise ValueError(
                    f"normalizer 'mean' (MaxRL) needs RL rewards >= 0: example {example.id} "
                    f"sample {j} got {grade.reward:g} (its reward terms: {terms}), and (r - mean) / mean "
                    "changes sign when a group's mean is negative; make that term non-negative, or use "
                    "another normalizer (e.g. --algo grpo)"
                )


class SyncCheck:
    """The per-step sync check over one batch: the engine's log-probs against the trainer's at the rows they
    cover, read over the global batch (so that every rank takes the same decision); its ``sync/...`` metrics
    in ``metrics``. ``enabled`` with ``rollout.sync_check``."""

    def __init__(self, monitor: SyncMonitor, lockstep: UpdateLockstep, batch: TrainBatch, enabled: bool):
        self.monitor, self.lockstep, self.batch, self.enabled = monitor, lockstep, batch, enabled
        self.metrics: dict[str, float] = {}

    def __call__(self, trainer: torch.Tensor, covered: torch.Tensor) -> None:
        mask = self.batch.response_mask * covered.unsqueeze(1).to(self.batch.response_mask.dtype)
        self.metrics.update(self.monitor.check(*self.lockstep.global_rows(self.batch.engine_logprobs, trainer, mask)))


@dataclass(frozen=True)
class TrainedModel:
    """The policy a learner trains: ``model`` (full, LoRA, or sharded by FSDP), ``optimizer`` over its trainable
    parameters, the ``precision`` of its training forwards on ``device``; ``pad_token_id`` pads collated rows."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    precision: TrainingPrecision
    device: torch.device
    pad_token_id: int


@dataclass(frozen=True)
class FrozenModels:
    """The models a learner reads and never trains: ``reference`` the reference policy (None: none), computed
    within ``reference_context`` (with LoRA the policy itself with its adapter off); ``teacher`` on-policy
    distillation's frozen teacher (None: none)."""

    reference: nn.Module | None = None
    reference_context: Callable[[], AbstractContextManager] = nullcontext
    teacher: nn.Module | None = None


@dataclass(frozen=True)
class LearnerState:
    """The run's state a learner advances in place (saved in the run's checkpoints): ``updates`` counts attempted
    and actual optimizer steps; ``minibatch_gen`` draws the mini-batches' shuffle (and Clip-Cov's tokens);
    ``sync_monitor`` the sync check's calibration; ``entropy_control`` the entropy bonus's adaptive coefficient."""

    updates: dict[str, int]
    minibatch_gen: torch.Generator | None = None
    sync_monitor: SyncMonitor | None = None
    entropy_control: AdaptiveEntropy = field(default_factory=AdaptiveEntropy)


class PolicyLearner:
    """Updates ``trained.model`` with its optimizer from rollout batches, reading the ``frozen`` models, advancing
    the run's ``state``. With several ``ranks`` the training forward is wrapped in DDP (which broadcasts rank 0's
    weights here), unless FSDP sharded the model."""

    def __init__(
        self,
        cfg: LearnerSettings,
        trained: TrainedModel,
        state: LearnerState,
        frozen: FrozenModels = FrozenModels(),
        ranks: Ranks = Ranks(),
    ):
        if cfg.algorithm.rollout_correction == AUTO:  # the loss would read it as none, also with bf16 rollouts
            raise ValueError(
                "algorithm.rollout_correction auto reached the learner unresolved (run.parts.resolve_auto)"
            )
        self.cfg, self.spec, self.ranks, self.state, self.frozen = cfg, cfg.algorithm, ranks, state, frozen
        self.model, self.optimizer, self.precision = trained.model, trained.optimizer, trained.precision
        self.device, self.pad_token_id = trained.device, trained.pad_token_id
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.sharded = is_sharded(self.model)
        self.train_forward = self._training_forward()
        self.lockstep = UpdateLockstep(ranks, self.train_forward, self.sharded)
        blocker = None
        if cfg.optim.shared_prompts:  # FSDP gathers weights at every backbone pass: a unit takes two, a lone row one
            blocker = (
                "FSDP ranks must run the same forwards" if self.sharded else forward_fidelity(self.model).share_blocker
            )
        self.share_prompts = cfg.optim.shared_prompts and blocker is None
        # said once, at start: why every sequence is computed on its own
        self.sharing_note = None if blocker is None else f"shared prompts off: {blocker}"

    def _training_forward(self) -> nn.Module:
        """The model's training forward: DDP-wrapped over several ranks, unless FSDP shards the model (whose
        gathered weights are then dropped after each optimizer step)."""
        if self.sharded:
            model = self.model
            self.optimizer.register_step_post_hook(lambda *_: drop_stale_weights(model))
        forward = PolicyForward(self.model)
        return wrap_ddp(forward, self.device) if self.ranks.parallel and not self.sharded else forward

    def forward(self, batch: TrainBatch) -> BatchForward:
        return BatchForward(self.cfg, batch, self.precision, self.device, self.share_prompts, self.lockstep.forwards)

    def routing(
        self, batch: TrainBatch, completions: list[Completion] | None = None, spec: AlgorithmSpec | None = None
    ) -> DenseRouting:
        """The routing part of an update of ``spec`` (None: the run's algorithm) over ``batch``, whose rows are
        ``completions`` (the engine's routing record is followed where every row has one; None: no record)."""
        routed = [c.routed_experts for c in completions] if completions is not None else [None]
        return batch_routing(
            self.model, spec or self.spec, self.cfg.model.router_aux_loss_coef, tuple(batch.input_ids.shape), routed
        )

    def routing_of(self, completions: list[Completion]) -> dict[str, float]:
        """An MoE policy's ``router/...`` metrics over the completion tokens of ``completions`` (one forward
        without gradients; every rank passes the same completions, so FSDP ranks run the same forwards);
        nothing for a dense policy."""
        if not is_moe(self.model) or not completions:
            return {}
        forward = self.forward(collate(completions, self.pad_token_id).to(self.device))
        return completion_routing(self.model, partial(forward.frozen, self.model))

    def learn(self, rollout: RolloutBatch) -> dict[str, Any]:
        """Advantages, sync check and the update schedule over one rollout batch; returns its metrics."""
        advantages, advantage_stats, part = self.global_advantages(rollout)
        mine = [c for group in part.of(rollout.completions) for c in group]
        batch = collate(mine, self.pad_token_id).to(self.device)
        valid = rollout.valid()
        if not bool(valid.all()):  # a failed sample trains no token and counts in no denominator
            batch.response_mask[~part.of(valid).flatten().to(self.device)] = 0
        token_counts = self.lockstep.sum_counts(batch.token_counts())
        forward, routing = self.forward(batch), self.routing(batch, mine)
        old = self.old_logprobs(forward, routing)
        # a stale batch was sampled by an older policy: its difference is the policy's drift, not the sync's
        sync = SyncCheck(
            self.state.sync_monitor, self.lockstep, batch, self.cfg.rollout.sync_check and not rollout.staleness
        )
        if sync.enabled and old is not None:
            sync(old, torch.ones(len(batch), dtype=torch.bool, device=old.device))
        ref = self.reference_logprobs(forward)
        data = UpdateData(
            advantages=part.of(advantages).flatten().to(self.device),
            response_mask=batch.response_mask,
            old_logprobs=old,
            ref_logprobs=ref,
            engine_logprobs=batch.engine_logprobs,
            teacher_logprobs=self.teacher_logprobs(forward),
        )
        # with one optimizer step the sync check reads the update's own forward, before its optimizer step
        result = self.update(
            data, forward, routing, part=part, first_step_check=sync if sync.enabled and old is None else None
        )
        self.state.updates["attempted"] += result.attempted
        self.state.updates["actual"] += result.actual
        return {
            **advantage_stats,
            **result.metrics(),
            **sync.metrics,
            **token_counts,
            **routing.metrics(self.lockstep.total),
        }

    def global_advantages(self, rollout: RolloutBatch) -> tuple[torch.Tensor, dict[str, float], RankPart]:
        """The advantages [B, G] of all groups, computed before the rank split (a batch-level statistic, Lite PPO's
        std or GDPO's whitening, is the global batch's on every rank), their metrics, and this rank's part."""
        rewards, advantages, stats = self.advantages(rollout)
        return advantages, stats, self.lockstep.part(len(rollout.completions), rewards.shape[1])

    def advantages(self, rollout: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
        """(rewards, advantages) [B, G] of every group of ``rollout``, and their metrics."""
        if self.spec.normalizer == "mean":
            refuse_negative_rewards(rollout)
        rewards, valid, terms, weights = rollout.rewards(), rollout.valid(), None, None
        if self.spec.multi_objective_aggregation != "sum_then_normalize":
            named = self.cfg.reward_weights()  # GDPO: each term apart (the config refused unknown weights)
            if named is None:
                raise ValueError(
                    f"algorithm {self.spec.name} needs the reward terms' weights; the task does not say them"
                )
            terms, weights = rollout.reward_terms(list(named)), torch.tensor(list(named.values()))
        valid = None if bool(valid.all()) else valid  # a failed sample takes no part (its advantage is 0)
        advantages = batch_advantages(self.spec, rewards, terms, weights, valid)
        return rewards, advantages, advantage_metrics(rewards, advantages, valid)

    def old_logprobs(self, forward: BatchForward, routing: DenseRouting) -> torch.Tensor | None:
        """[N, T] log-probs of the policy before the update, frozen; None with one optimizer step: the policy is
        still the sampling policy, so the update's own forward detached is exactly them, without a second pass."""
        if self.spec.is_single_update:
            return None
        with routing.old_forward():
            return forward.frozen(self.model, routing.old_watch)

    def reference_logprobs(self, forward: BatchForward) -> torch.Tensor | None:
        """[N, T] log-probs of the reference policy (None without one)."""
        if self.frozen.reference is None:
            return None
        with self.frozen.reference_context():
            return forward.frozen(self.frozen.reference)

    def teacher_logprobs(self, forward: BatchForward) -> torch.Tensor | None:
        """[N, T] the teacher's log-probs of the sampled tokens (None without a teacher): one frozen forward per
        rollout batch, micro-batch by micro-batch, chunked over the output layer like the reference's."""
        return None if self.frozen.teacher is None else forward.frozen(self.frozen.teacher)

    def update(
        self,
        data: UpdateData,
        forward: BatchForward,
        routing: DenseRouting | None = None,
        *,
        spec: AlgorithmSpec | None = None,
        part: RankPart | None = None,
        first_step_check: StepCheck | None = None,
    ) -> UpdateResult:
        """The optimizer steps of ``spec``'s schedule (None: the run's algorithm) over the batch of ``forward``
        (``grpolab.learning.update.run_update``: per step its forwards, loss, backward, clipped optimizer step),
        ``data`` its rows' advantages and log-probs, the model in training mode meanwhile. ``routing``: the
        batch's routing part (None: ``routing(batch, spec=spec)``, no engine record); ``part``: this rank's part
        of a data-parallel batch (None: the whole batch is this process's); ``first_step_check``: as
        ``run_update``'s. The run's counters are the caller's to update."""
        spec = spec or self.spec
        routing = routing if routing is not None else self.routing(forward.batch, spec=spec)

        def policy(indices: torch.Tensor):
            return forward.logprobs(self.train_forward, indices, True, routing.counted)

        def filler(indices: torch.Tensor):  # a row that only joins the busiest rank's collectives
            return forward.logprobs(self.train_forward, indices, True, routing.uncounted)

        trainee = Trainee(
            routing.with_aux_loss(policy),
            self.optimizer,
            self.params,
            extra_loss=routing.extra_loss,
            cast_scope=partial(forward.cast_scope, self.model),
        )
        share = self.lockstep.share(part, filler) if part is not None else None
        hooks = UpdateHooks(share, self.state.entropy_control, first_step_check)
        self.model.train()
        try:
            with routing.training():
                return run_update(spec, data, trainee, self.schedule(forward), hooks)
        finally:
            self.model.eval()

    def schedule(self, forward: BatchForward) -> UpdateSchedule:
        """The run's update schedule over the batch of ``forward`` (its planned micro-batches)."""
        optim = self.cfg.optim
        return UpdateSchedule(
            micro_batch_size=optim.micro_batch_size,
            max_new_tokens=self.cfg.rollout.max_new_tokens,
            max_grad_norm=optim.max_grad_norm,
            full_metrics=optim.full_metrics,
            plan=forward.plan,
            generator=self.state.minibatch_gen,
        )
