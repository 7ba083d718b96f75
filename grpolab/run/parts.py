"""A run's parts, assembled in one place: task, policy and reference, optimizer, engine with its
wrappers, rollout collector, learner, run state.

``build_parts`` is the only code that puts a run together. The trainer (``grpolab.run.trainer``) adds
the run directory, the loop and the checkpoints around the parts; ``grpolab probe`` and ``grpolab bench``
build the same parts with ``assemble`` and no run directory.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable

import torch
from rich.console import Console
from torch import nn

from grpolab.common.progress import Reporter
from grpolab.common.threads import ThreadChoice, choose_threads
from grpolab.config import RunConfig
from grpolab.learning.learner import SHARDED_FORWARD, PolicyLearner
from grpolab.learning.shared_prefix import unit_logprobs
from grpolab.models.fidelity import check_trainable
from grpolab.models.gguf import GGUF_PREFIX
from grpolab.models.like import LIKE_PREFIX, is_like_dir
from grpolab.models.loading import (check_model_spec, frozen_copy, load_policy, resolve_device, resolve_dtype,
                                    resolve_model_dir)
from grpolab.models.logprobs import enable_gradient_checkpointing
from grpolab.models.lora import Adapter, AdapterWeights, MergedWeights, adapter_base, add_adapter, is_adapter_folder
from grpolab.models.precision import TrainingPrecision, resolve_precision
from grpolab.models.prompt_tokens import tokenize_prompts
from grpolab.models.routing import routers
from grpolab.parallel.fsdp import FullWeights, shard_fsdp
from grpolab.parallel.ranks import Ranks, init_from_env
from grpolab.rollout.base import RolloutEngine
from grpolab.rollout.collect import RolloutCollector
from grpolab.rollout.engines import build_engine, dtype_name
from grpolab.rollout.lockstep import LockstepEngine
from grpolab.rollout.multiturn import MultiTurnEngine
from grpolab.rollout.reward_models import RewardModels
from grpolab.rollout.sync_check import MIN_NOISE_FLOOR, SyncMonitor
from grpolab.run.checkpoints import is_checkpoint, verify
from grpolab.run.state import RunState
from grpolab.tasks import build_task
from grpolab.tasks.base import Example, Task
from grpolab.tasks.stream import PromptStream
from grpolab.tools.protocol import Toolset

FSDP_TOOLS = ("dist.strategy 'fsdp' with rollout.engine 'hf' cannot use tools (every rank must take the same number "
              "of generation steps on the sharded model); use rollout.engine 'vllm' or dist.strategy 'ddp'")


@dataclass
class Setting:
    """Where a run's parts live: its ranks, this rank's device and CPU threads, and where it reports."""

    ranks: Ranks
    device: torch.device
    threads: ThreadChoice
    reporter: Reporter


@dataclass
class Models:
    """The policy, its tokenizer, the frozen reference (None without one) and the precision they follow;
    with LoRA the policy's adapter, and the reference is the policy within ``reference_context``
    (its adapter off)."""

    model_dir: Path
    precision: TrainingPrecision
    model: nn.Module
    tokenizer: Any
    reference: nn.Module | None
    adapter: Adapter | None = None
    reference_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    started_from: Path | None = None  # a LoRA checkpoint whose adapter this run started from

    @property
    def saved(self):
        """What a checkpoint saves with ``save_pretrained``: the model, or its adapter in peft's format with the
        record of its base."""
        return self.adapter if self.adapter is not None else self.model

    def saved_state(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The ``state_dict`` that ``saved.save_pretrained`` takes, from the policy's gathered ``weights``."""
        return self.adapter.peft_state(weights) if self.adapter is not None else weights

    def trainable(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]


