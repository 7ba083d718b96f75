"""OpenEnv environments (``task.name = "openenv"``): an OpenEnv server started locally, stepped by multi-turn rollouts.

``task.app`` names an OpenEnv ``Environment`` class (or an ASGI app already built with openenv-core's
``create_app``); grpolab serves it in a subprocess on 127.0.0.1 (``grpolab.tasks.openenv_server``), started
with the run and stopped with it (``grpolab.tasks.openenv_process``), and talks to it with openenv-core's own
client (``GenericEnvClient``: one websocket session per episode).

Episodes are seeds: validation takes ``seed .. seed + n_val - 1``, training the next ``n_train``. An example's
question is the text of its episode's first observation (read once, by resetting each seed when the examples
are first asked for); its prompt is the chat template over ``[system], user(first observation)``.

A rollout resets its episode with its seed, then turn after turn asks the policy through the endpoint (chat
completions), makes the reply an action (``action_format`` "text": the reply in ``action_field``; "json": the
reply is the action's JSON object), steps, and adds the next observation as a user message, until the
environment says done or ``max_turns`` replies were stepped. Its grade:

* ``openenv_reward`` (the one reward term, weight 1): the sum of the step rewards, the RL reward;
* ``answer_reward`` (accuracy): 1 when the episode ended done with a last step reward >= ``success_reward``;
* ``format_reward``: 1 when every reply became an action the environment accepted (none rejected, none cut
  at the end of the trajectory's token budget; a reply cut at ``max_reply_tokens`` is stepped as it is);
* ``extracted``: the end reason (``done``, ``max_turns``, ``invalid_action``, ``length``), the turns taken
  and the last action, for the evaluation records.

An environment call that hangs past ``step_timeout_s`` (or a rollout past ``timeout_s``) fails the rollout:
it scores 0 with the term ``environment`` failed, and the run goes on.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib.util
import json
import re
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from grpolab.tasks.base import Example, Grade, TaskSettings
from grpolab.tasks.datasets import canonical_json, file_sha256, text_sha256
from grpolab.tasks.environment import Endpoint, Environment, EnvironmentDied, EnvironmentTask, installed_version
from grpolab.tasks.openenv_process import ServerProcess, log_tail
from grpolab.tasks.prompts import fill_template, template_fields
from grpolab.tasks.sandbox import IMPORT_PATH

REWARD_TERM = "openenv_reward"
CLOSE_TIMEOUT_S = 1.0  # a session's close handshake, at most
_FENCE = re.compile(r"^```[\w-]*\n(.*)\n```$", re.DOTALL)


def run_sync(coroutine: Coroutine) -> Any:
    """Runs ``coroutine`` to its end from sync code, in a thread of its own when an event loop already runs here."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


class ActionRejected(Exception):
    """The server refused an action (it does not fit the action's schema): the policy's fault, not the server's."""


def _client_class() -> type:
    """openenv-core's ``GenericEnvClient`` that tells a rejected action (a validation error) from a failure."""
    from openenv.core.generic_client import GenericEnvClient

    class Client(GenericEnvClient):
        async def _send_and_receive(self, message: dict[str, Any]) -> dict[str, Any]:
            await self._send(message)
            response = await self._receive()
            if response.get("type") == "error":
                data = response.get("data", {})
                if message.get("type") == "step" and data.get("code") == "VALIDATION_ERROR":
                    raise ActionRejected(str(data.get("errors") or data.get("message")))
                raise RuntimeError(f"OpenEnv server error: {data.get('message', 'unknown')} ({data.get('code')})")
            return response

        async def disconnect(self) -> None:
            if self._ws is not None:  # a session whose step hangs never answers the close handshake
                self._ws.close_timeout = CLOSE_TIMEOUT_S
            await super().disconnect()

    return Client


