"""verifiers 0.4 environments as a task: ``task.name = "verifiers"``.

An environment is named the way verifiers itself loads one: ``environment`` is its taskset's id (an
installed module exporting one ``vf.Taskset`` subclass in ``__all__``, optionally an ``vf.Env`` subclass for
multi-turn control flow; verifiers' ``resolve_env_config`` / ``load_environment``), ``args`` its taskset's
config fields, ``env_args`` the env's (its ``id`` to pair a reusable env, its own knobs, its seats' limits).
``eval_args`` (merged over ``args``) loads the validation split as a second taskset; without it the last
``validation_size`` tasks are held out.

Each task becomes an ``Example``: id = the task's ``id`` (else its content key), question = its prompt text,
answer = its ``answer`` field when it has one, fields = its data. A rollout is verifiers' own episode
(``Env.run_episode``: the env's ``run`` control flow, the seats' turn limits, tool servers, ``@stop`` and
``@intercept`` hooks, the task's ``@reward`` scoring), with every seat's model client pointed at the
trajectory's grpolab endpoint. verifiers runs a seat's harness as a program in a sandbox; here every seat runs
verifiers' ``null`` chat loop in process (``grpolab.tasks.verifiers_harness``), in the ``subprocess`` runtime.

Grading: each ``@reward`` is a term (``Grade.components``, unweighted), the weighted sum the RL reward; the
correctness (accuracy) is ``answer_term`` (default: the heaviest reward) reaching 1; the format reward is
``format_term``'s value (default: 1 when the trajectory ended in a reply). A reward that raises is
``failed`` (the others keep their values); a rollout that fails before scoring fails ``environment``.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import os
import sys
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, JsonValue, ValidationError, field_validator

from grpolab.tasks.base import Example, Grade, TaskSettings
from grpolab.tasks.datasets import canonical_json, file_sha256, rows_sha256, text_sha256
from grpolab.tasks.environment import (
    ENVIRONMENT_TERM,
    Endpoint,
    Environment,
    EnvironmentTask,
    import_extra,
    installed_version,
    json_safe,
)

logger = logging.getLogger(__name__)
API_KEY_VAR = "GRPOLAB_VERIFIERS_API_KEY"  # verifiers reads a client's key from this variable (the endpoint's key)
IN_PROCESS_HARNESSES = ("null",)  # the harness the in-process chat loop stands in for (and a seat pinning none)
HARNESS_ID = "grpolab_chat"  # the in-process chat loop's harness id, as verifiers loads harnesses


class VerifiersError(ValueError):
    """A verifiers environment that cannot be built or run here, with what to do."""


class VerifiersTaskConfig(TaskSettings):
    """A verifiers 0.4 environment (``pip install 'grpolab[envs]'``): its taskset module and arguments."""

    name: Literal["verifiers"] = Field("verifiers", description="a verifiers 0.4 environment (the [envs] extra)")
    environment: str = Field(
        description="the taskset's id: an installed module exporting one verifiers Taskset (and optionally an Env)"
    )
    args: dict[str, JsonValue] = Field(default_factory=dict, description="the taskset's config fields")
    env_args: dict[str, JsonValue] = Field(
        default_factory=dict,
        description="the env's config fields (its id, its knobs, each seat's limits such as agent.max_turns)",
    )
    eval_args: dict[str, JsonValue] | None = Field(
        None, description="taskset fields of the validation split (merged over args); None: hold out validation_size"
    )
    validation_size: int = Field(8, ge=1, description="tasks held out from the end when eval_args is not set")
    n_train: int | None = Field(None, ge=1, description="the first N train tasks (None: all)")
    n_val: int | None = Field(None, ge=1, description="the first N validation tasks (None: all)")
    max_tasks: int = Field(100_000, ge=1, description="tasks read from a taskset at most (infinite tasksets)")
    answer_term: str | None = Field(None, description="the reward term whose value 1 counts as correct")
    format_term: str | None = Field(None, description="the reward term logged as the format reward")
    timeout_s: float = Field(300.0, gt=0, description="seconds one rollout may take")
    max_concurrency: int = Field(8, ge=1, description="rollouts in flight at once")

    @field_validator("environment")
    @classmethod
    def _module_name(cls, value: str) -> str:
        module = value.rsplit("/", 1)[-1].split("@", 1)[0]  # a hub id owner/name@version imports as name
        if not module or "." in module or ":" in module:
            raise ValueError(
                f"environment {value!r} must be a taskset id: a top-level module name, as verifiers loads it "
                "(e.g. 'my_env' for a module my_env.py on the path or an installed package)"
            )
        return value

    def nonbinary_rewards(self) -> list[str]:
        """A verifiers reward may take any value."""
        return ["task.environment"]

    def reward_weights(self) -> dict[str, float] | None:
        """The rewards' names and weights are the taskset's, known only once it is built: None."""
        return None

    def build(self) -> VerifiersTask:
        return VerifiersTask(self)


def import_verifiers() -> Any:
    """``verifiers.v1``, or a clear error naming the extra."""
    return import_extra("verifiers.v1", "verifiers", VerifiersError)


def register_harness() -> None:
    """Makes the in-process chat loop loadable by its id: verifiers imports a harness by a module name
    (``verifiers.v1.harnesses.<id>``, else ``<id>``); ours lives in grpolab, so it is registered under the
    first, for this process."""
    from grpolab.tasks import verifiers_harness

    sys.modules.setdefault(f"verifiers.v1.harnesses.{HARNESS_ID}", verifiers_harness)


def env_config(settings: VerifiersTaskConfig, taskset_args: Mapping[str, Any]) -> Any:
    """verifiers' env config for ``settings``: each seat in the subprocess runtime, on the chat loop."""
    vf = import_verifiers()
    register_harness()
    raw: dict[str, Any] = {**settings.env_args, "taskset": {**taskset_args, "id": settings.environment}}
    try:
        cls = vf.env_config_type(settings.environment, str(raw.get("id") or ""))
    except (ImportError, TypeError, AttributeError, ValueError) as err:
        raise VerifiersError(f"verifiers environment {settings.environment!r}: {err}") from None
    seats = [seat for seat, field in cls.model_fields.items() if isinstance(field.default, vf.AgentConfig)]
    if len(seats) > 1:
        raise VerifiersError(
            f"verifiers environment {settings.environment!r}: its env {cls.__name__} has {len(seats)} seats "
            f"({', '.join(seats)}); grpolab trains one trajectory per rollout: use an env with one seat"
        )
    for seat in seats:
        default = cls.model_fields[seat].default
        pinned = default.harness.id if default.harness is not None else None
        given = dict(raw.get(seat) or {})
        harness = dict(given.get("harness") or {})
        if (harness.get("id") or pinned or "null") not in IN_PROCESS_HARNESSES:
            raise VerifiersError(
                f"verifiers environment {settings.environment!r}: seat {seat!r} runs harness "
                f"{harness.get('id') or pinned!r}; grpolab runs every seat as verifiers' chat loop in process "
                f"(harness 'null'): drop the seat's harness setting"
            )
        raw[seat] = {
            **given,
            "harness": {**harness, "id": HARNESS_ID},
            "runtime": {"type": "subprocess"},
            "network_notice": False,
        }
    try:
        return vf.resolve_env_config(raw)
    except ValidationError as err:
        raise VerifiersError(f"verifiers environment {settings.environment!r}: {settings_error(err)}") from None
    except Exception as err:
        raise VerifiersError(f"verifiers environment {settings.environment!r}: {err}") from None


