"""The RL loop, top to bottom: rollout -> reward -> group advantage -> update -> sync.

The trainer reads an ``AlgorithmSpec``'s fields (advantage, schedule, dynamic sampling); it never
looks at an algorithm's name.
"""

from __future__ import annotations

import platform
import sys
import time
from pathlib import Path
from statistics import mean
from typing import Any, Callable

import torch
import transformers
from rich.console import Console
from rich.table import Table

import grpolab
from grpolab.config import RunConfig
from grpolab.collect import RolloutCollector
from grpolab.distributed import end_process_group, init_from_env
from grpolab.evaluation import evaluate
from grpolab.like import is_like_dir
from grpolab.learn import SHARDED_FORWARD, PolicyLearner
from grpolab.logprobs import enable_gradient_checkpointing
from grpolab.model_fidelity import check_trainable
from grpolab.models import (
    check_model_spec,
    frozen_copy,
    load_policy,
    model_record,
    resolve_device,
    resolve_dtype,
    resolve_model_dir,
)
from grpolab.precision import resolve_precision
from grpolab.progress import Reporter, format_seconds
from grpolab.prompt_tokens import tokenize_prompts
from grpolab.rollout.base import RolloutEngine
from grpolab.rollout.lockstep import LockstepEngine
from grpolab.rollout.select import build_engine, dtype_name
from grpolab.rollout.sync_check import MIN_NOISE_FLOOR, SyncMonitor
from grpolab.run_state import STATE_FILE, PromptStream, RunState
from grpolab.stop import RunStopped, StopRequest
from grpolab.checkpoints import prune, remove_temp_folders, save_checkpoint, set_aside
from grpolab.resume import ResumePlan, check_data, plan_resume
from grpolab.run_journal import RunJournal
from grpolab.run_lock import LOCK_FILE, RunLock
from grpolab.rundir import (
    MetricsLog,
    RunDirError,
    resolve_run_dir,
    rewind_metrics,
    summary_writer,
    write_eval_records,
    write_json,
)
from grpolab.shaping import SHAPING_TERMS
from grpolab.sharding import FullWeights, full_state_dict, shard_fsdp
from grpolab.shared_prefix import unit_logprobs
from grpolab.tasks import build_task
from grpolab.tasks.base import Example, Grade
from grpolab.threads import choose_threads
from grpolab.tools.multiturn import MultiTurnEngine, tool_metrics


FSDP_TOOLS = ("dist.strategy 'fsdp' with rollout.engine 'hf' cannot use tools (every rank must take the same number "
              "of generation steps on the sharded model); use rollout.engine 'vllm' or dist.strategy 'ddp'")


def vital_signs(record: dict[str, Any], steps: int, seconds_left: float) -> str:
    """One log line of a step's vital signs (KL only when a reference exists, grad norm only when
    an optimizer step ran, tool calls only with tools)."""
    def num(key: str, fmt: str) -> str:
        value = record.get(key)
        return "-" if value is None else format(value, fmt)

    parts = [f"step {record['step']}/{steps}", f"reward {num('reward_mean', '.3f')}", f"acc {num('accuracy', '.3f')}",
             f"adv_std {num('advantage_std', '.3f')}"]
    if "kl_ref" in record:
        parts.append(f"kl {num('kl_ref', '.4f')}")
    clip = record.get("clip_low_frac", 0.0) + record.get("clip_high_frac", 0.0)
    parts += [f"clip {clip:.3f}", f"ratio {num('ratio_mean', '.3f')}", f"len {num('completion_len_mean', '.1f')}",
              f"trunc {num('truncation_rate', '.2f')}", f"gnorm {num('grad_norm', '.3f')}",
              f"{record['time/step']:.1f} s/step", f"~{format_seconds(seconds_left)} left"]
    if "tool/call_rate" in record:
        parts.insert(-3, f"tool calls {record['tool/call_rate']:.2f} (errors {record['tool/errors']})")
    failed = sum(v for k, v in record.items() if k.startswith("reward/") and k.endswith("_failed"))
    if failed:
        parts.insert(-2, f"reward failures {failed}")
    return "  ".join(parts)


