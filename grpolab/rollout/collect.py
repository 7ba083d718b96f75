"""Collecting rollouts: G completions per prompt from the rollout engine, graded by the task (steps 1-2
of the loop), with length shaping when configured and DAPO's dynamic sampling when the algorithm asks
for it (it keeps groups with 0 < #correct < G, or with ``dynamic_sampling_filter = "reward"`` those whose
RL rewards, shaping and reward models included, are not all equal).

A task's reward models add their normalized term to the RL reward of the batch that trains, once, at the
end: their running moments see the scores of exactly the groups that train (kept ones, and dropped ones
only where they top up a short batch), not of every round sampled. The "reward" filter needs that term
to decide, so there it is added round by round, and the moments see every round's scores."""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, replace

import torch

from grpolab.objectives.advantages import informative_groups
from grpolab.objectives.algorithms import AlgorithmSpec
from grpolab.parallel.ranks import Ranks
from grpolab.rollout.base import Completion, RolloutEngine, SamplingParams
from grpolab.rollout.evaluation import grade_completions
from grpolab.rollout.reward_models import RewardModels
from grpolab.rollout.settings import RolloutConfig
from grpolab.tasks.base import ANSWER_TERM, Example, Grade, Task
from grpolab.tasks.shaping import RewardShapingConfig, shape_rewards
from grpolab.tasks.stream import PromptStream


@dataclass
class RolloutBatch:
    """B groups of G completions with their grades; ``rounds`` > 1 when dynamic sampling resampled."""

    examples: list[Example]
    completions: list[list[Completion]]
    grades: list[list[Grade]]
    rounds: int = 1
    seconds: dict[str, float] | None = None  # {"generate": s, "reward": s}; "wait": the learner's, when async
    staleness: int = 0  # versions between the policy that sampled it and the one it trains (rollout.pipeline)

    def rewards(self) -> torch.Tensor:
        """[B, G] float32 (a failed sample's is meaningless: see ``valid``)."""
        return torch.tensor([[g.reward for g in group] for group in self.grades], dtype=torch.float32)

    def valid(self) -> torch.Tensor:
        """[B, G] bool: the samples whose rollout and reward succeeded (``Grade.ok``); the others take no part in
        the advantages or the loss."""
        return torch.tensor([[g.ok for g in group] for group in self.grades], dtype=torch.bool)

    def reward_terms(self, names: list[str]) -> torch.Tensor:
        """[B, G, K] float32: each grade's unweighted component ``names[k]`` (``ANSWER_TERM``: the answer reward
        where a grade has no component of that name); a ValueError naming the first grade that lacks one."""
        out = torch.zeros(len(self.grades), len(self.grades[0]) if self.grades else 0, len(names))
        for i, (example, grades) in enumerate(zip(self.examples, self.grades)):
            for j, grade in enumerate(grades):
                values = dict(grade.components)
                for k, name in enumerate(names):
                    if name not in values and name != ANSWER_TERM:
                        raise ValueError(
                            f"reward term {name!r} is missing from the grade of example {example.id} sample {j} "
                            f"(its terms: {', '.join(values) or 'none'}); the task's reward terms and weights "
                            "must name the grade's components"
                        )
                    out[i, j, k] = values.get(name, grade.answer_reward)
        return out

    def flat(self) -> list[Completion]:
        return [c for group in self.completions for c in group]


def kept_groups(grades: list[list[Grade]], on: str) -> torch.Tensor:
    """[B] bool: the groups dynamic sampling keeps. ``on`` "correct": 0 < #correct < G (the groups whose
    correctness, ``answer_reward``, is not all equal); "reward": the groups whose RL rewards are not all equal;
    both over each group's valid samples (a failed one's reward is unknown)."""
    value = (lambda g: g.answer_reward) if on == "correct" else (lambda g: g.reward)
    values = torch.tensor([[value(g) for g in group] for group in grades], dtype=torch.float64)
    valid = torch.tensor([[g.ok for g in group] for group in grades], dtype=torch.bool)
    return informative_groups(values, None if bool(valid.all()) else valid)