def settings_error(err: ValidationError) -> str:
    """verifiers' refusal of the settings, on one line, each field named as grpolab's settings name it."""

    def where(loc: tuple) -> str:
        path = ".".join(str(part) for part in loc)
        return f"task.args.{path[len('taskset.') :]}" if path.startswith("taskset.") else f"task.env_args.{path}"

    return "; ".join(f"{where(e['loc'])}: {e['msg']}" for e in err.errors())


def load_env(settings: VerifiersTaskConfig, taskset_args: Mapping[str, Any]) -> Any:
    """The verifiers ``Env`` (its taskset loaded), each seat on the in-process chat loop."""
    vf = import_verifiers()
    config = env_config(settings, taskset_args)
    try:
        return vf.load_environment(config)
    except Exception as err:
        raise VerifiersError(f"verifiers environment {settings.environment!r}: {type(err).__name__}: {err}") from None


def read_tasks(env: Any, limit: int) -> list[Any]:
    """The taskset's tasks, at most ``limit`` (an infinite taskset is cut there)."""
    tasks = []
    for task in env.taskset:
        if len(tasks) == limit:
            break
        tasks.append(task)
    return tasks


def task_id(task: Any) -> str:
    """A task's stable id: its data's ``id``, else its content key."""
    return str(task.data.id) if task.data.id is not None else task.key[:16]


