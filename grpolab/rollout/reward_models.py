"""A task's reward models in the loop: their raw scores beside the task's grades, and their weighted,
normalized terms in the RL reward.

Two phases, so that data-parallel ranks agree: ``attach`` scores this rank's completions and records
each raw score as a component of the grade (``reward/<name>``; evaluation records carry it too);
``reward`` runs on the grades of the batch that trains (every rank holds them after the gather; see
``grpolab.rollout.collect`` for dynamic sampling) and adds ``weight x normalize(raw)`` to each RL reward,
updating running moments the same way on every rank.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import torch

from grpolab.common.progress import Reporter
from grpolab.models.reward_model import RewardModel
from grpolab.objectives.score_norm import RunningMoments, normalize_scores
from grpolab.rollout.base import Completion
from grpolab.tasks.base import Example, Grade, Task


def component(grade: Grade, name: str) -> float:
    return dict(grade.components)[name]


class RewardModels:
    """The loaded reward models of a task (``task.reward_models``) and their running moments."""

    def __init__(self, models: list[RewardModel]):
        self.models = models
        self.moments = {rm.spec.name: RunningMoments() for rm in models}

    @classmethod
    def load(cls, task: Task, device: torch.device, reporter: Reporter) -> RewardModels | None:
        specs = task.reward_models
        if not specs:
            return None
        models = []
        for spec in specs:
            with reporter.phase(f"load reward model {spec.path}") as phase:
                rm = RewardModel.load(spec, device)
                phase.info = (
                    f"{sum(p.numel() for p in rm.model.parameters()) / 1e6:.2f}M parameters on {device}, "
                    f"{rm.memory_bytes() / 2**20:.1f} MiB"
                )
            models.append(rm)
        return cls(models)

    @property
    def names(self) -> list[str]:
        return [rm.spec.name for rm in self.models]

    def memory_bytes(self) -> int:
        return sum(rm.memory_bytes() for rm in self.models)

    def check_context(self, task: Task, examples: list[Example], max_new_tokens: int) -> None:
        """Refuse (one line) a reward model whose context cannot hold the longest prompt plus max_new_tokens
        (counted in its own tokens; a ``truncate = "left"`` model keeps the end of longer texts instead)."""
        for rm in self.models:
            if rm.spec.options.truncate == "left":
                continue
            longest = max(len(rm.encode(rm.render(task.messages(e), task.prompt(e), ""))) for e in examples)
            if longest + max_new_tokens > rm.max_length:
                raise ValueError(
                    f"reward model {rm.spec.name!r}: the longest prompt ({longest} of its tokens) plus "
                    f"rollout.max_new_tokens {max_new_tokens} exceeds its max_length {rm.max_length}; "
                    'set options.truncate = "left" or a shorter max_new_tokens'
                )

    def attach(
        self, task: Task, examples: list[Example], completions: list[list[Completion]], grades: list[list[Grade]]
    ) -> list[list[Grade]]:
        """``grades`` [prompt][sample] with each model's raw score as a component; the RL reward unchanged."""
        prompts = [(task.messages(ex), task.prompt(ex)) for ex in examples]  # once per example
        texts = {
            id(rm): [
                rm.render(messages, prompt, c.text)
                for (messages, prompt), group in zip(prompts, completions)
                for c in group
            ]
            for rm in self.models
        }
        scores = {rm.spec.name: iter(rm.score(texts[id(rm)])) for rm in self.models}
        return [
            [replace(g, components=g.components + tuple((name, next(s)) for name, s in scores.items())) for g in group]
            for group in grades
        ]

    def reward(self, grades: list[list[Grade]]) -> list[list[Grade]]:
        """``grades`` with ``weight x normalize(raw)`` of each model added to their RL reward. The batch's and the
        running moments are of the samples that did not fail (a failed one's reward is unknown, and never read)."""
        flat = [g for group in grades for g in group]
        totals = torch.tensor([g.reward for g in flat], dtype=torch.float64)
        ok = torch.tensor([g.ok for g in flat], dtype=torch.bool)
        for rm in self.models if bool(ok.any()) else ():
            o = rm.spec.options
            raw = torch.tensor([component(g, rm.spec.name) for g in flat], dtype=torch.float64)[ok]
            totals[ok] += rm.spec.weight * normalize_scores(raw, o.normalize, self.moments[rm.spec.name], o.clip)
        out, values = [], iter(totals.tolist())
        for group in grades:
            out.append([replace(g, total=next(values)) for g in group])
        return out

    def metrics(self, grades: list[Grade], prefix: str = "") -> dict[str, float]:
        """Per model: the mean, std, min and max of the raw scores, and their Pearson
        correlation with the task's correctness when both vary (a falling one is the first sign of reward
        hacking)."""
        out: dict[str, float] = {}
        correct = np.array([g.answer_reward for g in grades], dtype=np.float64)
        for name in self.names:
            scores = np.array([component(g, name) for g in grades], dtype=np.float64)
            key = f"{prefix}reward_model/{name}"
            out.update(
                {
                    f"{key}/mean": float(scores.mean()),
                    f"{key}/std": float(scores.std()),
                    f"{key}/min": float(scores.min()),
                    f"{key}/max": float(scores.max()),
                }
            )
            if scores.std() > 0 and correct.std() > 0:
                out[f"{key}/corr_correct"] = float(np.corrcoef(scores, correct)[0, 1])
        return out

    def state_dict(self) -> dict[str, Any]:
        return {name: m.state_dict() for name, m in self.moments.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, saved in state.items():
            if name in self.moments:
                self.moments[name].load_state_dict(saved)