@dataclass
class RunParts:
    """Everything one run is made of. The trainer never asks which algorithm, task or engine these are."""

    cfg: RunConfig
    setting: Setting
    task: Task
    val_examples: list[Example]
    models: Models
    reward_models: RewardModels | None
    optimizer: torch.optim.Optimizer
    prompts: PromptStream
    prompt_ids: dict[str, list[int]]
    sync_monitor: SyncMonitor
    state: RunState
    collector: RolloutCollector
    learner: PolicyLearner
    closed: bool = False

    # the parts most code reads, by name
    spec = property(lambda self: self.cfg.algorithm)
    ranks = property(lambda self: self.setting.ranks)
    device = property(lambda self: self.setting.device)
    model = property(lambda self: self.models.model)
    tokenizer = property(lambda self: self.models.tokenizer)
    reference = property(lambda self: self.models.reference)
    precision = property(lambda self: self.models.precision)
    model_dir = property(lambda self: self.models.model_dir)

    @property
    def engine(self) -> RolloutEngine:
        return self.collector.engine

    @property
    def sharded(self) -> bool:
        return is_sharded_run(self.cfg, self.ranks)

    @property
    def toolset(self) -> Toolset | None:
        return self.task.toolset

    def sync_source(self):
        """What the engine's weight sync reads: the model itself for the hf engine; for an engine of its own
        (vLLM) under FSDP the whole weights, gathered on every rank (every rank calls this), and with LoRA
        the merged weights (with ``rollout.vllm.lora_sync = "adapter"`` the adapter alone)."""
        if self.cfg.rollout.engine == "hf":
            return self.model
        if self.models.adapter is not None and self.cfg.rollout.vllm.lora_sync == "adapter":
            return AdapterWeights(self.models.adapter)
        if self.models.adapter is not None:
            return MergedWeights(self.model)
        return FullWeights(self.model) if self.sharded else self.model

    def close(self) -> None:
        """Close the engine (its processes, its memory); the other parts stay readable. Safe to call twice."""
        if not self.closed:
            self.closed = True
            self.engine.close()


def is_sharded_run(cfg: RunConfig, ranks: Ranks) -> bool:
    return ranks.parallel and cfg.dist.strategy == "fsdp"


def set_up(cfg: RunConfig, reporter_for: Callable[[Ranks], Reporter]) -> Setting:
    """Join the ranks torchrun describes (if any), seed torch, choose the CPU threads. Prints nothing."""
    ranks, device = init_from_env(resolve_device(cfg.model.device), cfg.dist.timeout_minutes)
    if cfg.rollout.prompts_per_step % ranks.world:
        raise ValueError(f"rollout.prompts_per_step {cfg.rollout.prompts_per_step} cannot be split into whole "
                         f"prompt groups over {ranks.world} ranks")
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
            raise ValueError(f"eval.n_examples {wanted} > the {len(examples)} validation examples of task "
                             f"{task.name!r}")
    return task, examples[:wanted]