def to_example(task: Any) -> Example:
    """A verifiers task as a grpolab example (its data as the fields)."""
    data = task.data.model_dump(mode="json", exclude_none=True)
    answer = data.get("answer")
    return Example(
        id=task_id(task),
        question=task.data.prompt_text,
        answer=answer if isinstance(answer, str) else "" if answer is None else canonical_json(answer),
        fields=data,
    )


class VerifiersEnvironment(Environment):
    """One verifiers environment: episodes of its tasks through grpolab endpoints, graded by its rubric."""

    def __init__(self, settings: VerifiersTaskConfig, env: Any, tasks: Mapping[str, Any]):
        self.cfg, self.env, self.tasks = settings, env, dict(tasks)
        self.name = settings.environment
        self.version = installed_version("verifiers", "verifiers")
        self.settings = {
            "environment": settings.environment,
            "args": settings.args,
            "env_args": settings.env_args,
            "eval_args": settings.eval_args,
            "env_id": env.config.env_id,
            "env_class": f"{type(env).__module__}.{type(env).__qualname__}",
        }
        self.timeout_s = settings.timeout_s
        # the env's own bound on one episode, where it declares one, caps the run's
        own = env.config.timeout.episode
        if own is not None:
            self.timeout_s = min(self.timeout_s, float(own))
        self.max_concurrency = settings.max_concurrency

    async def rollout(self, example: Example, endpoint: Endpoint) -> Grade:
        vf = import_verifiers()
        task = self.tasks.get(example.id)
        if task is None:
            raise VerifiersError(f"example {example.id!r} is not a task of environment {self.name!r}")
        os.environ[API_KEY_VAR] = endpoint.api_key  # verifiers reads it when it calls the endpoint, never stores it
        client = vf.EvalClientConfig(base_url=endpoint.base_url, api_key_var=API_KEY_VAR)
        ctx = vf.ModelContext(model=endpoint.model, client=client)
        # Each rollout holds its own serving resources (interception server, shared tool servers): the rollouts
        # run on an event loop that lives for one generation call. verifiers keeps them on the env object while
        # serving, so each rollout serves a shallow copy of it: concurrent rollouts never share or close another's.
        env = copy.copy(self.env)
        async with env.serving():
            episode = await env.run_episode(task, ctx)
        return await grade_episode(episode, task, self.cfg)


def policy_trace(episode: Any) -> Any:
    """The episode's one trace that called the model (grpolab trains one trajectory per episode)."""
    called = [t for t in episode.traces if t.num_turns > 0]
    if len(called) > 1:
        raise VerifiersError(
            f"the episode ran {len(called)} seats that called the model; grpolab trains one trajectory per "
            "rollout: use an environment with one model-driven seat"
        )
    return (called or episode.traces or [None])[0]


async def grade_episode(episode: Any, task: Any, cfg: VerifiersTaskConfig) -> Grade:
    """The Grade of a finished episode: its policy trace's rewards as terms (a reward that raised re-run alone
    to tell it from the others), the weighted sum, the answer and format rewards."""
    trace = policy_trace(episode)
    if episode.errors or trace is None or (trace.last_error is not None and not trace.rewards):
        # the env's own hooks failed (the episode is no result, as verifiers' resume counts it), or the rollout
        # failed before scoring; a reward that raised fails only its term (below)
        why = episode.errors[-1] if episode.errors else trace.last_error if trace is not None else "no trace"
        logger.warning("verifiers episode failed: %s", getattr(why, "message", why))
        return Grade.failed_as("environment", str(getattr(why, "message", why)), (ENVIRONMENT_TERM,))
    rewards = dict(trace.rewards)
    failed: list[str] = []
    if any(r is None for r in rewards.values()):
        rewards, failed = await rescore_alone(task, trace, rewards)
    components = tuple((name, 0.0 if r is None else float(r.score)) for name, r in rewards.items())
    total = sum(float(r.value) for r in rewards.values() if r is not None)
    scored = {name: r for name, r in rewards.items() if r is not None}
    main = cfg.answer_term or (max(scored, key=lambda n: scored[n].weight) if scored else None)
    if main is not None and main not in rewards:
        raise VerifiersError(
            f"answer_term {main!r} is not a reward of environment {cfg.environment!r}: {sorted(rewards)}"
        )
    answer = 1.0 if main in scored and scored[main].score >= 1.0 else 0.0
    if cfg.format_term is not None:
        fmt = scored[cfg.format_term].score if cfg.format_term in scored else 0.0
    else:
        fmt = 1.0 if trace.last_reply and trace.ok else 0.0
    return Grade(
        float(fmt),
        answer,
        extracted=trace.last_reply or None,
        components=components,
        total=total,
        failed=tuple(failed),
        error=f"reward(s) {', '.join(failed)} raised" if failed else None,
    )


