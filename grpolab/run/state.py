"""A run's training state besides the weights: optimizer, every RNG, data position, counters.

Saved as ``trainer_state.pt`` inside each checkpoint folder (written with it, atomically), so that
``grpolab train --resume RUN_DIR`` continues from the newest complete checkpoint and, on CPU, gives
exactly the metrics of an uninterrupted run. Engines hold no sampling state of their own: every
generation is seeded from (run seed, step, round).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from grpolab.common.atomic import RecordingWriter
from grpolab.objectives.token_selection import AdaptiveEntropy
from grpolab.parallel.fsdp import full_optimizer_state, is_sharded, load_optimizer_state
from grpolab.parallel.ranks import Ranks
from grpolab.rollout.pipeline import RolloutSource
from grpolab.rollout.reward_models import RewardModels
from grpolab.rollout.sync_check import SyncMonitor
from grpolab.tasks.stream import PromptStream

STATE_FILE = "trainer_state.pt"


def rng_state() -> dict[str, Any]:
    """The global RNGs: python, numpy, torch (CPU and every CUDA device)."""
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class RunState:
    """The mutable parts of a run the weights do not hold, as one ``state_dict``: the step reached,
    update counters, the entropy bonus's adaptive coefficient, the optimizer, the prompt order, the
    mini-batch shuffle generator, the global RNGs (of every data-parallel rank), the sync check's
    calibration (noise floor, checks seen), the reward models' running moments and the rollout batches
    generated ahead (async rollouts). Under data parallelism every other part is the same on every rank
    (the ranks step alike)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        prompts: PromptStream,
        minibatch_gen: torch.Generator,
        sync_monitor: SyncMonitor,
        ranks: Ranks = Ranks(),
        model: torch.nn.Module | None = None,
        reward_models: RewardModels | None = None,
        rollouts: RolloutSource | None = None,
    ):
        self.step = 0
        self.updates = {"attempted": 0, "actual": 0}
        self.entropy_control = AdaptiveEntropy()  # the entropy bonus's adaptive coefficient (the learner updates it)
        self.optimizer, self.prompts, self.minibatch_gen, self.sync_monitor = (
            optimizer,
            prompts,
            minibatch_gen,
            sync_monitor,
        )
        self.ranks, self.model = ranks, model  # the model whose parameters the optimizer holds
        self.reward_models = reward_models
        self.rollouts = rollouts  # the batches generated ahead (async rollouts), and where they stopped

    def state_dict(self) -> dict[str, Any]:
        """Called on every rank (it gathers their RNGs). Batches generated ahead are taken first: that waits
        until none is in flight, so the prompt order and reward models' moments saved are theirs."""
        rollouts = self.rollouts.state_dict() if self.rollouts is not None else {}
        streams = rollouts.pop("streams", {})  # async: as after the batches saved, not the one in flight
        rngs = self.ranks.gather(rng_state())
        sharded = self.model is not None and is_sharded(self.model)
        optimizer = full_optimizer_state(self.model, self.optimizer) if sharded else self.optimizer.state_dict()
        return {
            "step": self.step,
            "updates": dict(self.updates),
            "entropy_control": self.entropy_control.state_dict(),
            "optimizer": optimizer,
            "prompts": streams.get("prompts") or self.prompts.state_dict(),
            "minibatch_gen": self.minibatch_gen.get_state(),
            "rng": rngs[0],
            "rng_by_rank": rngs,
            "sync_monitor": self.sync_monitor.state_dict(),
            "reward_models": streams.get("reward_models")
            or (self.reward_models.state_dict() if self.reward_models is not None else {}),
            "rollouts": rollouts,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Each rank takes its own RNGs; a run resumed with another number of ranks takes rank 0's."""
        self.step = state["step"]
        self.updates.update(state["updates"])  # in place: the learner counts into this dict
        self.entropy_control.load_state_dict(state.get("entropy_control", {}))  # in place: the learner holds it
        load_optimizer_state(self.model, self.optimizer, state["optimizer"])
        self.prompts.load_state_dict(state["prompts"])
        self.minibatch_gen.set_state(state["minibatch_gen"])
        by_rank = state.get("rng_by_rank") or [state["rng"]]
        set_rng_state(by_rank[self.ranks.rank] if len(by_rank) == self.ranks.world else state["rng"])
        self.sync_monitor.load_state_dict(state.get("sync_monitor") or {"noise_floor": state["sync_noise_floor"]})
        if self.reward_models is not None:
            self.reward_models.load_state_dict(state.get("reward_models", {}))
        if self.rollouts is not None:
            self.rollouts.load_state_dict(state.get("rollouts", {}))

    @staticmethod
    def save(state: dict[str, Any], folder: Path) -> None:
        with open(folder / STATE_FILE, "wb") as f:
            out = RecordingWriter(f)
            try:
                torch.save(state, out)
            except RuntimeError:
                if out.error is not None:  # the disk is full (torch words it "unexpected pos")
                    raise out.error from None
                raise

    def load(self, folder: Path) -> None:
        # our own file, written by save(): it holds python and numpy RNG states, hence weights_only=False
        self.load_state_dict(torch.load(folder / STATE_FILE, map_location="cpu", weights_only=False))
