"""A run's parts, assembled in one place: task, policy and reference (``grpolab.models.policy``),
optimizer, engine with its wrappers, rollout collector, learner, run state.

``build_parts`` is the only code that puts a run together. The trainer (``grpolab.run.trainer``) adds
the run directory, the loop and the checkpoints around the parts; ``grpolab probe`` and ``grpolab bench``
build the same parts with ``assemble`` and no run directory.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from rich.console import Console
from torch import nn

from grpolab.common.extras import require
from grpolab.common.progress import Reporter
from grpolab.common.threads import ThreadChoice, choose_threads
from grpolab.config import RunConfig
from grpolab.learning.learner import SHARDED_FORWARD, FrozenModels, LearnerState, PolicyLearner, TrainedModel
from grpolab.learning.shared_prefix import unit_logprobs
from grpolab.models.fidelity import check_trainable
from grpolab.models.loading import resolve_device, resolve_dtype
from grpolab.models.logprobs import enable_gradient_checkpointing
from grpolab.models.policy import Policy, load_run_policy, policy_start
from grpolab.models.precision import TrainingPrecision, resolve_precision
from grpolab.models.prompt_tokens import tokenize_prompts
from grpolab.models.routing import routers
from grpolab.models.sources import FolderRequest, check_model_spec, is_local_folder, resolve_model_dir
from grpolab.models.teacher import Teacher, load_teacher
from grpolab.models.weights import PolicyWeights
from grpolab.objectives.rollout_correction import AUTO, auto_rollout_correction
from grpolab.parallel.ranks import Ranks, init_from_env
from grpolab.rollout.base import RolloutEngine
from grpolab.rollout.collect import RolloutCollector
from grpolab.rollout.engines import (
    ENGINES,
    EngineRequest,
    build_engine,
    build_engine_apart,
    capabilities,
    check_settings,
    dtype_name,
    weight_kind,
)
from grpolab.rollout.environment import task_engine
from grpolab.rollout.lockstep import LockstepEngine
from grpolab.rollout.pipeline import AsyncRollouts, RolloutSource, SyncRollouts
from grpolab.rollout.reward_models import RewardModels
from grpolab.rollout.sync_check import MIN_NOISE_FLOOR, SyncMonitor
from grpolab.run.checkpoints import is_checkpoint, verify
from grpolab.run.state import RunState
from grpolab.tasks import build_task
from grpolab.tasks.base import Example, Task
from grpolab.tasks.stream import PromptStream
from grpolab.tools.protocol import Toolset

FSDP_TOOLS = (
    "dist.strategy 'fsdp' with rollout.engine 'hf' cannot use tools or an environment (every rank must take the "
    "same number of generation steps on the sharded model); use rollout.engine 'vllm' or dist.strategy 'ddp'"
)


@dataclass
class Setting:
    """Where a run's parts live: its ranks, this rank's device and CPU threads, and where it reports."""

    ranks: Ranks
    device: torch.device
    threads: ThreadChoice
    reporter: Reporter


@dataclass
class RunParts:
    """Everything one run is made of. The trainer never asks which algorithm, task or engine these are."""

    cfg: RunConfig
    setting: Setting
    task: Task
    val_examples: list[Example]
    policy: Policy
    reward_models: RewardModels | None
    optimizer: torch.optim.Optimizer
    prompts: PromptStream
    prompt_ids: dict[str, list[int]]
    sync_monitor: SyncMonitor
    state: RunState
    collector: RolloutCollector  # the run's engine (``engine``) samples evaluations, and sync rollouts
    learner: PolicyLearner
    rollouts: RolloutSource  # each step's rollout batch (``grpolab.rollout.pipeline``)
    resolved: dict[str, str] = field(default_factory=dict)  # each "auto" setting -> what it became, and why
    closed: bool = False
    teacher: Teacher | None = None  # on-policy distillation's frozen teacher

    # the parts most code reads, by name
    spec = property(lambda self: self.cfg.algorithm)
    ranks = property(lambda self: self.setting.ranks)
    device = property(lambda self: self.setting.device)
    model = property(lambda self: self.policy.model)
    tokenizer = property(lambda self: self.policy.tokenizer)
    reference = property(lambda self: self.policy.reference)
    precision = property(lambda self: self.policy.precision)
    model_dir = property(lambda self: self.policy.model_dir)

    @property
    def engine(self) -> RolloutEngine:
        return self.collector.engine

    @property
    def sharded(self) -> bool:
        return is_sharded_run(self.cfg, self.ranks)

    @property
    def toolset(self) -> Toolset | None:
        return self.task.toolset

    def sync_source(self) -> PolicyWeights:
        """The policy's weights as the engine's sync takes them (``grpolab.models.weights``), of the kind the
        engine's capabilities select (``grpolab.rollout.engines.weight_kind``), versioned by the updates applied
        so far. Weights gathered from shards: every rank calls this."""
        kind = weight_kind(self.cfg, self.policy.copy_kinds)
        return self.policy.weights(kind, self.state.updates["actual"])

    def close(self) -> None:
        """Close the engine (its processes, its memory); the other parts stay readable. Safe to call twice."""
        if not self.closed:
            self.closed = True
            self.rollouts.close()
            self.engine.close()


def is_sharded_run(cfg: RunConfig, ranks: Ranks) -> bool:
    return ranks.parallel and cfg.dist.strategy == "fsdp"


def set_up(cfg: RunConfig, reporter_for: Callable[[Ranks], Reporter]) -> Setting:
    """Refuse settings the chosen engine cannot run (one line, before anything is loaded or written); join the
    ranks torchrun describes (if any), seed torch, choose the CPU threads. Prints nothing."""
    check_settings(cfg)
    ranks, device = init_from_env(resolve_device(cfg.model.device), cfg.dist.timeout_minutes)
    if cfg.rollout.prompts_per_step % ranks.world:
        raise ValueError(
            f"rollout.prompts_per_step {cfg.rollout.prompts_per_step} cannot be split into whole "
            f"prompt groups over {ranks.world} ranks"
        )
    if ranks.parallel and cfg.rollout.mode == "async":
        raise ValueError(
            f"rollout.mode 'async' runs one learner process; with {ranks.world} ranks use rollout.mode 'sync'"
        )
    torch.manual_seed(cfg.seed)
    threads = choose_threads(cfg.threads)
    torch.set_num_threads(threads.threads)
    return Setting(ranks, device, threads, reporter_for(ranks))


def load_task(cfg: RunConfig, reporter: Reporter) -> tuple[Task, list[Example]]:
    """The task and the validation examples the run evaluates on; one line for a task without training or
    validation examples (before a run directory exists)."""
    with reporter.phase(f"load task {cfg.task.name}", done_note=None):
        task = build_task(cfg.task)
        examples, wanted = task.validation_examples(), cfg.eval.n_examples
        for split, count in (("training", len(task.train_examples())), ("validation", len(examples))):
            if not count:  # a run could draw no prompt (it would wait forever) or evaluate nothing
                raise ValueError(f"task {task.name!r} has no {split} examples")
        if wanted is not None and wanted > len(examples):
            raise ValueError(
                f"eval.n_examples {wanted} > the {len(examples)} validation examples of task {task.name!r}"
            )
    return task, examples[:wanted]


def prepare_policy(cfg: RunConfig, setting: Setting, task: Task, weights_dir: Path | None = None) -> Policy:
    """The policy (from ``weights_dir``, a checkpoint to resume, else the model's start) with its
    tokenizer, and the frozen reference (the start policy) when the objective needs one; under FSDP
    both sharded before the optimizer is made."""
    ranks, reporter, device = setting.ranks, setting.reporter, setting.device
    sharded = is_sharded_run(cfg, ranks)
    shares = capabilities(cfg.rollout.engine).shares_training_model  # a sharded model generates in lockstep
    if sharded and shares and (task.toolset is not None or task.environment is not None):
        raise ValueError(FSDP_TOOLS)
    start = _checkpoint_path(cfg.model.path)
    if start is not None:  # another run's checkpoint (a suite's init_from): every file it lists checks out first
        ranks.run_on_main(lambda: verify(start))
    check_model_spec(cfg.model.path, cfg.model.revision)
    if cfg.model.lora is not None:  # before a model is built or loaded
        require("model.lora", "peft")
    engine = ENGINES[cfg.rollout.engine]
    if not engine.available(cfg.rollout):  # its package: said now, not once the model has loaded
        raise ValueError(engine.missing or f"{engine.label} is not available in this environment")
    reporter.line(setting.threads.note)
    if ranks.parallel:
        reporter.line(
            f"data parallel: {ranks.world} ranks ({cfg.dist.strategy}), "
            f"{cfg.rollout.prompts_per_step // ranks.world} prompt groups each per step"
        )
    # rank 0 first: a warm start of the demo's model is cached, and the other ranks then find it
    request = FolderRequest(task, cfg.model.like_overrides, cfg.model.warm_start, cfg.model.revision)
    model_dir = ranks.run_on_main(lambda: resolve_model_dir(cfg.model.path, replace(request, reporter=reporter)))
    if not ranks.is_main:
        model_dir = resolve_model_dir(cfg.model.path, request)
    precision = resolve_precision(cfg.optim.precision, resolve_dtype(cfg.model.dtype, device))
    model_dir, started_from = policy_start(model_dir, cfg.model.lora, cfg.needs_reference())
    weights_dir = weights_dir or model_dir
    with reporter.phase(f"load model {weights_dir}") as phase:
        policy = load_run_policy(
            model_dir,
            weights_dir,
            precision,
            device,
            lora=cfg.model.lora,
            seed=cfg.seed,
            sharded=sharded,
            started_from=started_from,
        )
        phase.info = policy.describe()
    model = policy.model
    if cfg.model.router_aux_loss_coef and not routers(model):
        raise ValueError(f"model.router_aux_loss_coef needs a Mixture-of-Experts model; {model_dir} has no routers")
    task.bind_tokenizer(policy.tokenizer)  # chat-template prompts render with the model's own tokenizer
    if cfg.model.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    model.eval()
    if cfg.needs_reference():
        policy.add_reference()
    if sharded:  # before the optimizer: it must hold the shards
        policy.shard({SHARDED_FORWARD: unit_logprobs})
    return policy


def _checkpoint_path(path: str | None) -> Path | None:
    """``model.path`` when it names a folder a grpolab run wrote as a checkpoint, else None."""
    if not is_local_folder(path):
        return None
    folder = Path(path).expanduser()
    return folder if is_checkpoint(folder) else None


def prompt_token_ids(
    cfg: RunConfig, task: Task, tokenizer, model: nn.Module, examples: list[Example]
) -> dict[str, list[int]]:
    """Prompt token ids by example id, with the tokenizer's BOS once (``grpolab.models.prompt_tokens``). Refuses
    (listing example ids) prompts longer than rollout.max_prompt_tokens or leaving no room for
    max_new_tokens in the model's context."""
    ids = tokenize_prompts(tokenizer, [task.prompt(e) for e in examples])
    limit = cfg.rollout.max_prompt_tokens or float("inf")
    context = getattr(model.config, "max_position_embeddings", None)
    if context:
        limit = min(limit, context - cfg.rollout.max_new_tokens)
    too_long = [e.id for e, p in zip(examples, ids) if len(p) > limit]
    if too_long:
        raise ValueError(
            f"{len(too_long)} prompts are longer than {limit} tokens (rollout.max_prompt_tokens, "
            f"or the model's context minus rollout.max_new_tokens); never truncated. Example ids: "
            f"{', '.join(too_long[:20])}{' ...' if len(too_long) > 20 else ''}"
        )
    return {e.id: p for e, p in zip(examples, ids)}


def engine_request(cfg: RunConfig, setting: Setting, policy: Policy, max_model_len: int) -> EngineRequest:
    """What the run's engine is built from, in the run's process or in one of its own (async rollouts). An
    engine holding its own weights starts from the policy's start files."""
    return EngineRequest(
        cfg.rollout,
        policy.model,
        policy.tokenizer,
        policy.start_files,
        cfg.seed,
        max_model_len,
        policy.precision,
        sharded=is_sharded_run(cfg, setting.ranks),
        adapter_rank=policy.adapter_rank,
    )


def rollout_engine(
    request: EngineRequest,
    setting: Setting,
    task: Task,
    prompt_ids: dict[str, list[int]],
    examples: list[Example],
) -> RolloutEngine:
    """The engine ``request`` names, with the wrappers the run needs: lock-step decoding over FSDP
    ranks, multi-turn tool use or an environment's rollouts (``task_engine``: observations masked out of the
    loss)."""
    name, sharded = request.cfg.engine, request.sharded
    shares = capabilities(name).shares_training_model
    with setting.reporter.phase(f"start {name} engine", done_note=not shares or None):
        engine = build_engine(request)
        if sharded and shares:  # it generates with the sharded model
            engine = LockstepEngine(engine, setting.ranks, filler=[request.tokenizer.pad_token_id])
    return task_engine(engine, task, request.tokenizer, prompt_ids, examples)


def resolve_auto(cfg: RunConfig, precision: TrainingPrecision, stale: bool = False) -> tuple[RunConfig, dict[str, str]]:
    """``cfg`` with its ``auto`` settings resolved for this run (what its config.json records), and what each
    became and why (for the log and the manifest).

    algorithm.rollout_correction: every engine samples in the trainer's compute dtype, so the engine's
    log-probs are float32 trainer math exactly when the compute dtype is float32. ``stale``: the engine
    samples from weights older than the trainer's (async rollouts with a staleness bound above 0).
    """
    if cfg.algorithm.rollout_correction != AUTO:
        return cfg, {}
    mode, why = auto_rollout_correction(engine_differs=precision.compute != torch.float32, stale=stale)
    algorithm = cfg.algorithm.override(rollout_correction=mode)
    return cfg.model_copy(update={"algorithm": algorithm}), {"algorithm.rollout_correction": f"{mode} (auto: {why})"}


def rollout_source(
    cfg: RunConfig,
    setting: Setting,
    task: Task,
    request: EngineRequest,
    collector: RolloutCollector,
    weights: Callable[[], PolicyWeights],
) -> RolloutSource:
    """Sync rollouts from the run's engine, or with ``rollout.mode = "async"`` the same engine built in a
    process of its own (its threads taken from the run's) and a producer collecting ahead from the same prompt
    stream."""
    if cfg.rollout.mode == "sync":
        return SyncRollouts(collector)
    threads = setting.threads.threads
    engine_threads = cfg.rollout.engine_threads or max(1, threads // 2)
    torch.set_num_threads(max(1, threads - engine_threads))
    setting.reporter.line(
        f"async rollouts (max staleness {cfg.rollout.max_staleness}): engine process {engine_threads} "
        f"thread(s), learner {torch.get_num_threads()}"
    )
    with setting.reporter.phase("start the engine process"):
        process = build_engine_apart(request, engine_threads)
    engine = task_engine(process, task, request.tokenizer, collector.prompt_ids, task.train_examples())
    producer = collector.with_engine(engine)
    return AsyncRollouts(producer, process, cfg.rollout.max_staleness, cfg.steps, weights, collector.engine)


def build_parts(
    cfg: RunConfig, setting: Setting, task: Task, val_examples: list[Example], weights_dir: Path | None = None
) -> RunParts:
    """Every part of a run after its task: policy, optimizer, prompts, sync check, state, engine,
    collector, learner; ``parts.cfg`` is ``cfg`` with its ``auto`` settings resolved. ``weights_dir``: the
    checkpoint a resumed run continues from (its state is loaded by the caller, ``RunState.load``)."""
    policy = prepare_policy(cfg, setting, task, weights_dir)
    cfg, resolved = resolve_auto(
        cfg, policy.precision, stale=cfg.rollout.mode == "async" and cfg.rollout.max_staleness > 0
    )
    for name, choice in resolved.items():
        setting.reporter.line(f"{name}: {choice}")
    reward_models = RewardModels.load(task, setting.device, setting.reporter)
    teacher = None
    if cfg.algorithm.needs_teacher:  # its tokenizer is checked against the policy's before anything is written
        prompt_format = cfg.task.prompt_format()
        teacher = load_teacher(
            cfg.teacher,
            task,
            policy.tokenizer,
            prompt_format,
            policy.precision.compute,
            setting.device,
            setting.reporter,
        )
    optimizer = policy.precision.optimizer(
        policy.trainable(), lr=cfg.optim.lr, betas=cfg.optim.betas, weight_decay=cfg.optim.weight_decay
    )
    prompts = PromptStream(task.train_examples(), cfg.seed)
    prompt_ids = prompt_token_ids(cfg, task, policy.tokenizer, policy.model, task.train_examples() + val_examples)
    max_model_len = max(map(len, prompt_ids.values())) + cfg.rollout.max_new_tokens
    if reward_models is not None:
        reward_models.check_context(task, task.train_examples() + val_examples, cfg.rollout.max_new_tokens)
    # a model whose own forward the training forward cannot reproduce at these lengths: one line, now
    check_trainable(policy.model, max_model_len)
    minibatch_gen = torch.Generator().manual_seed(cfg.seed)
    compute = dtype_name(policy.precision.compute)
    sync_monitor = SyncMonitor(
        *cfg.rollout.sync_limits(compute),
        noise_multiple=cfg.rollout.sync_noise_multiple,
        min_floor=MIN_NOISE_FLOOR[compute],
        calibration_steps=cfg.rollout.sync_calibration_steps,
        warn_margin=cfg.rollout.sync_warn_margin,
        warn=setting.reporter.line,
    )
    ranks = setting.ranks
    state = RunState(optimizer, prompts, minibatch_gen, sync_monitor, ranks, policy.model, reward_models)
    request = engine_request(cfg, setting, policy, max_model_len)
    engine = rollout_engine(request, setting, task, prompt_ids, task.train_examples() + val_examples)
    collector = RolloutCollector(
        engine, task, prompts, prompt_ids, cfg.rollout, cfg.algorithm, cfg.seed, cfg.reward, ranks, reward_models
    )
    try:
        learner = PolicyLearner(
            cfg,
            TrainedModel(policy.model, optimizer, policy.precision, setting.device, policy.tokenizer.pad_token_id),
            LearnerState(state.updates, minibatch_gen, sync_monitor, state.entropy_control),
            FrozenModels(policy.reference, policy.reference_context, teacher.model if teacher is not None else None),
            ranks,
        )
        parts = RunParts(
            cfg,
            setting,
            task,
            val_examples,
            policy,
            reward_models,
            optimizer,
            prompts,
            prompt_ids,
            sync_monitor,
            state,
            collector,
            learner,
            rollout_source(cfg, setting, task, request, collector, lambda: parts.sync_source()),
            resolved,
            teacher=teacher,
        )
        state.rollouts = parts.rollouts
        if not (capabilities(cfg.rollout.engine).shares_training_model or policy.files_are_policy):
            engine.sync_weights(parts.sync_source())  # it started from files that are not the policy (a base)
    except BaseException:
        engine.close()
        raise
    if learner.sharing_note:
        setting.reporter.line(learner.sharing_note)
    return parts


def assemble(cfg: RunConfig, reporter_for: Callable[[Ranks], Reporter] | None = None) -> RunParts:
    """A run's parts with no run directory (``grpolab probe``, ``grpolab bench``); close them when done."""
    setting = set_up(cfg, reporter_for or (lambda ranks: Reporter(Console(quiet=not ranks.is_main))))
    task, val_examples = load_task(cfg, setting.reporter)
    return build_parts(cfg, setting, task, val_examples)
