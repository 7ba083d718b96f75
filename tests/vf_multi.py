"""A multi-turn verifiers 0.4 environment in verifiers' own API (``task.environment = "vf_multi"``): a guessing
game whose environment answers between the model's turns (an ``Env`` driving its seat's interaction).

The model guesses a digit; the environment replies "higher" / "lower" / "correct" as a user turn, for up to
``rounds`` guesses. Rewards: ``solved`` (1.0), ``quick`` (0.5: fewer guesses score more), ``guessed`` (0.1: replies that name a
digit).
"""

from __future__ import annotations

import asyncio
import re

import verifiers.v1 as vf

SYSTEM = "Guess the secret digit. Reply with one digit."


class GuessData(vf.TaskData):
    answer: str


class GuessConfig(vf.TasksetConfig):
    size: int = 10


class GuessTask(vf.Task[GuessData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def solved(self, task: GuessData, trace: vf.Trace) -> float:
        return float(any(_digit(m) == task.answer for m in _replies(trace)))

    @vf.reward(weight=0.5)
    async def quick(self, trace: vf.Trace) -> float:
        return 1.0 / max(1, len(_replies(trace)))

    @vf.reward(weight=0.1)
    async def guessed(self, trace: vf.Trace) -> float:
        """The share of replies that name a digit."""
        replies = _replies(trace)
        return sum(_digit(r) is not None for r in replies) / max(1, len(replies))


def _replies(trace: vf.Trace) -> list[str]:
    return [m.content or "" for m in trace.messages if m.role == "assistant"]


def _digit(text: str) -> str | None:
    found = re.search(r"\d", text or "")
    return found.group(0) if found else None


def feedback(guess: str | None, secret: str) -> str:
    """The environment's reply to a guess."""
    if guess is None:
        return "Reply with one digit."
    if guess == secret:
        return "correct"
    return "higher" if int(guess) < int(secret) else "lower"


class GuessTaskset(vf.Taskset[GuessTask, GuessConfig]):
    def load(self):
        for i in range(self.config.size):
            yield GuessTask(
                GuessData(
                    id=f"guess-{i}",
                    prompt=f"Game {i}: your first guess?",
                    answer=str((i * 7 + 3) % 10),
                    system_prompt=SYSTEM,
                ),
                self.config.task,
            )


class GuessEnvConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig()
    rounds: int = 3
    hang_s: float = 0.0  # seconds the env waits before its first turn (a hanging environment)
    broken: bool = False  # the env raises after the first turn (a failing environment)


class GuessEnv(vf.Env[GuessEnvConfig]):
    in_flight = peak = 0  # episodes running at once (class-wide: the tests read the peak)

    async def run(self, task, agents):
        GuessEnv.in_flight += 1
        GuessEnv.peak = max(GuessEnv.peak, GuessEnv.in_flight)
        try:
            await self._play(task, agents)
        finally:
            GuessEnv.in_flight -= 1

    async def _play(self, task, agents):
        await asyncio.sleep(self.config.hang_s)
        async with agents.agent.interaction(task) as game:
            segment = await game.turn()
            if self.config.broken:
                raise RuntimeError("the game broke")
            for _ in range(self.config.rounds - 1):
                if segment.terminated:
                    break
                reply = feedback(_digit(segment.last_reply), task.data.answer)
                if reply == "correct":
                    break
                segment = await game.turn(reply)


__all__ = ["GuessEnv", "GuessTaskset"]