class RolloutCollector:
    """Draws prompts from ``prompts`` (token ids in ``prompt_ids``), samples with ``engine`` and grades.
    Every generation is seeded from (seed, step, round), so a collector holds no sampling state."""

    def __init__(
        self,
        engine: RolloutEngine,
        task: Task,
        prompts: PromptStream,
        prompt_ids: dict[str, list[int]],
        rollout: RolloutConfig,
        spec: AlgorithmSpec,
        seed: int,
        shaping: RewardShapingConfig | None = None,
        ranks: Ranks = Ranks(),
        reward_models: RewardModels | None = None,
    ):
        self.engine, self.task, self.prompts, self.prompt_ids = engine, task, prompts, prompt_ids
        self.rollout, self.spec, self.seed = rollout, spec, seed
        self.shaping = shaping or RewardShapingConfig()
        self.ranks, self.reward_models = ranks, reward_models
        # ranks take whole generation batches of a round (up to their equal share of a step's prompts): with
        # rollout.max_batch_size dividing a rank's rows, every batch is one the single process generates
        self.rank_chunk = max(
            1, min(rollout.max_batch_size // rollout.group_size, rollout.prompts_per_step // ranks.world)
        )

    def with_engine(self, engine: RolloutEngine) -> RolloutCollector:
        """This collector sampling with ``engine`` instead: the same prompt stream, settings and graders (async
        rollouts' producer, drawing ahead from the stream the run's collector would)."""
        other = copy.copy(self)
        other.engine = engine
        return other

    def grade(self, examples: list[Example], completions: list[list[Completion]]) -> list[list[Grade]]:
        """The task's grades (with the reward models' raw scores), with the configured length shaping added to
        the RL reward."""
        s = self.shaping
        return [
            shape_rewards(
                grades,
                [len(c.completion_ids) for c in group],
                [c.truncated for c in group],
                self.rollout.max_new_tokens,
                s.truncation_penalty,
                s.overlong_buffer,
                s.overlong_factor,
            )
            for grades, group in zip(
                grade_completions(self.task, examples, completions, self.reward_models), completions
            )
        ]

    def sampling_params(self, step: int, round_: int) -> SamplingParams:
        r = self.rollout
        return SamplingParams(
            max_new_tokens=r.max_new_tokens,
            temperature=r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            stop_strings=tuple(r.stop_strings),
            seed=self.seed * 1_000_003 + step * 1_009 + round_,
        )

    def collect(self, step: int) -> RolloutBatch:
        """G completions for each of B prompts, graded. With dynamic sampling, groups that ``kept_groups``
        drops are set aside and more prompts sampled, up to ``max_resample_rounds`` extra rounds; a
        batch still short is topped up with dropped groups so its size never changes."""
        want, group = self.rollout.prompts_per_step, self.rollout.group_size
        spec = self.spec
        # the reward models' term is needed round by round only by a filter on the RL reward
        per_round = (
            self.reward_models is not None and spec.dynamic_sampling and spec.dynamic_sampling_filter == "reward"
        )
        kept, dropped, rounds = RolloutBatch([], [], []), RolloutBatch([], [], []), 0
        seconds = {"generate": 0.0, "reward": 0.0}
        while len(kept.examples) < want and rounds <= spec.max_resample_rounds:
            examples = self.prompts.take(want - len(kept.examples))
            mine = self.ranks.share_chunks(len(examples), self.rank_chunk)  # this rank's prompts of the round
            t0 = time.perf_counter()
            completions = self.engine.generate(
                [self.prompt_ids[e.id] for e in examples[mine.start : mine.stop]],
                group,
                replace(self.sampling_params(step, rounds), prompt_offset=mine.start),
            )
            t1 = time.perf_counter()
            grades = self.grade(examples[mine.start : mine.stop], completions)
            seconds["generate"] += t1 - t0
            seconds["reward"] += time.perf_counter() - t1
            if self.ranks.parallel:  # every rank gets the round's groups, in prompt order
                completions, grades = map(list, zip(*self.ranks.concat(list(zip(completions, grades)))))
            if per_round:  # the whole round's scores, normalized alike on every rank
                grades = self.reward_models.reward(grades)
            rounds += 1
            keep = (
                kept_groups(grades, spec.dynamic_sampling_filter)
                if spec.dynamic_sampling
                else torch.ones(len(examples), dtype=torch.bool)
            )
            for i, k in enumerate(keep.tolist()):
                target = kept if k else dropped
                target.examples.append(examples[i])
                target.completions.append(completions[i])
                target.grades.append(grades[i])
        short = want - len(kept.examples)
        grades = kept.grades + dropped.grades[:short]
        if self.reward_models is not None and not per_round:  # the batch that trains, alike on every rank
            t0 = time.perf_counter()
            grades = self.reward_models.reward(grades)
            seconds["reward"] += time.perf_counter() - t0
        return RolloutBatch(
            kept.examples + dropped.examples[:short],
            kept.completions + dropped.completions[:short],
            grades,
            rounds,
            seconds,
        )
