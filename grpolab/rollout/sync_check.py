"""The weight-sync check shared by every engine: engine vs trainer log-probs of the sampled tokens.

Right after a sync both sides hold the same weights, so their log-probs of the engine's sampled
tokens agree up to numerics; a missed, partial or corrupted sync shows up as a larger difference.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from grpolab.rollout.base import Completion

logger = logging.getLogger(__name__)


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
        raise ValueError(
            f"shape mismatch: engine {tuple(engine.shape)}, trainer {tuple(trainer.shape)}, "
            f"mask {tuple(response_mask.shape)}"
        )
    mask = response_mask.detach().bool()
    diff = (engine.detach().float().to(trainer.device) - trainer.detach().float())[mask.to(trainer.device)].abs()
    if diff.numel() == 0:
        return SyncCheck(0.0, 0.0, 0)
    return SyncCheck(float(diff.mean()), float(diff.max()), int(diff.numel()))


def verify_weight_sync(
    engine: Tensor | Sequence[Completion],
    trainer: Tensor,
    response_mask: Tensor,
    *,
    max_abs_diff: float | None = None,
    mean_abs_diff: float | None = None,
) -> SyncCheck:
    """``logprob_diff`` plus a check: raises ``WeightSyncError`` when a given threshold is exceeded or
    a difference is not finite (the test is ``not value <= limit``, which NaN fails).

    Call it on the first rollout after a ``sync_weights`` (before the update), with the trainer's
    log-probs at the sampling temperature. Float32 engine and trainer agree to ~1e-5; bf16 much less.
    """
    if max_abs_diff is None and mean_abs_diff is None:
        raise ValueError("give max_abs_diff and/or mean_abs_diff")
    check = logprob_diff(engine, trainer, response_mask)
    limits = (("max |diff|", check.max_abs_diff, max_abs_diff), ("mean |diff|", check.mean_abs_diff, mean_abs_diff))
    over = [
        f"{name} {value:.3g} > {limit:.3g}" for name, value, limit in limits if limit is not None and not value <= limit
    ]  # NaN fails too
    if over:
        raise WeightSyncError(
            f"engine and trainer log-probs disagree over {check.num_tokens} response tokens ({'; '.join(over)}): "
            "the rollout engine is not sampling from the trainer's current weights "
            "(missed or failed sync_weights, corrupted weights, or a dtype / temperature mismatch)"
        )
    return check


# The calibrated limit never goes below noise_multiple x these: a floor measured on few tokens can be
# far below the heavy-tailed noise of later steps (measured in bf16 with the same model on both sides:
# 2e-5 on one step of 256 tokens, 5e-4 on the next).
#
# bf16 with float32 masters, the hf engine on its own copy of the linear weights in bf16 under the trainer's
# autocast (grpolab.rollout.hf.engine_weights; the same log-probs as generating on the training model under
# autocast), measured 2026-12-06 at fbc0a64 (AMD EPYC with avx512_bf16, under load; one run each):
#   in sync, mean |diff| per step: the tests' tiny model 5e-5 to 3.4e-4 (12 steps, benchmarks/sync_margins.py);
#   SmolLM2-135M-Instruct 3.4e-2 to 3.6e-2 (6 steps): the absolute bf16 limit 0.1 binds there (margin <= 0.36).
#   A sync broken from step 4 on (tiny model, lr 1e-5): stopped at step 6.
#   A missed sync simulated by moving every master weight by lr in a fixed random direction per missed step
#   (32 samples of <= 32 tokens): tiny model, lr 1e-5: 5.7e-4 in sync, 4.5e-3 after 1 missed, 5.9e-3 after
#   10 (caught from the first: 3 x max(floor, 1e-3)); lr 1e-4: 6.9e-3 after 1, 1.7e-2 after 10. SmolLM2,
#   where bf16 decoding's own noise is 3.3e-2: lr 1e-5: 3.5e-2 after 1, 3.6e-2 after 10, 3.9e-2 after 20 (never
#   caught); lr 1e-4: 4.9e-2 after 5, 7.0e-2 after 10, 0.116 after 20 (caught past the absolute 0.1). A tighter
#   limit would stop in-sync SmolLM2 runs (their steps reach 3.6e-2; 3 x floor = 0.105): in bf16 the check
#   catches corrupt or long-broken syncs on a real model, not a few missed ones.
# An engine on an all-bf16 copy (no autocast; at 9c9a4f4) sits 10x higher on the tiny model (floor 3.4e-3, a sync broken
# from step 4 stopped at step 11) and at 4.1e-2 to 4.6e-2 on SmolLM2: it is not the engine's default.
MIN_NOISE_FLOOR = {"float32": 1e-5, "bfloat16": 1e-3}


class SyncMonitor:
    """The per-step sync check of a run: absolute limits plus a limit calibrated on the run itself.

    The first ``calibration_steps`` checked rollouts come from an engine and a trainer holding the same
    weights up to the sync, so their largest mean |diff| is the numerical noise floor of that pair (kernels,
    dtype, KV-cached decoding): one step alone can sit far below the noise of the next. Every later step must
    stay within ``noise_multiple`` x that floor (and within the absolute limits); a step inside the window is
    already held to the multiple of the floor so far. In bf16 an engine whose sync broke drifts past it within
    a few stale steps (measured at lr 1e-5: 2.3x the floor after 5, 4x after 10), where the absolute limit
    never fires; one missed sync alone stays within the noise (most lr 1e-5 updates do not change a bf16 weight).

    Each check's margin is the observed difference over its stop limit, the largest over the limits in force
    (mean and max; 1 = the run stops); past ``warn_margin`` one line goes to ``warn``, once until the margin
    falls back below it.
    """

    def __init__(
        self,
        max_abs_diff: float | None,
        mean_abs_diff: float | None,
        noise_multiple: float | None,
        min_floor: float = MIN_NOISE_FLOOR["float32"],
        calibration_steps: int = 1,
        warn_margin: float | None = None,
        warn: Callable[[str], None] = logger.warning,
    ):
        self.max_abs_diff, self.mean_abs_diff = max_abs_diff, mean_abs_diff
        self.noise_multiple, self.min_floor = noise_multiple, min_floor
        self.calibration_steps, self.warn_margin, self.warn = calibration_steps, warn_margin, warn
        self.noise_floor: float | None = None
        self.calibrated = 0  # checks the floor has seen
        self._warned = False

    def calibrated_limit(self) -> float | None:
        """The mean |diff| limit from the noise floor (None before calibration or when off)."""
        if self.noise_floor is None or self.noise_multiple is None:
            return None
        return self.noise_multiple * max(self.noise_floor, self.min_floor)

    def check(self, engine: Tensor, trainer: Tensor, response_mask: Tensor) -> dict[str, float]:
        """Check one step (raises ``WeightSyncError``); returns its ``sync/...`` metrics."""
        limits = [x for x in (self.mean_abs_diff, self.calibrated_limit()) if x is not None]
        mean_limit = min(limits) if limits else None
        found = verify_weight_sync(
            engine,
            trainer,
            response_mask,
            max_abs_diff=self.max_abs_diff,
            mean_abs_diff=mean_limit if mean_limit is not None else float("inf"),
        )
        out = {"sync/logprob_diff_mean": found.mean_abs_diff, "sync/logprob_diff_max": found.max_abs_diff}
        margins = [
            value / limit
            for value, limit in ((found.mean_abs_diff, mean_limit), (found.max_abs_diff, self.max_abs_diff))
            if limit
        ]
        if margins:
            out["sync/margin"] = margin = max(margins)
            if self.warn_margin is not None and margin > self.warn_margin and not self._warned:
                self.warn(
                    f"sync check: engine and trainer log-probs are at {margin:.2f} of the stop limit (mean "
                    f"|diff| {found.mean_abs_diff:.3g}, limit {mean_limit or float('inf'):.3g}; max |diff| "
                    f"{found.max_abs_diff:.3g}); warned past {self.warn_margin:g}, the run stops at 1"
                )
            self._warned = self.warn_margin is not None and margin > self.warn_margin
        if mean_limit is not None:
            out["sync/mean_limit"] = mean_limit
        if self.calibrated < self.calibration_steps and found.num_tokens:
            self.noise_floor = max(self.noise_floor or 0.0, found.mean_abs_diff)
            self.calibrated += 1
        if self.noise_floor is not None:
            out["sync/noise_floor_mean"] = self.noise_floor
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"noise_floor": self.noise_floor, "calibrated": self.calibrated}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A state from before the window (a noise floor alone) was calibrated on one check."""
        self.noise_floor = state["noise_floor"]
        self.calibrated = state.get("calibrated", 0 if self.noise_floor is None else 1)