async def rescore_alone(task: Any, trace: Any, rewards: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Each unscored reward run alone: verifiers scores a task's rewards together, so one that raises leaves
    them all unscored. Returns the rewards (the ones that raise still None) and the names that raised."""
    from verifiers.v1.trace import Reward
    from verifiers.v1.utils.decorators import invoke

    fns = {fn.__name__: fn for fn in task.hooks("reward")}
    failed = []
    for name, value in list(rewards.items()):
        if value is not None or name not in fns:
            if value is None:
                failed.append(name)
            continue
        weight = float(getattr(fns[name], "_vf_weight", 1.0))
        try:
            result = invoke(fns[name], {"task": trace.task.data, "trace": trace})
            if asyncio.iscoroutine(result):
                result = await result
            scores = dict(result) if isinstance(result, Mapping) else {name: result}  # keyed scores: one term each
            if name not in scores:
                del rewards[name]
            rewards.update({key: Reward(score=float(value), weight=weight) for key, value in scores.items()})
        except Exception as err:
            logger.debug("verifiers reward %r raised: %s", name, err)
            failed.append(name)
    return rewards, failed


class VerifiersTask(EnvironmentTask):
    """The train and validation tasks of a verifiers environment; prompts are its first model call."""

    def __init__(self, settings: VerifiersTaskConfig):
        self.cfg = settings
        self.name = "verifiers"
        env = load_env(settings, settings.args)
        train = read_tasks(env, settings.max_tasks)
        if settings.eval_args is not None:
            val = read_tasks(load_env(settings, {**settings.args, **settings.eval_args}), settings.max_tasks)
        else:
            if len(train) <= settings.validation_size:
                raise VerifiersError(
                    f"verifiers environment {settings.environment!r} has {len(train)} tasks: validation_size "
                    f"{settings.validation_size} leaves none to train on; lower it or set eval_args"
                )
            train, val = train[: -settings.validation_size], train[-settings.validation_size :]
        train, val = train[: settings.n_train], val[: settings.n_val]
        self._split = {"train": [to_example(t) for t in train], "validation": [to_example(t) for t in val]}
        tasks: dict[str, Any] = {}
        for split, items in (("train", train), ("validation", val)):
            for task in items:
                key = task_id(task)
                if key in tasks and tasks[key].key != task.key:
                    raise VerifiersError(
                        f"verifiers environment {settings.environment!r}: two tasks have the id {key!r} "
                        f"({split} split); give each task a unique TaskData.id"
                    )
                tasks[key] = task
        if not self._split["train"] or not self._split["validation"]:
            raise VerifiersError(
                f"verifiers environment {settings.environment!r} yielded no train or no validation tasks"
            )
        for task in tasks.values():
            if task.data.prompt is None:
                raise VerifiersError(
                    f"verifiers environment {settings.environment!r}: task {task_id(task)!r} has no prompt (its "
                    "env opens the conversation); grpolab needs the task's prompt as the first model call"
                )
        self.environment = VerifiersEnvironment(settings, env, tasks)
        self._weights = reward_functions(next(iter(tasks.values())))
        for setting in ("answer_term", "format_term"):
            term = getattr(settings, setting)
            if term is not None and term not in self._weights:
                raise VerifiersError(
                    f"task.{setting} {term!r} is not a reward of environment {settings.environment!r}: choose one "
                    f"of {', '.join(self._weights) or '(none)'}"
                )
        # a task's tools come from its class and config (``Task.toolsets`` is a classmethod): listed once for each
        listed: dict[tuple[type, str], list[dict[str, Any]]] = {}
        self._tools: dict[str, list[dict[str, Any]]] = {}
        for key, task in tasks.items():
            kind = (type(task), task.config.model_dump_json())
            if kind not in listed:
                listed[kind] = tool_schemas_of(task, env)
            self._tools[key] = listed[kind]
        self._tool_sets = list(listed.values())
        self._tokenizer: Any = None

    def reward_weights(self) -> dict[str, float]:
        """The environment's reward terms and their weights (its tasks' ``@reward`` functions and judges)."""
        return dict(self._weights)

    def train_examples(self) -> list[Example]:
        return list(self._split["train"])

    def validation_examples(self) -> list[Example]:
        return list(self._split["validation"])

    def bind_tokenizer(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def messages(self, example: Example) -> list[dict[str, Any]]:
        """The first model call's messages: the task's system prompt, then its prompt."""
        from grpolab.tasks.verifiers_harness import initial_messages

        task = self.environment.tasks[example.id]
        return initial_messages(task.data.system_prompt, task.data.prompt)

    def tools(self, example: Example) -> list[dict[str, Any]]:
        """The tool schemas the first model call carries (the task's MCP toolsets, as the chat loop names them)."""
        return self._tools[example.id]

    def prompt(self, example: Example) -> str:
        if self._tokenizer is None:
            raise RuntimeError("VerifiersTask.prompt needs bind_tokenizer(tokenizer) first")
        tools = self.tools(example)
        return self._tokenizer.apply_chat_template(
            self.messages(example), tools=tools or None, add_generation_prompt=True, tokenize=False
        )

    def prompt_template(self) -> str:
        return f"verifiers environment {self.cfg.environment}"

    def data_fingerprint(self) -> dict[str, Any]:
        rows = {split: [e.fields for e in examples] for split, examples in self._split.items()}
        return {
            "task": self.name,
            "environment": json_safe(self.environment.identity()),
            "train_rows": len(rows["train"]),
            "train_sha256": rows_sha256(rows["train"]),
            "validation_rows": len(rows["validation"]),
            "validation_sha256": rows_sha256(rows["validation"]),
            "tools_sha256": text_sha256(canonical_json(self._tool_sets)),
            "sources": (sources := module_sources(self.environment.env)),
            "sources_sha256": text_sha256(canonical_json([source["sha256"] for source in sources])),
        }


def module_sources(env: Any) -> list[dict[str, str]]:
    """The files of the environment's own code (its taskset's and env's modules, verifiers' built-ins left out)
    and their SHA-256s: a resume refuses an environment whose code changed."""
    names = dict.fromkeys(type(obj).__module__ for obj in (env.taskset, env))
    sources = []
    for name in names:
        path = getattr(sys.modules.get(name), "__file__", None)
        if path and not name.startswith("verifiers."):
            sources.append({"module": name, "file": path, "sha256": file_sha256(Path(path))})
    return sources


def reward_functions(task: Any) -> dict[str, float]:
    """Each reward term of a verifiers task and its weight: its ``@reward`` functions (config-plugged ones
    included) and its judges, in verifiers' order."""
    weights = {fn.__name__: float(getattr(fn, "_vf_weight", 1.0)) for fn in task.hooks("reward")}
    weights.update({judge.reward_name: float(judge.config.weight) for judge in task.plugged_judges()})
    return weights


def tool_schemas_of(task: Any, env: Any) -> list[dict[str, Any]]:
    """The function schemas the chat loop offers for ``task``: the taskset's shared toolsets, then the task's,
    listed from an in-memory MCP server of each (no server process)."""
    from grpolab.tasks.verifiers_harness import tool_schemas

    toolsets = [*env.taskset.toolsets(env.taskset.config), *type(task).toolsets(task.config)]
    schemas: list[dict[str, Any]] = []
    for toolset in toolsets:
        if getattr(toolset.config, "url", None):
            raise VerifiersError(
                f"toolset {toolset.server_name!r} is a remote server ({toolset.config.url}); grpolab needs the "
                "tools' schemas before the run: serve it from the environment instead"
            )
        runtime = getattr(getattr(toolset.config, "runtime", None), "type", "subprocess")
        if runtime != "subprocess":
            raise VerifiersError(
                f"toolset {toolset.server_name!r} runs in a {runtime!r} runtime; grpolab serves tool servers as "
                "local subprocesses: leave the toolset's runtime unset"
            )
        from mcp.server.mcpserver import MCPServer

        server = MCPServer(toolset.server_name or type(toolset).__name__)
        toolset.register(server)
        # its own event loop in a thread: the task may be built where a loop already runs
        with ThreadPoolExecutor(1) as pool:
            listed = pool.submit(asyncio.run, server.list_tools()).result()
        schemas.extend(tool_schemas(listed, toolset.server_name))
    return schemas
