"""Environments: tasks whose rollouts an outside environment drives and grades (verifiers, OpenEnv).

An environment runs one rollout of one example at a time (``Environment.rollout``, a coroutine; many run
concurrently). It generates by calling an OpenAI-compatible chat-completions endpoint that grpolab serves
over its rollout engine for the length of the rollouts (``Endpoint``: one per trajectory), may put its own
messages (observations, tool output, a user simulator's turns) between the policy's turns, and returns the
trajectory's ``Grade`` (its reward terms as components). grpolab records every call token-in/token-out:
the trajectory trains on exactly the tokens the engine sampled, the environment's messages masked out of
the loss.

The endpoint samples with the run's rollout settings (temperature, top-p, top-k, seed); a request's own
sampling arguments are ignored, except ``max_tokens`` (capped by what is left of the trajectory's
``rollout.max_new_tokens``) and ``stop``. A rollout that raises, or runs past ``timeout_s``, scores 0 with
the term ``environment`` failed: never a hang, never a crash.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from grpolab.common.extras import require
from grpolab.tasks.base import ENVIRONMENT_TERM, Example, Grade, Task
from grpolab.tasks.datasets import text_sha256


def json_safe(value: Any) -> Any:
    """``value`` as JSON writes and reads it back (tuples become lists, other objects their ``str``), so that a
    recorded identity compares equal to a rebuilt one."""
    return json.loads(json.dumps(value, default=str))


ENVS_EXTRA = "pip install 'grpolab[envs]'"  # the extra that holds the environments' packages


def installed_version(distribution: str, task_name: str) -> str:
    """``distribution``'s installed version (what a manifest records), or one line naming the extra; reads the
    package metadata only, so nothing heavy is imported."""
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        raise ValueError(f"task.name '{task_name}' needs {distribution}: {ENVS_EXTRA}") from None


def import_extra(module: str, task_name: str, error: type[ValueError] = ValueError) -> Any:
    """``module`` imported, or ``error`` in one line naming the extra."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise error(f"task.name '{task_name}' needs {module.split('.')[0]} ({err}): {ENVS_EXTRA}") from None


class EnvironmentDied(RuntimeError):
    """What an environment's rollouts need is gone (its server exited): no later rollout can succeed."""


@dataclass(frozen=True)
class Endpoint:
    """Where one trajectory generates: an OpenAI-compatible server on the loopback address.

    base_url: ``http://127.0.0.1:PORT/.../v1``, this trajectory's own (calls on it form one trajectory).
    model: the model name the server answers to.
    max_tokens: the trajectory's token budget (``rollout.max_new_tokens``: its turns and the messages put
        between them, together).
    api_key: the key the server requires (``Authorization: Bearer KEY``), random for each run: keep it out of
        logs and files.
    """

    base_url: str
    model: str
    max_tokens: int
    api_key: str = field(default="", repr=False)

    def client(self, timeout: float = 600.0) -> Any:
        """An ``openai.AsyncOpenAI`` client of this endpoint (no retries: a failed call fails the rollout); use it as
        ``async with endpoint.client() as client:`` so that it closes within the rollout's event loop."""
        require("an environment's endpoint client", "openai")
        import openai

        return openai.AsyncOpenAI(
            base_url=self.base_url, api_key=self.api_key or "none", max_retries=0, timeout=timeout
        )


class Environment(ABC):
    """An environment grpolab's rollouts step: one coroutine per trajectory.

    Attributes:
        name: what it is (e.g. the verifiers environment's module), for the manifest.
        version: its package's version, for the manifest (a resumed run refuses another).
        settings: the arguments it was built with, for the manifest (JSON values).
        max_concurrency: rollouts in flight at once.
        timeout_s: wall-clock seconds one rollout may take.
        chat_template_kwargs: keyword arguments of the endpoint's chat template (e.g. ``enable_thinking``).
    """

    name: str
    version: str
    settings: Mapping[str, Any] = {}
    max_concurrency: int = 8
    timeout_s: float = 300.0
    chat_template_kwargs: Mapping[str, Any] = {}

    def start(self) -> None:
        """Starts what the rollouts need (a server process); called before the first rollout, may be called
        again (then a no-op)."""

    def close(self) -> None:
        """Stops what ``start`` started; may be called more than once."""

    def check_alive(self) -> None:
        """Raises ``EnvironmentDied`` when what ``start`` started is gone (a server process that exited): called when
        rollouts failed, so that a dead environment stops the run instead of failing every later rollout. Default:
        nothing to check."""

    @abstractmethod
    async def rollout(self, example: Example, endpoint: Endpoint) -> Grade:
        """One trajectory of ``example``, generated through ``endpoint``, and its grade."""

    def identity(self) -> dict[str, Any]:
        """Name, version and settings: what the manifest records and a resume checks."""
        return {"name": self.name, "version": self.version, "settings": dict(self.settings)}


class EnvironmentTask(Task):
    """A task whose rollouts and grades come from ``environment`` (set by the subclass).

    ``prompt(example)`` must be the text of the trajectory's first model call (what the endpoint renders
    from the environment's first messages): it is what validation records hash and what the collector
    hands the engine, whose environment wrapper finds the example by it.
    """

    environment: Environment

    def data_fingerprint(self) -> dict[str, Any]:
        """The environment's identity (checked on resume) and the examples' counts and SHA-256s (ids, questions,
        answers)."""
        splits = {"train": self.train_examples(), "validation": self.validation_examples()}
        out: dict[str, Any] = {"environment": json_safe(self.environment.identity())}
        for split, examples in splits.items():
            out[f"{split}_rows"] = len(examples)
            out[f"{split}_sha256"] = text_sha256(json.dumps([[e.id, e.question, e.answer] for e in examples]))
        return out

    def grade(self, completion: str, example: Example, truncated: bool) -> Grade:
        """An environment grades its own rollouts (``Completion.grade``); a completion it never saw scores 0,
        counted as failed."""
        return Grade.failed_as("environment", "the environment never graded this completion", (ENVIRONMENT_TERM,))