def reward_components(grades: list[Grade]) -> dict[str, float]:
    """``reward/<name>``: the mean unweighted value of each named reward term (a task's reward functions,
    length shaping), and ``reward/<name>_failed``: how many samples that term failed on (scored 0)."""
    values: dict[str, list[float]] = {}
    failed: dict[str, int] = {}
    for grade in grades:
        for name, value in grade.components:
            values.setdefault(name, []).append(value)
        for name in grade.failed:
            failed[name] = failed.get(name, 0) + 1
    out = {f"reward/{name}": mean(v) for name, v in values.items()}
    for name in {*failed, *(n for n in values if n not in SHAPING_TERMS)}:
        out[f"reward/{name}_failed"] = failed.get(name, 0)
    return out


class Trainer:
    """Owns the model, engine, optimizer and run directory of one run."""

    def __init__(self, cfg: RunConfig, console: Console | None = None, resume: bool = False):
        """A new run into ``cfg.output_dir`` (new or empty), or with ``resume`` the continuation of the run
        in that directory from its newest complete checkpoint (weights, optimizer, RNGs, data position).
        The run directory's lock is held from the first write (a resume: from the first check) to
        ``close``: one trainer per run directory.

        Under ``torchrun`` every rank builds its own trainer: rank 0 alone prints, writes files and holds
        the lock, and every rank takes the same decisions (``grpolab.distributed``)."""
        self.lock: RunLock | None = None
        self.collector: RolloutCollector | None = None
        self.log: MetricsLog | None = None  # rank 0's
        self.journal: RunJournal | None = None  # rank 0's
        self.plan: ResumePlan | None = None
        try:
            self._set_up(cfg, console, resume)
        except BaseException:
            self.close()
            raise

    def _set_up(self, cfg: RunConfig, console: Console | None, resume: bool) -> None:
        self.cfg, self.spec = cfg, cfg.algorithm
        self.ranks, self.device = init_from_env(resolve_device(cfg.model.device), cfg.dist.timeout_minutes)
        if cfg.rollout.prompts_per_step % self.ranks.world:
            raise ValueError(f"rollout.prompts_per_step {cfg.rollout.prompts_per_step} cannot be split into whole "
                             f"prompt groups over {self.ranks.world} ranks")
        self.sharded = self.ranks.parallel and cfg.dist.strategy == "fsdp"
        self.console = (console or Console()) if self.ranks.is_main else Console(quiet=True)
        self.reporter = Reporter(self.console)
        torch.manual_seed(cfg.seed)
        self.threads = choose_threads(cfg.threads)
        torch.set_num_threads(self.threads.threads)
        # bad input is refused before anything is printed: one error line (every rank raises rank 0's error)
        self.run_dir, self.resumed_from = self.ranks.run_on_main(lambda: self._run_dir(resume))
        if cfg.log.tensorboard:
            summary_writer()
        with self.reporter.phase(f"load task {cfg.task.name}", done_note=None):
            self.task = build_task(cfg.task)
            self.val_examples = self._validation_examples()
        fingerprint = getattr(self.task, "data_fingerprint", None)
        if resume:
            self.ranks.run_on_main(lambda: check_data(self.plan.journal, fingerprint() if fingerprint else None))
        if self.sharded and cfg.rollout.engine == "hf" and getattr(self.task, "toolset", None) is not None:
            raise ValueError(FSDP_TOOLS)
        check_model_spec(cfg.model.path)
        self.reporter.line(self.threads.note)
        if self.ranks.parallel:
            self.reporter.line(f"data parallel: {self.ranks.world} ranks ({cfg.dist.strategy}), "
                               f"{cfg.rollout.prompts_per_step // self.ranks.world} prompt groups each per step")
        # rank 0 first: a warm start of the demo's model is cached, and the other ranks then find it
        self.model_dir = self.ranks.run_on_main(lambda: resolve_model_dir(cfg.model.path, self.task,
                                                                          cfg.model.like_overrides, self.reporter))
        if not self.ranks.is_main:
            self.model_dir = resolve_model_dir(cfg.model.path, self.task, cfg.model.like_overrides)
        if is_like_dir(self.model_dir):
            self.reporter.line(f"{cfg.model.path}: random weights at the real shapes (for memory and speed): "
                               "completions rarely stop and run to max_new_tokens")
        self.precision = resolve_precision(cfg.optim.precision, resolve_dtype(cfg.model.dtype, self.device))
        weights_dir = self.resumed_from or self.model_dir
        with self.reporter.phase(f"load model {weights_dir}") as phase:
            self.model, self.tokenizer = load_policy(weights_dir, self.precision.storage, self.device)
            phase.info = f"{sum(p.numel() for p in self.model.parameters()) / 1e6:.1f}M parameters on {self.device}"
        bind_tokenizer = getattr(self.task, "bind_tokenizer", None)
        if bind_tokenizer is not None:  # chat-template prompts render with the model's own tokenizer
            bind_tokenizer(self.tokenizer)
        if cfg.model.gradient_checkpointing:
            enable_gradient_checkpointing(self.model)
        self.model.eval()
        # the start policy, frozen, so kept in the compute dtype (no master copy needed)
        self.reference = None
        if cfg.needs_reference():
            start = load_policy(self.model_dir, self.precision.storage, self.device)[0] if resume else self.model
            self.reference = frozen_copy(start).to(self.precision.compute)
        if self.sharded:  # before the optimizer: it must hold the shards
            for model in filter(None, (self.model, self.reference)):
                shard_fsdp(model, {SHARDED_FORWARD: unit_logprobs})
        self.optimizer = self.precision.optimizer(self.model.parameters(), lr=cfg.optim.lr, betas=cfg.optim.betas,
                                                  weight_decay=cfg.optim.weight_decay)
        self.prompts = PromptStream(self.task.train_examples(), cfg.seed)
        self.prompt_ids = self._tokenize_prompts(self.task.train_examples() + self.val_examples)
        # a model whose own forward the training forward cannot reproduce at these lengths: one line, now
        check_trainable(self.model, max(map(len, self.prompt_ids.values())) + cfg.rollout.max_new_tokens)
        minibatch_gen = torch.Generator().manual_seed(cfg.seed)
        compute = dtype_name(self.precision.compute)
        self.sync_monitor = SyncMonitor(*cfg.rollout.sync_limits(compute), noise_multiple=cfg.rollout.sync_noise_multiple,
                                        min_floor=MIN_NOISE_FLOOR[compute])
        self.state = RunState(self.optimizer, self.prompts, minibatch_gen, self.sync_monitor, self.ranks, self.model)
        self.updates = self.state.updates
        with self.reporter.phase(f"start {cfg.rollout.engine} engine", done_note=cfg.rollout.engine != "hf" or None):
            engine = build_engine(cfg.rollout, self.model, self.tokenizer, weights_dir, seed=cfg.seed,
                                  max_model_len=max(map(len, self.prompt_ids.values())) + cfg.rollout.max_new_tokens,
                                  precision=self.precision, sharded=self.sharded)
            if self.sharded and cfg.rollout.engine == "hf":  # it generates with the sharded model
                engine = LockstepEngine(engine, self.ranks, filler=[self.tokenizer.pad_token_id])
        self.toolset = getattr(self.task, "toolset", None)
        if self.toolset is not None:  # tool-using trajectories, observations masked out of the loss
            engine = MultiTurnEngine(engine, self.toolset, self.tokenizer)
        self.collector = RolloutCollector(engine, self.task, self.prompts, self.prompt_ids, cfg.rollout, self.spec, cfg.seed,
                                          cfg.reward, self.ranks)
        self.learner = PolicyLearner(cfg, self.model, self.reference, self.optimizer, self.precision, self.device,
                                     self.tokenizer.pad_token_id, minibatch_gen, self.sync_monitor, self.updates,
                                     self.ranks)
        if self.learner.sharing_note:
            self.reporter.line(self.learner.sharing_note)
        if resume:
            self.state.load(self.resumed_from)
        # the metrics of the steps before a resume
        self.records: list[dict[str, Any]] = self.ranks.run_on_main(lambda: self._prepare_run_dir(resume))
        if self.ranks.is_main:
            self.log = MetricsLog(self.run_dir / "metrics.jsonl",
                                  self.run_dir / "tensorboard" if cfg.log.tensorboard else None,
                                  first_step=self.state.step + 1 if resume else 0)

    @property
    def engine(self) -> RolloutEngine:
        return self.collector.engine

    def _run_dir(self, resume: bool) -> tuple[Path, Path | None]:
        """(run directory, checkpoint resumed from). A new run refuses a used directory; a resume takes the
        run's lock, then every check of ``plan_resume`` (nothing on disk moves yet)."""
        if not resume:
            return resolve_run_dir(self.cfg.output_dir, self.spec.name), None
        run_dir = Path(self.cfg.output_dir or "")
        if (run_dir / "config.json").is_file():
            self.lock = RunLock(run_dir).acquire()
        self.plan = plan_resume(self.cfg, on_check=lambda folder: self.reporter.line(f"verify checkpoint {folder}"))
        for folder, why in self.plan.damaged:
            self.reporter.line(f"checkpoint {folder.name} is damaged ({why}): set aside into checkpoints/damaged/; "
                               f"continuing from {self.plan.checkpoint.name}")
        return run_dir, self.plan.checkpoint

    def _prepare_run_dir(self, resume: bool) -> list[dict[str, Any]]:
        """Create the run directory (only once everything validated), lock it, write its config and
        manifest; or for a resume remove interrupted checkpoint writes, set damaged checkpoints aside,
        rewind the metrics to the checkpoint's step and record the resume. Returns the records kept."""
        if not resume:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self.lock = RunLock(self.run_dir).acquire()
            if any(p.name != LOCK_FILE for p in self.run_dir.iterdir()):
                raise RunDirError(f"output directory {self.run_dir} was filled by another process meanwhile")
            self.journal = RunJournal.create(self.run_dir, self.cfg.model_dump(mode="json"), self._manifest_record())
            return []
        plan, self.journal = self.plan, self.plan.journal
        removed = remove_temp_folders(self.run_dir)
        for folder, _ in plan.damaged:
            set_aside(folder)
        records = rewind_metrics(self.run_dir / "metrics.jsonl", plan.step, session=plan.journal.session_number + 1)
        plan.journal.record_resume(plan.checkpoint, plan.step, plan.changes, plan.damaged, removed)
        return records

    # ---- set-up helpers -------------------------------------------------------------------
    def _validation_examples(self) -> list[Example]:
        examples, wanted = self.task.validation_examples(), self.cfg.eval.n_examples
        if wanted is not None and wanted > len(examples):
            raise ValueError(f"eval.n_examples {wanted} > the {len(examples)} validation examples of task "
                             f"{self.task.name!r}")
        return examples[:wanted]

    def _tokenize_prompts(self, examples: list[Example]) -> dict[str, list[int]]:
        """Prompt token ids by example id, with the tokenizer's BOS once (``grpolab.prompt_tokens``). Refuses
        (listing example ids) prompts longer than rollout.max_prompt_tokens or leaving no room for
        max_new_tokens in the model's context."""
        ids = tokenize_prompts(self.tokenizer, [self.task.prompt(e) for e in examples])
        limit = self.cfg.rollout.max_prompt_tokens or float("inf")
        context = getattr(self.model.config, "max_position_embeddings", None)
        if context:
            limit = min(limit, context - self.cfg.rollout.max_new_tokens)
        too_long = [e.id for e, p in zip(examples, ids) if len(p) > limit]
        if too_long:
            raise ValueError(f"{len(too_long)} prompts are longer than {limit} tokens (rollout.max_prompt_tokens, "
                             f"or the model's context minus rollout.max_new_tokens); never truncated. Example ids: "
                             f"{', '.join(too_long[:20])}{' ...' if len(too_long) > 20 else ''}")
        return {e.id: p for e, p in zip(examples, ids)}

    def _manifest_record(self) -> dict[str, Any]:
        """What manifest.json records about a new run's start (``RunJournal`` adds the config and sessions)."""
        fingerprint = getattr(self.task, "data_fingerprint", None)
        return {
            "grpolab": grpolab.__version__, "grpolab_source": str(Path(grpolab.__file__).resolve().parent),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "command": sys.argv, "device": str(self.device),
            "ranks": {"world": self.ranks.world, "strategy": self.cfg.dist.strategy},
            "cpu": {"threads": self.threads.threads, "cores": self.threads.cores, "busy_at_start": self.threads.busy},
            "model": model_record(self.model, self.model_dir), "task": self.task.name,
            # a start from another run's checkpoint: its weights only, with a fresh optimizer and this seed
            "warm_start_from": str(self.model_dir) if (self.model_dir / STATE_FILE).is_file() else None,
            "data": fingerprint() if fingerprint else None, "train_examples": len(self.task.train_examples()),
            "val_examples": len(self.val_examples), "algorithm": self.spec.model_dump(),
            "precision": {"setting": self.precision.name, "weights": dtype_name(self.precision.storage),
                          "compute": dtype_name(self.precision.compute)},
            "rollout_engine": self._engine_record(),
        }

    def _engine_record(self) -> dict[str, Any]:
        r = self.cfg.rollout
        record: dict[str, Any] = {"engine": r.engine}
        if r.engine == "vllm":
            record["python"] = r.vllm.python or sys.executable
            if r.vllm.python is None:
                import vllm

                record["vllm"] = vllm.__version__
        return record

    # ---- evaluation, the loop, the summary ------------------------------------------------
    def evaluate(self, step: int) -> dict[str, float]:
        """Every validation item (each rank its share, gathered); rank 0 writes the records."""
        started, chunk = time.perf_counter(), self.cfg.rollout.max_batch_size
        mine = len(self.ranks.share_chunks(len(self.val_examples), chunk))
        with self.reporter.phase(f"eval step {step}", total=mine, unit="items") as phase:
            out, records = evaluate(self.engine, self.task, self.val_examples, [self.prompt_ids[e.id] for e in self.val_examples],
                                    self.collector.sampling_params(0, 0), self.cfg.eval.pass_k, self.cfg.eval.pass_n,
                                    seed=self.cfg.seed + 7, chunk=chunk, on_items=phase.advance, ranks=self.ranks)
            phase.info = "  ".join(f"{k.removeprefix('val/')} {v:.3f}" for k, v in out.items())
        out["time/eval"] = time.perf_counter() - started
        if self.ranks.is_main:
            write_eval_records(self.run_dir, step, records)
            self.log.write({"step": step, **out})
        return out

    def run(self, stop: StopRequest | None = None) -> dict[str, Any]:
        """Steps from the state's step + 1 to ``cfg.steps``; with ``stop``, a requested stop ends the run
        after the current step with a resumable checkpoint (``RunStopped``)."""
        cfg, started, first = self.cfg, time.perf_counter(), self.state.step + 1
        stop = stop or StopRequest()
        resumed = f" (resumed after step {first - 1})" if first > 1 else ""
        self.reporter.line(f"{self.spec.name} on {self.task.name}, {cfg.steps} steps{resumed} -> run dir {self.run_dir}")
        evals = {r["step"]: r for r in self.records if "val/accuracy" in r} if first > 1 else {0: self.evaluate(0)}
        rewards = [r["reward_mean"] for r in self.records if "reward_mean" in r]
        log_every = cfg.log_every or (1 if self.reporter.plain else None)
        with self.reporter.phase("train", total=cfg.steps, unit="steps", done_note=False, done=first - 1) as bar:
            # vLLM's engine processes share the terminal's process group and die of the same Ctrl-C, so a
            # graceful stop could wait on a dead engine: with vLLM a signal still stops the run at once
            # under torchrun a signal ends every rank at once (resume from the last checkpoint)
            stop.armed = cfg.rollout.engine == "hf" and not self.ranks.parallel
            for step in range(first, cfg.steps + 1):
                record = self.train_step(step, bar.set_status)
                self.state.step = step
                rewards.append(record["reward_mean"])
                if log_every and (step % log_every == 0 or step == cfg.steps):
                    left = bar.elapsed() / (step - first + 1) * (cfg.steps - step)
                    self.reporter.line(vital_signs(record, cfg.steps, left))
                if step % cfg.eval.every == 0 or step == cfg.steps:
                    bar.set_status("evaluate")
                    evals[step] = self.evaluate(step)
                if step % cfg.checkpoint.every == 0 or step == cfg.steps or stop.requested:
                    bar.set_status("checkpoint")
                    with self.reporter.phase(f"checkpoint step {step}") as phase:
                        phase.info = self.save_checkpoint(step)
                if self.journal is not None:
                    self.journal.tick(step, time.perf_counter() - started)
                bar.set_status("")
                bar.advance(info=f"reward {record['reward_mean']:.3f}, val acc {evals[max(evals)]['val/accuracy']:.3f}")
                if stop.requested and step < cfg.steps:
                    raise RunStopped(f"stopped after step {step} with a checkpoint; continue with: "
                                     f"grpolab train --resume {self.run_dir}")
            stop.armed = False
        seconds = self.journal.total_seconds() if self.journal is not None else time.perf_counter() - started
        return self._summarize(evals, rewards, seconds)

    def save_checkpoint(self, step: int) -> str:
        """Rank 0 writes the checkpoint of ``step`` (whole weights, every rank's RNGs in its state) and, with
        checkpoint.keep_last, removes the oldest once it verifies; the others gather what it needs and
        wait for it. Returns what was done, for the progress line."""
        weights = full_state_dict(self.model) if self.sharded else None
        state = self.state.state_dict()

        def write() -> str:
            folder = save_checkpoint(self.model, self.tokenizer, self.run_dir, step,
                                     lambda tmp: RunState.save(state, tmp), weights)
            keep = self.cfg.checkpoint.keep_last
            removed = prune(self.run_dir, keep, (STATE_FILE,)) if keep else []
            return str(folder) + (f"; removed {', '.join(p.name for p in removed)} (keep_last {keep})" if removed else "")

        return self.ranks.run_on_main(write)

    def sync_source(self):
        """What the engine's weight sync reads: the model, or under FSDP with an engine of its own (vLLM) the
        whole weights, gathered on every rank (every rank calls this)."""
        return FullWeights(self.model) if self.sharded and self.cfg.rollout.engine != "hf" else self.model

    def train_step(self, step: int, status: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
        """One rollout batch: rollout -> reward -> advantage -> update -> sync; logs and returns its metrics.
        ``status`` hears the phase it enters (generate, update, sync)."""
        t0 = time.perf_counter()
        status("generate")
        rollout = self.collector.collect(step)          # 1. rollout + 2. reward
        t1 = time.perf_counter()
        status("update")
        metrics = self.learner.learn(rollout)           # 3. group advantages + 4. policy update
        t2 = time.perf_counter()
        status("sync")
        self.engine.sync_weights(self.sync_source())    # 5. sync the new weights to the engine
        t3 = time.perf_counter()
        flat = rollout.flat()
        grades = [g for group in rollout.grades for g in group]
        tokens = sum(len(c.completion_ids) for c in flat)
        record = {
            "step": step, **metrics,
            "accuracy": mean(g.answer_reward for g in grades), "format_rate": mean(g.format_reward for g in grades),
            "response_tokens": tokens, "completion_len_mean": tokens / len(flat), "truncation_rate": mean(c.truncated for c in flat),
            "rollout_rounds": rollout.rounds, "total_attempted_updates": self.updates["attempted"],
            "total_actual_updates": self.updates["actual"],
            "time/generate": rollout.seconds["generate"], "time/reward": rollout.seconds["reward"],
            "time/train": t2 - t1, "time/sync": t3 - t2, "time/step": t3 - t0,
            "tokens_per_s": tokens / rollout.seconds["generate"], **reward_components(grades),
        }
        if self.toolset is not None:
            record.update(tool_metrics(flat, [g.answer_reward > 0 for g in grades]))
        if self.log is not None:
            self.log.write(record)
        return record

    def _summarize(self, evals: dict[int, dict[str, float]], rewards: list[float], seconds: float) -> dict[str, Any]:
        first, last = evals[0], evals[max(evals)]
        window = max(1, len(rewards) // 10)
        summary = {
            "algorithm": self.spec.name, "run_dir": str(self.run_dir), "steps": self.cfg.steps,
            "val_accuracy": {"start": first["val/accuracy"], "final": last["val/accuracy"]},
            "val_format_rate": {"start": first["val/format_rate"], "final": last["val/format_rate"]},
            "train_reward": {"first": mean(rewards[:window]), "last": mean(rewards[-window:])},
            "updates": dict(self.updates), "wall_seconds": seconds,
            "sessions": self.journal.session_number if self.journal is not None else 1,
            "final_checkpoint": str(self.run_dir / "checkpoints" / f"step_{self.cfg.steps:06d}"),
        }
        if self.ranks.is_main:
            write_json(self.run_dir / "summary.json", summary)
        table = Table(title=f"{self.spec.name}: start -> end")
        for column in ("metric", "start", "end"):
            table.add_column(column)
        for key in ("val/accuracy", "val/format_rate", "val/completion_len_mean"):
            table.add_row(key, f"{first[key]:.3f}", f"{last[key]:.3f}")
        table.add_row("train reward", f"{summary['train_reward']['first']:.3f}", f"{summary['train_reward']['last']:.3f}")
        table.add_row("updates (actual/attempted)", "", f"{self.updates['actual']}/{self.updates['attempted']}")
        self.console.print(table)
        self.reporter.line(f"done in {format_seconds(seconds)}. Run directory {self.run_dir}: summary.json, "
                           f"metrics.jsonl, eval/ (per-item records), manifest.json; final checkpoint "
                           f"{summary['final_checkpoint']}; figures and CIs: grpolab report {self.run_dir}")
        return summary

    def close(self) -> None:
        """Close the metrics log and the engine, then release the run directory's lock (safe to call twice)."""
        if self.log is not None:
            self.log.close()
            self.log = None
        if self.collector is not None:
            self.engine.close()
            self.collector = None
        if self.lock is not None:
            self.lock.release()
            self.lock = None


def train(cfg: RunConfig, console: Console | None = None, resume: bool = False,
          stop: StopRequest | None = None) -> dict[str, Any]:
    """Run ``cfg`` to the end (with ``resume``: continue the run in ``cfg.output_dir``); the engine is
    closed whatever happens."""
    trainer = None
    try:
        trainer = Trainer(cfg, console, resume)
        return trainer.run(stop)
    finally:
        if stop is not None:
            stop.armed = False
        if trainer is not None:
            trainer.close()
        trainer = None  # DDP's reducer before the process group
        end_process_group()
