"""Learning from a rollout batch (steps 3-4 of the loop): group advantages, the frozen log-probs the
objective needs (old policy, reference), the per-step sync check, and the update schedule."""

from __future__ import annotations

from typing import Any

import torch

from grpolab.advantages import advantage_metrics, group_advantages
from grpolab.batching import TrainBatch, collate
from grpolab.collect import RolloutBatch
from grpolab.config import RunConfig
from grpolab.packing import MicroBatchPlanner, prompt_keys
from grpolab.precision import TrainingPrecision
from grpolab.rollout.sync_check import SyncMonitor
from grpolab.shared_prefix import layout_units, sharing_blocker, unit_logprobs
from grpolab.update import UpdateData, run_update


class BatchForward:
    """Training forwards over the rows of one collated batch: micro-batches as planned, rows that share a
    prompt computed as one unit (``grpolab.shared_prefix``) when ``share``."""

    def __init__(self, cfg: RunConfig, batch: TrainBatch, precision: TrainingPrecision, device: torch.device,
                 share: bool):
        self.cfg, self.batch, self.precision, self.device = cfg, batch, precision, device
        prompt_lens, seq_lens = batch.prompt_lens.tolist(), batch.attention_mask.sum(1).tolist()
        self.planner = MicroBatchPlanner(
            keys=prompt_keys(batch.input_ids, batch.prompt_lens) if share else list(range(len(batch))),
            prompt_lens=prompt_lens, seq_lens=seq_lens, share=share,
            max_sequences=cfg.optim.micro_batch_size, max_tokens=cfg.optim.micro_batch_tokens)

    def logprobs(self, model, indices: torch.Tensor, with_entropy: bool):
        """Log-probs (and entropy) [n, T] of the rows ``indices`` (in that order) at the batch width T;
        consecutive rows with the same prompt share its computation."""
        units = self.planner.runs(indices.tolist())
        layout = layout_units(self.batch.input_ids, self.planner.prompt_lens, self.planner.seq_lens, units,
                              shared=any(len(u) > 1 for u in units))
        with self.precision.autocast(self.device):
            stats = unit_logprobs(model, layout, len(indices), self.batch.input_ids.shape[1],
                                  temperature=self.cfg.rollout.temperature, with_entropy=with_entropy,
                                  chunk_tokens=self.cfg.model.logprob_chunk_size * len(indices))
        return stats.logprobs, stats.entropy

    @torch.no_grad()
    def frozen(self, model) -> torch.Tensor:
        """[N, T] log-probs of every row, micro-batch by micro-batch as planned, without gradients."""
        out = torch.zeros(self.batch.input_ids.shape, dtype=torch.float32, device=self.batch.input_ids.device)
        for micro in self.planner.plan(torch.arange(len(self.batch), device=out.device)):
            out[micro] = self.logprobs(model, micro, False)[0]
        return out


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
        blocker = sharing_blocker(model) if cfg.optim.shared_prompts else None
        self.share_prompts = cfg.optim.shared_prompts and blocker is None
        # said once, at start: why every sequence is computed on its own
        self.sharing_note = None if blocker is None else f"shared prompts off: {blocker}"

    def forward(self, batch: TrainBatch) -> BatchForward:
        return BatchForward(self.cfg, batch, self.precision, self.device, self.share_prompts)

    def learn(self, rollout: RolloutBatch) -> dict[str, Any]:
        """Advantages, sync check and the update schedule over one rollout batch; returns its metrics."""
        rewards = rollout.rewards()
        advantages = group_advantages(rewards, self.spec.baseline, self.spec.normalizer, self.spec.adv_eps)
        batch = collate(rollout.flat(), self.pad_token_id).to(self.device)
        # With one optimizer step the policy is still the sampling policy: old = current, detached
        # (exactly the log-probs frozen before the update, without a second forward pass), unless
        # the sync check needs them anyway.
        check = self.cfg.rollout.checks_sync()
        forward = self.forward(batch)
        old = None if self.spec.is_single_update and not check else forward.frozen(self.model)
        sync = self.sync_monitor.check(batch.engine_logprobs, old, batch.response_mask) if check else {}
        ref = forward.frozen(self.reference) if self.reference is not None else None
        data = UpdateData(advantages=advantages.flatten().to(self.device), response_mask=batch.response_mask,
                          old_logprobs=old, ref_logprobs=ref, engine_logprobs=batch.engine_logprobs)
        self.model.train()
        try:
            result = run_update(self.spec, data, lambda idx: forward.logprobs(self.model, idx, True),
                                self.optimizer, self.params, plan=forward.planner.plan,
                                micro_batch_size=self.cfg.optim.micro_batch_size,
                                max_new_tokens=self.cfg.rollout.max_new_tokens,
                                max_grad_norm=self.cfg.optim.max_grad_norm, generator=self.minibatch_gen,
                                full_metrics=self.cfg.optim.full_metrics)
        finally:
            self.model.eval()
        self.updates["attempted"] += result.attempted
        self.updates["actual"] += result.actual
        return {**advantage_metrics(rewards, advantages), **result.metrics(), **sync, **batch.token_counts()}
