"""OpenEnv environments for the tests, built from openenv-core's own base classes (served by grpolab's
server subprocess: ``task.app = "openenv_envs:GuessEnvironment"`` with ``tests/`` on the path).

``GuessEnvironment``: guess-the-number. ``reset(seed)`` picks a secret in 1..``HIGH`` from the seed; each step
reads a number from the guess and answers higher / lower / correct; reward 1 and done on the secret, done
after ``MAX_GUESSES`` guesses. The first observation names the game's number (the seed), so that each
episode opens with its own text. A guess of ``hang`` never gets an answer (an environment call that hangs).
"""

from __future__ import annotations

import random
import re
import time
from typing import Any

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State

HIGH = 4
MAX_GUESSES = 4


class GuessAction(Action):
    guess: str


class GuessObservation(Observation):
    message: str
    remaining: int = 0


class GuessState(State):
    secret: int = 0


class GuessEnvironment(Environment[GuessAction, GuessObservation, GuessState]):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = GuessState()

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> GuessObservation:
        self._state = GuessState(episode_id=episode_id, secret=random.Random(seed).randint(1, HIGH))
        return GuessObservation(
            message=f"Game {seed}: guess my number from 1 to {HIGH}. Reply with a number.", remaining=MAX_GUESSES
        )

    def step(self, action: GuessAction, timeout_s: float | None = None, **kwargs: Any) -> GuessObservation:
        self._state.step_count += 1
        left = MAX_GUESSES - self._state.step_count
        if action.guess.strip() == "hang":
            time.sleep(3600)
        found = re.search(r"-?\d+", action.guess)
        if found is None:
            return GuessObservation(message="That is not a number.", remaining=left, done=left <= 0, reward=0.0)
        guess = int(found.group())
        if guess == self._state.secret:
            return GuessObservation(message="Correct!", remaining=left, done=True, reward=1.0)
        hint = "higher" if guess < self._state.secret else "lower"
        return GuessObservation(message=f"No, {hint}.", remaining=left, done=left <= 0, reward=0.0)

    @property
    def state(self) -> GuessState:
        return self._state


class SoloGuessEnvironment(GuessEnvironment):
    """Guess-the-number that does not declare concurrent sessions: the server serves one episode at a time."""

    SUPPORTS_CONCURRENT_SESSIONS = False


class NotAnEnvironment:
    """Neither an OpenEnv Environment nor an app: the server refuses it at start."""
