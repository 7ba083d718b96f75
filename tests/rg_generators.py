"""A reasoning-gym generator of the tests' own, registered with reasoning-gym's ``register_dataset`` (as a user's
module named in ``task.imports``): items "Repeat N", whose scorer hangs on the answer ``hang`` and raises on
``raise`` (a scorer that must never stall or end a run), whose items fail past ``high`` 999,999, and whose questions name the
process with ``per_process``."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from random import Random
from typing import Any

from reasoning_gym import register_dataset
from reasoning_gym.dataset import ProceduralDataset


@dataclass
class RepeatConfig:
    high: int = 99
    per_process: bool = False  # questions that differ from process to process (as hash-order-dependent ones may)
    seed: int | None = None
    size: int = 500

    def validate(self) -> None:
        assert self.high >= 1, "high must be at least 1"


class RepeatDataset(ProceduralDataset):
    def __init__(self, config: RepeatConfig):
        super().__init__(config=config, seed=config.seed, size=config.size)

    def __getitem__(self, idx: int) -> dict[str, Any]:
        if self.config.high >= 10**6:  # a setting its checks let through, refused only when an item is made
            raise OverflowError("too high to repeat")
        n = Random(self.seed + idx).randint(0, self.config.high)
        where = f" (process {os.getpid()})" if self.config.per_process else ""
        return {"question": f"Repeat {n}{where}.", "answer": str(n), "metadata": {"source_dataset": "grpolab_repeat"}}

    def score_answer(self, answer: str | None, entry: dict[str, Any]) -> float:
        if answer == "hang":
            time.sleep(600)
        if answer == "raise":
            raise RuntimeError("this scorer raises")
        return super().score_answer(answer, entry)


register_dataset("grpolab_repeat", RepeatDataset, RepeatConfig)
