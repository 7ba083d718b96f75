"""The training examples a run draws from: a fresh seeded shuffle each epoch, resumable."""

from __future__ import annotations

import random
from typing import Any

from grpolab.tasks.base import Example


class PromptStream:
    """Training examples in a fresh seeded shuffle each epoch, ``take(k)`` at a time."""

    def __init__(self, examples: list[Example], seed: int):
        if not examples:
            raise ValueError("no training examples to draw prompts from")
        self.examples, self.rng, self.queue = examples, random.Random(seed), []

    def take(self, k: int) -> list[Example]:
        while len(self.queue) < k:
            order = list(self.examples)
            self.rng.shuffle(order)
            self.queue += order
        taken, self.queue = self.queue[:k], self.queue[k:]
        return taken

    def state_dict(self) -> dict[str, Any]:
        return {"rng": self.rng.getstate(), "queue": [e.id for e in self.queue]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        by_id = {e.id: e for e in self.examples}
        self.rng.setstate(state["rng"])
        self.queue = [by_id[i] for i in state["queue"]]