def load_models(cfg: RunConfig, setting: Setting, task: Task, weights_dir: Path | None = None) -> Models:
    """The policy (from ``weights_dir``, a checkpoint to resume, else the model's start) with its
    tokenizer, and the frozen reference (the start policy) when the objective needs one; under FSDP
    both sharded before the optimizer is made."""
    ranks, reporter, device = setting.ranks, setting.reporter, setting.device
    if is_sharded_run(cfg, ranks) and cfg.rollout.engine == "hf" and task.toolset is not None:
        raise ValueError(FSDP_TOOLS)
    start = _checkpoint_path(cfg.model.path)
    if start is not None:  # another run's checkpoint (a suite's init_from): every file it lists checks out first
        ranks.run_on_main(lambda: verify(start))
    check_model_spec(cfg.model.path)
    reporter.line(setting.threads.note)
    if ranks.parallel:
        reporter.line(f"data parallel: {ranks.world} ranks ({cfg.dist.strategy}), "
                      f"{cfg.rollout.prompts_per_step // ranks.world} prompt groups each per step")
    # rank 0 first: a warm start of the demo's model is cached, and the other ranks then find it
    resolve = partial(resolve_model_dir, cfg.model.path, task, cfg.model.like_overrides,
                      warm_start=cfg.model.warm_start)
    model_dir = ranks.run_on_main(lambda: resolve(reporter=reporter))
    if not ranks.is_main:
        model_dir = resolve()
    if is_like_dir(model_dir):
        reporter.line(f"{cfg.model.path}: random weights at the real shapes (for memory and speed): "
                      "completions rarely stop and run to max_new_tokens")
    precision = resolve_precision(cfg.optim.precision, resolve_dtype(cfg.model.dtype, device))
    lora, started_from = cfg.model.lora, None
    if is_adapter_folder(model_dir):  # another LoRA run's checkpoint (a suite's init_from): its base, its adapter
        started_from, model_dir = model_dir, adapter_base(model_dir)
        if lora is None:
            raise ValueError(f"model.path {started_from} is a LoRA checkpoint: set [model.lora] (its rank and "
                             "targets) to continue its adapter, or `grpolab export` it into a full model first")
        if cfg.needs_reference():
            raise ValueError(f"model.path {started_from} is a LoRA checkpoint: its adapter switched off is its "
                             "base, not this run's start policy, so a KL term or frozen reference cannot start from it")
    weights_dir = weights_dir or model_dir
    with reporter.phase(f"load model {weights_dir}") as phase:
        model, tokenizer, adapter = _policy(cfg, model_dir, weights_dir, started_from, precision, device,
                                            is_sharded_run(cfg, ranks))
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        phase.info = (f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters on {device}"
                      + (f", {trainable / 1e6:.2f}M of them trained (LoRA rank {lora.rank})" if lora else ""))
    if cfg.model.router_aux_loss_coef and not routers(model):
        raise ValueError(f"model.router_aux_loss_coef needs a Mixture-of-Experts model; {model_dir} has no routers")
    task.bind_tokenizer(tokenizer)  # chat-template prompts render with the model's own tokenizer
    if cfg.model.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    model.eval()
    reference, reference_context = None, contextlib.nullcontext
    if cfg.needs_reference() and adapter is not None:  # the start policy: the base, the adapter off
        reference, reference_context = model, adapter.disabled
    elif cfg.needs_reference():  # the start policy, frozen, so kept in the compute dtype (no master copy needed)
        start = load_policy(model_dir, precision.storage, device)[0] if weights_dir != model_dir else model
        reference = frozen_copy(start).to(precision.compute)
    if is_sharded_run(cfg, ranks):  # before the optimizer: it must hold the shards
        for m in {id(m): m for m in (model, reference) if m is not None}.values():  # with LoRA one model
            shard_fsdp(m, {SHARDED_FORWARD: unit_logprobs})
    return Models(model_dir, precision, model, tokenizer, reference, adapter, reference_context, started_from)


def _checkpoint_path(path: str | None) -> Path | None:
    """``model.path`` when it names a folder a grpolab run wrote as a checkpoint, else None."""
    if not path or path.startswith((LIKE_PREFIX, GGUF_PREFIX)):
        return None
    folder = Path(path).expanduser()
    return folder if folder.is_dir() and is_checkpoint(folder) else None


def _policy(cfg: RunConfig, model_dir: Path, weights_dir: Path, started_from: Path | None,
            precision: TrainingPrecision, device: torch.device, sharded: bool) -> tuple[nn.Module, Any, Adapter | None]:
    """(policy, tokenizer, adapter): the model in ``weights_dir``; with LoRA the base in ``model_dir`` (a
    checkpoint holds only the adapter) with its adapter: fresh from the run's seed, or the adapter of the
    checkpoint resumed (``weights_dir``) or started from (``started_from``). The adapter is float32 (peft
    casts it); the base, which never changes, is kept in the compute dtype (no master copy to round into),
    except under FSDP, whose units gather one dtype."""
    lora = cfg.model.lora
    if lora is None:
        model, tokenizer = load_policy(weights_dir, precision.storage, device)
        return model, tokenizer, None
    model, tokenizer = load_policy(model_dir, precision.storage if sharded else precision.compute, device)
    adapter = add_adapter(model, lora, cfg.seed, model_dir)
    if weights_dir != model_dir or started_from is not None:
        adapter.load(weights_dir if weights_dir != model_dir else started_from)
    return adapter.model, tokenizer, adapter


def prompt_token_ids(cfg: RunConfig, task: Task, tokenizer, model: nn.Module,
                     examples: list[Example]) -> dict[str, list[int]]:
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
        raise ValueError(f"{len(too_long)} prompts are longer than {limit} tokens (rollout.max_prompt_tokens, "
                         f"or the model's context minus rollout.max_new_tokens); never truncated. Example ids: "
                         f"{', '.join(too_long[:20])}{' ...' if len(too_long) > 20 else ''}")
    return {e.id: p for e, p in zip(examples, ids)}