class OpenEnvEnvironment(Environment):
    """An OpenEnv server (a subprocess) and the episode loop that steps it; see the module docstring."""

    def __init__(self, cfg: OpenEnvTaskConfig):
        self.cfg = cfg
        self.name = cfg.app
        self.version = installed_version("openenv-core", "openenv")
        self.settings = cfg.model_dump(exclude={"name"})
        self.max_concurrency, self.timeout_s = cfg.max_concurrency, cfg.timeout_s
        self.chat_template_kwargs = dict(cfg.chat_template_kwargs)  # the endpoint renders every turn with them
        self.server = ServerProcess(cfg.app, cfg.action, cfg.observation, cfg.max_concurrency, cfg.startup_timeout_s)
        self.action_field: str | None = cfg.action_field
        self._client_cls: type | None = None

    def start(self) -> None:
        """Starts the server (a no-op while it runs) and reads its action schema: which field a reply fills."""
        if self.server.running:
            return
        self.server.start()
        self.max_concurrency = min(self.cfg.max_concurrency, self.server.sessions)
        try:
            schema = self.server.get_json("/schema")
            self.action_field = self._action_field(schema.get("action", {}))
            self._check_observation(schema.get("observation", {}))
        except BaseException:
            self.server.stop()
            raise
        self._client_cls = _client_class()

    def close(self) -> None:
        self.server.stop()

    def check_alive(self) -> None:
        """``EnvironmentDied`` once the server started has exited (every later episode would fail to connect)."""
        if self.server.process is not None and not self.server.running:
            code = self.server.process.returncode
            last = (log_tail(self.server.folder / "server.log", 1) if self.server.folder else []) or ["(no output)"]
            raise EnvironmentDied(
                f"the OpenEnv server of {self.cfg.app} (pid {self.server.pid}) exited with code {code} mid-run; "
                f"its log's last line: {last[-1]}"
            )

    def _action_field(self, schema: dict[str, Any]) -> str | None:
        """The action field a text reply fills: ``action_field``, or the action's one required field."""
        fields = schema.get("properties", {})
        if self.cfg.action_format == "json":
            return None
        if self.cfg.action_field is not None:
            if self.cfg.action_field not in fields:
                raise ValueError(
                    f"task.action_field {self.cfg.action_field!r} is not a field of {self.cfg.app}'s action "
                    f"(its fields: {', '.join(f for f in fields if f != 'metadata') or 'none'})"
                )
            return self.cfg.action_field
        required = [f for f in schema.get("required", []) if f != "metadata"]
        if len(required) != 1:
            raise ValueError(
                f"{self.cfg.app}'s action has {len(required)} required fields ({', '.join(required) or 'none'}): "
                "name the one a reply fills with task.action_field, or set task.action_format = 'json'"
            )
        return required[0]

    def _check_observation(self, schema: dict[str, Any]) -> None:
        fields = set(schema.get("properties", {})) | {"reward", "done"}
        field = self.cfg.observation_field
        named = template_fields(self.cfg.observation_template or "") + ([field] if field else [])
        missing = [f for f in named if f not in fields]
        if missing:
            raise ValueError(
                f"task.observation_template / observation_field name {missing[0]!r}, which {self.cfg.app}'s "
                f"observation lacks (its fields: {', '.join(sorted(fields - {'metadata'}))})"
            )

    def observation_text(self, observation: dict[str, Any], reward: float | None, done: bool) -> str:
        """An observation as the user message the policy reads: ``observation_template`` filled in (its fields,
        ``reward`` and ``done``), or the field ``observation_field``, or the observation's only text field, or
        its fields as JSON."""
        values = {**observation, "reward": reward, "done": done}
        if self.cfg.observation_template is not None:
            return fill_template(self.cfg.observation_template, values)
        if self.cfg.observation_field is not None:
            return str(values[self.cfg.observation_field])
        texts = [v for v in observation.values() if isinstance(v, str)]
        if len(texts) == 1:
            return texts[0]
        return json.dumps(observation, ensure_ascii=False, sort_keys=True)

    def action(self, reply: str) -> dict[str, Any]:
        """The action a reply makes (ActionRejected when a "json" reply is not a JSON object)."""
        text = reply.strip()
        if self.cfg.action_format == "text":
            return {self.action_field: text}
        fenced = _FENCE.match(text)
        try:
            value = json.loads(fenced.group(1) if fenced else text)
        except json.JSONDecodeError as err:
            raise ActionRejected(f"the reply is not JSON: {err}") from None
        if not isinstance(value, dict):
            raise ActionRejected("the reply is JSON but not an object of the action's fields")
        return value

    def client(self) -> Any:
        """openenv-core's client of the running server, for one episode (one websocket session)."""
        if self._client_cls is None:
            raise RuntimeError("the OpenEnv server is not started (Environment.start)")
        return self._client_cls(
            base_url=self.server.base_url,
            connect_timeout_s=self.cfg.step_timeout_s,
            message_timeout_s=self.cfg.step_timeout_s,
        )

    async def first_observation(self, seed: int) -> str:
        """The text of episode ``seed``'s first observation (a reset, then the session closes)."""
        async with self.client() as env:
            result = await env.reset(seed=seed, **self.cfg.reset_args)
        return self._opening(result, seed)

    def _opening(self, result: Any, seed: int) -> str:
        if result.done:
            raise ValueError(f"{self.cfg.app}: episode seed {seed} is done at reset; the policy has no turn to take")
        return self.observation_text(result.observation, result.reward, result.done)

    def _cut_at_reply_cap(self, reply: Any) -> bool:
        """Whether a reply cut at a token limit was cut at ``max_reply_tokens`` (it is stepped as it is), not at the
        end of the trajectory's budget."""
        cap, usage = self.cfg.max_reply_tokens, getattr(reply, "usage", None)
        return bool(cap) and usage is not None and usage.completion_tokens >= cap

    def messages(self, first: str) -> list[dict[str, str]]:
        """An episode's first messages: [system], user(first observation)."""
        system = [{"role": "system", "content": self.cfg.system}] if self.cfg.system else []
        return system + [{"role": "user", "content": first}]

    async def rollout(self, example: Example, endpoint: Endpoint) -> Grade:
        seed = int(example.fields["seed"])
        total, last_reward, turns, last_action, reason = 0.0, None, 0, "", "max_turns"
        async with self.client() as env, endpoint.client(timeout=self.timeout_s) as llm:
            result = await env.reset(seed=seed, **self.cfg.reset_args)
            first = self._opening(result, seed)
            if first != example.question:
                raise RuntimeError(
                    f"{self.cfg.app}: reset(seed={seed}) opened with another observation than before; the "
                    "environment must open each seed's episode the same way"
                )
            messages = self.messages(first)
            cap = {"max_tokens": self.cfg.max_reply_tokens} if self.cfg.max_reply_tokens else {}
            while turns < self.cfg.max_turns:
                reply = await llm.chat.completions.create(model=endpoint.model, messages=messages, **cap)
                choice = reply.choices[0]
                text = choice.message.content or ""
                messages.append({"role": "assistant", "content": text})
                turns += 1
                if choice.finish_reason == "length" and not self._cut_at_reply_cap(reply):
                    reason = "length"  # the trajectory's token budget is spent: no reply can follow
                    break
                try:
                    action = self.action(text)
                    last_action = text.strip()
                    result = await env.step(action)
                except ActionRejected:
                    reason = "invalid_action"
                    break
                last_reward = result.reward
                total += float(result.reward or 0.0)
                if result.done:
                    reason = "done"
                    break
                messages.append(
                    {"role": "user", "content": self.observation_text(result.observation, result.reward, result.done)}
                )
        success = reason == "done" and last_reward is not None and last_reward >= self.cfg.success_reward
        return Grade(
            format_reward=float(reason in ("done", "max_turns")),
            answer_reward=float(success),
            extracted=f"{reason} after {turns} turns, last action {last_action[:80]!r}",
            components=((REWARD_TERM, total),),
            total=total,
        )


