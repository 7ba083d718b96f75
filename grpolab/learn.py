"""Learning from a rollout batch (steps 3-4 of the loop): group advantages, the frozen log-probs the
objective needs (old policy, reference), the per-step sync check, and the update schedule."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from grpolab.advantages import advantage_metrics, group_advantages
from grpolab.batching import TrainBatch, collate
from grpolab.collect import RolloutBatch
from grpolab.config import RunConfig
from grpolab.logprobs import token_logprobs
from grpolab.precision import TrainingPrecision
from grpolab.rollout.sync_check import SyncMonitor
from grpolab.update import UpdateData, run_update


class PolicyLearner:
    """Updates ``model`` with ``optimizer`` from rollout batches; ``updates`` counts attempted and actual
    optimizer steps (the run state's counters, updated in place)."""

    def __init__(self, cfg: RunConfig, model, reference, optimizer: torch.optim.Optimizer,
                 precision: TrainingPrecision, device: torch.device, pad_token_id: int,
                 minibatch_gen: torch.Generator, sync_monitor: SyncMonitor, updates: dict[str, int]):
        self.cfg, self.spec = cfg, cfg.algorithm
        self.model, self.reference, self.optimizer = model, reference, optimizer
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.precision, self.device, self.pad_token_id = precision, device, pad_token_id
        self.minibatch_gen, self.sync_monitor, self.updates = minibatch_gen, sync_monitor, updates

    def logprobs_of(self, model, batch: TrainBatch, indices: torch.Tensor, with_entropy: bool):
        """Log-probs (and entropy) [n, T] of the rows ``indices``, padded back to the batch width T."""
        sub = batch.select(indices)
        with self.precision.autocast(self.device):
            stats = token_logprobs(model, sub.input_ids, sub.attention_mask, temperature=self.cfg.rollout.temperature,
                                   chunk_size=self.cfg.model.logprob_chunk_size, with_entropy=with_entropy)
        pad = (0, batch.input_ids.shape[1] - sub.input_ids.shape[1])
        return F.pad(stats.logprobs, pad), None if stats.entropy is None else F.pad(stats.entropy, pad)

    @torch.no_grad()
    def frozen_logprobs(self, model, batch: TrainBatch) -> torch.Tensor:
        """[N, T] log-probs of every row, micro-batch by micro-batch, without gradients."""
        chunks = torch.arange(len(batch)).split(self.cfg.optim.micro_batch_size)
        return torch.cat([self.logprobs_of(model, batch, idx, False)[0] for idx in chunks])

    def learn(self, rollout: RolloutBatch) -> dict[str, Any]:
        """Advantages, sync check and the update schedule over one rollout batch; returns its metrics."""
        rewards = rollout.rewards()
        advantages = group_advantages(rewards, self.spec.baseline, self.spec.normalizer, self.spec.adv_eps)
        batch = collate(rollout.flat(), self.pad_token_id).to(self.device)
        # With one optimizer step the policy is still the sampling policy: old = current, detached
        # (exactly the log-probs frozen before the update, without a second forward pass), unless
        # the sync check needs them anyway.
        check = self.cfg.rollout.checks_sync()
        old = None if self.spec.is_single_update and not check else self.frozen_logprobs(self.model, batch)
        sync = self.sync_monitor.check(batch.engine_logprobs, old, batch.response_mask) if check else {}
        ref = self.frozen_logprobs(self.reference, batch) if self.reference is not None else None
        data = UpdateData(advantages=advantages.flatten().to(self.device), response_mask=batch.response_mask,
                          old_logprobs=old, ref_logprobs=ref, engine_logprobs=batch.engine_logprobs)
        self.model.train()
        try:
            result = run_update(self.spec, data, lambda idx: self.logprobs_of(self.model, batch, idx, True),
                                self.optimizer, self.params, micro_batch_size=self.cfg.optim.micro_batch_size,
                                max_new_tokens=self.cfg.rollout.max_new_tokens,
                                max_grad_norm=self.cfg.optim.max_grad_norm, generator=self.minibatch_gen,
                                full_metrics=self.cfg.optim.full_metrics)
        finally:
            self.model.eval()
        self.updates["attempted"] += result.attempted
        self.updates["actual"] += result.actual
        return {**advantage_metrics(rewards, advantages), **result.metrics(), **sync, **batch.token_counts()}