def rollout_engine(cfg: RunConfig, setting: Setting, task: Task, models: Models, weights_dir: Path,
                   max_model_len: int) -> RolloutEngine:
    """The engine the config names, with the wrappers the run needs: lock-step decoding over FSDP
    ranks, multi-turn tool use (observations masked out of the loss)."""
    sharded = is_sharded_run(cfg, setting.ranks)
    with setting.reporter.phase(f"start {cfg.rollout.engine} engine", done_note=cfg.rollout.engine != "hf" or None):
        adapter_rank = cfg.model.lora.rank if cfg.rollout.vllm.lora_sync == "adapter" else None
        engine = build_engine(cfg.rollout, models.model, models.tokenizer, weights_dir, seed=cfg.seed,
                              max_model_len=max_model_len, precision=models.precision, sharded=sharded,
                              adapter_rank=adapter_rank)
        if sharded and cfg.rollout.engine == "hf":  # it generates with the sharded model
            engine = LockstepEngine(engine, setting.ranks, filler=[models.tokenizer.pad_token_id])
    toolset = task.toolset
    if toolset is not None:
        engine = MultiTurnEngine(engine, toolset, models.tokenizer)
    return engine


def build_parts(cfg: RunConfig, setting: Setting, task: Task, val_examples: list[Example],
                weights_dir: Path | None = None) -> RunParts:
    """Every part of a run after its task: models, optimizer, prompts, sync check, state, engine,
    collector, learner. ``weights_dir``: the checkpoint a resumed run continues from (its state is
    loaded by the caller, ``RunState.load``)."""
    models = load_models(cfg, setting, task, weights_dir)
    reward_models = RewardModels.load(task, setting.device, setting.reporter)
    optimizer = models.precision.optimizer(models.trainable(), lr=cfg.optim.lr, betas=cfg.optim.betas,
                                           weight_decay=cfg.optim.weight_decay)
    prompts = PromptStream(task.train_examples(), cfg.seed)
    prompt_ids = prompt_token_ids(cfg, task, models.tokenizer, models.model, task.train_examples() + val_examples)
    max_model_len = max(map(len, prompt_ids.values())) + cfg.rollout.max_new_tokens
    if reward_models is not None:
        reward_models.check_context(task, task.train_examples() + val_examples, cfg.rollout.max_new_tokens)
    # a model whose own forward the training forward cannot reproduce at these lengths: one line, now
    check_trainable(models.model, max_model_len)
    minibatch_gen = torch.Generator().manual_seed(cfg.seed)
    compute = dtype_name(models.precision.compute)
    sync_monitor = SyncMonitor(*cfg.rollout.sync_limits(compute), noise_multiple=cfg.rollout.sync_noise_multiple,
                               min_floor=MIN_NOISE_FLOOR[compute], calibration_steps=cfg.rollout.sync_calibration_steps,
                               warn_margin=cfg.rollout.sync_warn_margin, warn=setting.reporter.line)
    ranks = setting.ranks
    state = RunState(optimizer, prompts, minibatch_gen, sync_monitor, ranks, models.model, reward_models)
    # an engine of its own starts from weight files: with LoRA the base's, then the merged policy's
    start_dir = models.model_dir if models.adapter is not None else weights_dir or models.model_dir
    engine = rollout_engine(cfg, setting, task, models, start_dir, max_model_len)
    collector = RolloutCollector(engine, task, prompts, prompt_ids, cfg.rollout, cfg.algorithm, cfg.seed, cfg.reward,
                                 ranks, reward_models)
    try:
        learner = PolicyLearner(cfg, models.model, models.reference, optimizer, models.precision, setting.device,
                                models.tokenizer.pad_token_id, minibatch_gen, sync_monitor, state.updates, ranks,
                                reference_context=models.reference_context)
        parts = RunParts(cfg, setting, task, val_examples, models, reward_models, optimizer, prompts, prompt_ids, sync_monitor,
                         state, collector, learner)
        if models.adapter is not None and cfg.rollout.engine != "hf":  # it started from the base's files
            engine.sync_weights(parts.sync_source())
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