class OpenEnvTask(EnvironmentTask):
    """Episodes of an OpenEnv environment as examples; see the module docstring."""

    name = "openenv"

    def __init__(self, cfg: OpenEnvTaskConfig):
        self.cfg = cfg
        self.environment = OpenEnvEnvironment(cfg)
        self.tokenizer: Any = None
        self._episodes: dict[str, list[Example]] | None = None

    def _examples(self) -> dict[str, list[Example]]:
        """Each split's episodes, their first observations read once (from the server, started for them and stopped
        after unless it ran already)."""
        if self._episodes is None:
            cfg = self.cfg
            seeds = {
                "val": list(range(cfg.seed, cfg.seed + cfg.n_val)),
                "train": list(range(cfg.seed + cfg.n_val, cfg.seed + cfg.n_val + cfg.n_train)),
            }
            started = not self.environment.server.running
            self.environment.start()
            try:
                openings = run_sync(self._openings([s for split in seeds.values() for s in split]))
            finally:
                if started:  # the rollouts' engine starts it again: nothing runs while nothing uses it
                    self.environment.close()
            self._episodes = {
                split: [
                    Example(id=f"{split}-{seed}", question=openings[seed], answer="", fields={"seed": seed})
                    for seed in split_seeds
                ]
                for split, split_seeds in seeds.items()
            }
        return self._episodes

    async def _openings(self, seeds: list[int]) -> dict[int, str]:
        limit = asyncio.Semaphore(self.environment.max_concurrency)

        async def one(seed: int) -> str:
            async with limit:
                return await self.environment.first_observation(seed)

        return dict(zip(seeds, await asyncio.gather(*(one(s) for s in seeds))))

    def train_examples(self) -> list[Example]:
        return list(self._examples()["train"])

    def validation_examples(self) -> list[Example]:
        return list(self._examples()["val"])

    def bind_tokenizer(self, tokenizer: Any) -> None:
        """The model's tokenizer, whose chat template renders the first call (refused when it has none)."""
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("task.name 'openenv' needs a model whose tokenizer has a chat template")
        self.tokenizer = tokenizer

    def messages(self, example: Example) -> list[dict[str, str]]:
        return self.environment.messages(example.question)

    def prompt(self, example: Example) -> str:
        """The episode's first model call as the chat template renders it (generation prompt appended)."""
        if self.tokenizer is None:
            raise RuntimeError("openenv prompts are rendered once the model's tokenizer is bound (bind_tokenizer)")
        return self.tokenizer.apply_chat_template(
            self.messages(example), tokenize=False, add_generation_prompt=True, **self.cfg.chat_template_kwargs
        )

    def prompt_template(self) -> str:
        return canonical_json(
            {
                "system": self.cfg.system,
                "user": "{first observation}",
                "chat_template_kwargs": self.cfg.chat_template_kwargs,
                "chat_template": getattr(self.tokenizer, "chat_template", None),
            }
        )

    def data_fingerprint(self) -> dict[str, Any]:
        """The environment's identity, the source file of its module (and SHA-256), each split's seeds and the
        SHA-256 of their first observations, and the prompt's."""
        rows = lambda examples: "\n".join(f"{e.id}\t{e.question}" for e in examples)  # noqa: E731
        examples = self._examples()
        module = self.cfg.app.partition(":")[0]
        spec = importlib.util.find_spec(module)
        source = spec.origin if spec is not None and spec.origin and Path(spec.origin).is_file() else None
        return {
            "task": self.name,
            "environment": self.environment.identity(),
            "app_source": source,
            "app_source_sha256": file_sha256(Path(source)) if source else None,
            "train_rows": len(examples["train"]),
            "train_sha256": text_sha256(rows(examples["train"])),
            "validation_rows": len(examples["val"]),
            "validation_sha256": text_sha256(rows(examples["val"])),
            "prompt_template_sha256": text_sha256(self.prompt_template()),
        }


