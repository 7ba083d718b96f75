"""The weight-sync check shared by every engine: engine vs trainer log-probs of the sampled tokens.

Right after a sync both sides hold the same weights, so their log-probs of the engine's sampled
tokens agree up to numerics; a missed, partial or corrupted sync shows up as a larger difference.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from grpolab.rollout.base import Completion


class WeightSyncError(RuntimeError):
    """The engine's log-probs disagree with the trainer's: it is not sampling from its weights."""


@dataclass(frozen=True)
class SyncCheck:
    """|engine log-prob - trainer log-prob| over the response tokens."""

    mean_abs_diff: float
    max_abs_diff: float
    num_tokens: int


def engine_logprob_matrix(completions: Sequence[Completion], width: int | None = None) -> Tensor:
    """FloatTensor[N, T] of the engine's log-probs at their ``collate`` columns (0 elsewhere).

    Row i holds ``completions[i].logprobs`` at columns ``len(prompt) .. len(prompt) + k - 1``.
    """
    need = max((len(c.prompt_ids) + len(c.completion_ids) for c in completions), default=0)
    out = torch.zeros(len(completions), max(width or 0, need), dtype=torch.float32)
    for row, c in enumerate(completions):
        p = len(c.prompt_ids)
        out[row, p : p + len(c.logprobs)] = torch.tensor(c.logprobs, dtype=torch.float32)
    return out


def logprob_diff(engine: Tensor | Sequence[Completion], trainer: Tensor, response_mask: Tensor) -> SyncCheck:
    """Mean and max |engine - trainer| over the tokens where ``response_mask`` is set.

    engine: FloatTensor[N, T] (e.g. ``TrainBatch.engine_logprobs``) or the completions in row order.
    trainer: FloatTensor[N, T], ``token_logprobs(...).logprobs`` of the same rows.
    response_mask: [N, T], nonzero exactly on completion tokens.
    """
    if not isinstance(engine, Tensor):
        engine = engine_logprob_matrix(engine, trainer.shape[1])
    if engine.shape != trainer.shape or trainer.shape != response_mask.shape:
        raise ValueError(f"shape mismatch: engine {tuple(engine.shape)}, trainer {tuple(trainer.shape)}, "
                         f"mask {tuple(response_mask.shape)}")
    mask = response_mask.detach().bool()
    diff = (engine.detach().float().to(trainer.device) - trainer.detach().float())[mask.to(trainer.device)].abs()
    if diff.numel() == 0:
        return SyncCheck(0.0, 0.0, 0)
    return SyncCheck(float(diff.mean()), float(diff.max()), int(diff.numel()))


def verify_weight_sync(engine: Tensor | Sequence[Completion], trainer: Tensor, response_mask: Tensor, *,
                       max_abs_diff: float | None = None, mean_abs_diff: float | None = None) -> SyncCheck:
    """``logprob_diff`` plus a check: raises ``WeightSyncError`` when a given threshold is exceeded or
    a difference is not finite (the test is ``not value <= limit``, which NaN fails).

    Call it on the first rollout after a ``sync_weights`` (before the update), with the trainer's
    log-probs at the sampling temperature. Float32 engine and trainer agree to ~1e-5; bf16 much less.
    """
    if max_abs_diff is None and mean_abs_diff is None:
        raise ValueError("give max_abs_diff and/or mean_abs_diff")
    check = logprob_diff(engine, trainer, response_mask)
    limits = (("max |diff|", check.max_abs_diff, max_abs_diff), ("mean |diff|", check.mean_abs_diff, mean_abs_diff))
    over = [f"{name} {value:.3g} > {limit:.3g}" for name, value, limit in limits
            if limit is not None and not value <= limit]  # NaN fails too
    if over:
        raise WeightSyncError(
            f"engine and trainer log-probs disagree over {check.num_tokens} response tokens ({'; '.join(over)}): "
            "the rollout engine is not sampling from the trainer's current weights "
            "(missed or failed sync_weights, corrupted weights, or a dtype / temperature mismatch)")
    return check


# The calibrated limit never goes below noise_multiple x these: a floor measured on few tokens can be
# far below the heavy-tailed noise of later steps (measured in bf16 with the same model on both sides:
# 2e-5 on one step of 256 tokens, 5e-4 on the next).
MIN_NOISE_FLOOR = {"float32": 1e-5, "bfloat16": 1e-3}


class SyncMonitor:
    """The per-step sync check of a run: absolute limits plus a limit calibrated on the run itself.

    The first checked rollout comes from an engine and a trainer holding identical weights, so its
    mean |diff| is the numerical noise floor of that pair (kernels, dtype, KV-cached decoding). Every
    later step must stay within ``noise_multiple`` x that floor (and within the absolute limits). In
    bf16 an engine whose sync broke drifts past it within a few stale steps (measured at lr 1e-5: 2.3x
    the floor after 5, 4x after 10), where the absolute limit never fires; one missed sync alone
    stays within the noise (most lr 1e-5 updates do not change a bf16 weight).
    """

    def __init__(self, max_abs_diff: float | None, mean_abs_diff: float | None, noise_multiple: float | None,
                 min_floor: float = MIN_NOISE_FLOOR["float32"]):
        self.max_abs_diff, self.mean_abs_diff = max_abs_diff, mean_abs_diff
        self.noise_multiple, self.min_floor = noise_multiple, min_floor
        self.noise_floor: float | None = None

    def calibrated_limit(self) -> float | None:
        """The mean |diff| limit from the noise floor (None before calibration or when off)."""
        if self.noise_floor is None or self.noise_multiple is None:
            return None
        return self.noise_multiple * max(self.noise_floor, self.min_floor)

    def check(self, engine: Tensor, trainer: Tensor, response_mask: Tensor) -> dict[str, float]:
        """Check one step (raises ``WeightSyncError``); returns its ``sync/...`` metrics."""
        limits = [x for x in (self.mean_abs_diff, self.calibrated_limit()) if x is not None]
        mean_limit = min(limits) if limits else None
        found = verify_weight_sync(engine, trainer, response_mask, max_abs_diff=self.max_abs_diff,
                                   mean_abs_diff=mean_limit if mean_limit is not None else float("inf"))
        if self.noise_floor is None and found.num_tokens:
            self.noise_floor = found.mean_abs_diff
        out = {"sync/logprob_diff_mean": found.mean_abs_diff, "sync/logprob_diff_max": found.max_abs_diff}
        if self.noise_floor is not None:
            out["sync/noise_floor_mean"] = self.noise_floor
        return out
