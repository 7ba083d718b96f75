"""Rollouts an environment drives (``grpolab.tasks.environment``), as a ``RolloutEngine``.

``generate(prompts, n, params)`` runs ``n`` rollouts of each prompt's example with the task's environment, each
generating through its own trajectory of a ``PolicyEndpoint`` over the wrapped engine, all concurrently (at
most ``environment.max_concurrency`` at once, each within ``environment.timeout_s``), and returns each as the
``Completion`` the endpoint recorded, with the environment's grade in ``Completion.grade``. A rollout that
raised or timed out is a failed sample (``Grade.failure``: "timeout", "endpoint" where a call of it was refused
or failed, else "environment"), kept out of the advantages and the loss; one that never called the model trains
nothing (its one token has policy mask 0). When rollouts failed because the environment itself is gone
(``Environment.check_alive``: its server exited), or the policy endpoint stopped serving, the call raises
``EngineDied``: the run stops in one line with
its resume command. A prompt of no example (e.g. the sync check's probes) is generated
by the wrapped engine as it is.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from grpolab.models.weights import PolicyWeights
from grpolab.rollout.base import Completion, RolloutEngine, SamplingParams
from grpolab.rollout.endpoint import EndpointStopped, PolicyEndpoint, Trajectory
from grpolab.rollout.engine_process import EngineDied
from grpolab.rollout.multiturn import MultiTurnEngine
from grpolab.tasks.base import Example, Grade, Task
from grpolab.tasks.environment import ENVIRONMENT_TERM, Endpoint, Environment, EnvironmentDied

logger = logging.getLogger(__name__)
__all__ = ["EnvironmentEngine", "task_engine"]


def task_engine(
    engine: RolloutEngine, task: Task, tokenizer: Any, prompt_ids: dict[str, list[int]], examples: list[Example]
) -> RolloutEngine:
    """``engine`` with what ``task`` needs around it: its environment's rollouts (``EnvironmentEngine``, finding
    ``examples`` by their ``prompt_ids``), its tools' multi-turn loop (``MultiTurnEngine``), or nothing."""
    if task.environment is not None:
        by_prompt = {tuple(prompt_ids[e.id]): e for e in reversed(examples)}  # equal prompts: the first example
        return EnvironmentEngine(engine, task.environment, tokenizer, by_prompt)
    if task.toolset is not None:
        return MultiTurnEngine(engine, task.toolset, tokenizer)
    return engine


class EnvironmentEngine:
    """``RolloutEngine`` whose completions ``environment`` drives through an endpoint over ``engine``.

    examples: each example by its prompt's token ids (what the collector passes ``generate``).
    """

    def __init__(
        self,
        engine: RolloutEngine,
        environment: Environment,
        tokenizer: Any,
        examples: dict[tuple[int, ...], Example],
    ):
        self.engine, self.environment, self.tokenizer, self.examples = engine, environment, tokenizer, examples
        self.capabilities = getattr(engine, "capabilities", None)
        self.eos_token_ids = list(getattr(engine, "eos_token_ids", []))
        self.endpoint = PolicyEndpoint(engine, tokenizer, template_kwargs=dict(environment.chat_template_kwargs))
        environment.start()

    def sync_weights(self, weights: PolicyWeights) -> None:
        self.engine.sync_weights(weights)

    def close(self) -> None:
        try:
            self.environment.close()
        finally:
            self.endpoint.close()
            self.engine.close()

    def generate(self, prompts: list[list[int]], n: int, params: SamplingParams) -> list[list[Completion]]:
        """``n`` rollouts per prompt, ``[len(prompts)][n]``, prompt order kept."""
        examples = [self.examples.get(tuple(p)) for p in prompts]
        if not any(examples):
            return self.engine.generate(prompts, n, params)
        if not all(examples):
            raise ValueError("a call mixes prompts of examples with prompts of none: generate them apart")
        count = len(prompts) * n
        # trajectory j of prompt i is the global row (prompt_offset + i) * n + j, as engines seed samples
        first = params.prompt_index(0) * n
        with self.endpoint.serving(params, count, params.max_new_tokens, first) as trajectories:
            grades = asyncio.run(
                self._rollouts([e for e in examples for _ in range(n)], params.max_new_tokens, trajectories)
            )
            if any(not g.ok and g.failure != "reward" for g in grades):
                try:  # no later rollout can succeed without either: the run stops, resumably
                    self.environment.check_alive()
                    self.endpoint.check_alive()
                except (EnvironmentDied, EndpointStopped) as died:
                    raise EngineDied(str(died)) from None
            flat = [
                self._completion(t, p, g)
                for t, p, g in zip(trajectories, [p for p in prompts for _ in range(n)], grades)
            ]
        return [flat[i * n : (i + 1) * n] for i in range(len(prompts))]

    async def _rollouts(self, examples: list[Example], budget: int, trajectories: list[Trajectory]) -> list[Grade]:
        gate = asyncio.Semaphore(max(1, self.environment.max_concurrency))
        env = self.environment

        async def one(k: int, example: Example) -> Grade:
            endpoint = Endpoint(self.endpoint.base_url(k), self.endpoint.model_name, budget, self.endpoint.api_key)
            async with gate:
                try:
                    return await asyncio.wait_for(env.rollout(example, endpoint), env.timeout_s)
                except Exception as err:  # TimeoutError included: the rollout fails, the run goes on
                    if isinstance(err, TimeoutError):
                        kind, why = "timeout", f"timed out after {env.timeout_s:g} s"
                    elif trajectories[k].error is not None:
                        kind, why = "endpoint", f"{trajectories[k].error} (the environment raised {err!r})"
                    else:
                        kind, why = "environment", repr(err)
                    logger.warning("environment %s: rollout of %s failed: %s", env.name, example.id, why)
                    return Grade.failed_as(kind, f"environment {env.name}: {why}", (ENVIRONMENT_TERM,))

        return await asyncio.gather(*(one(k, e) for k, e in enumerate(examples)))

    def _completion(self, trajectory: Trajectory, prompt: list[int], grade: Grade) -> Completion:
        """The trajectory's recorded completion with ``grade``. A rollout that failed (a call of it may still be in
        flight) or never called the model trains nothing: one token, policy mask 0."""
        failed = not grade.ok and grade.failure != "reward"  # the rollout itself failed
        completion = None if failed else trajectory.completion(self.tokenizer)
        if completion is None:
            filler = self.eos_token_ids[:1] or [self.tokenizer.eos_token_id]
            completion = Completion(list(prompt), filler, [0.0], "stop", "", policy_mask=[0], turns=0)
        completion.grade = grade
        return completion