class OpenEnvTaskConfig(TaskSettings):
    """An OpenEnv environment server, started locally, stepped by multi-turn rollouts (needs ``grpolab[envs]``)."""

    name: Literal["openenv"] = Field("openenv", description="an OpenEnv environment server stepped by rollouts")
    app: str = Field(
        description="'package.module:EnvironmentClass' (an OpenEnv Environment subclass, served with create_app) "
        "or 'package.module:app' (an app built with openenv's create_app)"
    )
    action: str | None = Field(None, description="'package.module:ActionClass' (None: the Environment's type argument)")
    observation: str | None = Field(
        None, description="'package.module:ObservationClass' (None: the Environment's type argument)"
    )
    action_format: Literal["text", "json"] = Field(
        "text", description="text: the reply fills action_field; json: the reply is the action as a JSON object"
    )
    action_field: str | None = Field(
        None, description="the action field a text reply fills (None: its one required field)"
    )
    observation_field: str | None = Field(
        None, description="the observation field the policy reads (None: its only text field, else all as JSON)"
    )
    observation_template: str | None = Field(
        None, description="the observation as text, e.g. '{message} ({remaining} left)': its fields, reward, done"
    )
    system: str | None = Field(None, description="a system message before the first observation")
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict, description="extra chat template arguments")
    reset_args: dict[str, Any] = Field(default_factory=dict, description="arguments every reset gets besides its seed")
    n_train: int = Field(64, ge=1, description="training episodes (seeds after the validation ones)")
    n_val: int = Field(16, ge=1, description="validation episodes (seeds seed .. seed + n_val - 1)")
    seed: int = Field(0, ge=0, description="the first episode seed")
    max_turns: int = Field(8, ge=1, description="policy replies stepped per episode at most")
    max_reply_tokens: int | None = Field(
        None, ge=1, description="tokens one reply may take (None: what is left of rollout.max_new_tokens)"
    )
    success_reward: float = Field(1.0, description="answer_reward is 1 when the last step reward is at least this")
    max_concurrency: int = Field(8, ge=1, description="episodes in flight at once (1 where the env is not concurrent)")
    startup_timeout_s: float = Field(60.0, gt=0, description="seconds the server may take to answer /health")
    step_timeout_s: float = Field(30.0, gt=0, description="seconds one reset or step may take")
    timeout_s: float = Field(300.0, gt=0, description="seconds one whole episode may take")

    FILES: ClassVar[tuple[str, ...]] = ()

    @field_validator("app", "action", "observation")
    @classmethod
    def _import_path(cls, value: str | None) -> str | None:
        if value is not None and not IMPORT_PATH.fullmatch(value):
            raise ValueError(f"{value!r} is not an import path 'package.module:Name'")
        return value

    @model_validator(mode="after")
    def _one_observation_rule(self) -> OpenEnvTaskConfig:
        if self.observation_field is not None and self.observation_template is not None:
            raise ValueError("set task.observation_field or task.observation_template, not both")
        if self.action_format == "json" and self.action_field is not None:
            raise ValueError("task.action_field applies to action_format 'text' only")
        return self

    def nonbinary_rewards(self) -> list[str]:
        """An environment's step rewards, summed over an episode, may take any value."""
        return [f"task.app ({self.app}: the environment's step rewards, summed)"]

    def reward_weights(self) -> dict[str, float]:
        """One term: the episode's summed step rewards."""
        return {REWARD_TERM: 1.0}

    def prompt_format(self) -> str:
        return "chat"

    def build(self) -> OpenEnvTask:
        installed_version("openenv-core", "openenv")  # refused up front when openenv-core is missing
        return OpenEnvTask(self)
