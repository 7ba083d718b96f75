"""The run around the loop: its directory, journal and lock, evaluation, checkpoints, and the loop itself.

A run's parts (task, models, optimizer, engine, collector, learner) are assembled by
``grpolab.run.parts``; one step over them is ``grpolab.run.step``. The trainer reads an
``AlgorithmSpec``'s fields through those parts; it never looks at an algorithm's name.
"""

from __future__ import annotations

import platform
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from statistics import mean
from typing import Any

import torch
import transformers
from rich.console import Console
from rich.table import Table

from grpolab.common.progress import Reporter, format_seconds
from grpolab.common.version import PACKAGE_DIR, VERSION
from grpolab.config import RunConfig
from grpolab.models.loading import model_record
from grpolab.models.teacher import check_teacher_record
from grpolab.parallel.fsdp import full_state_dict
from grpolab.parallel.ranks import end_process_group
from grpolab.rollout.engine_process import EngineDied
from grpolab.rollout.engines import capabilities, dtype_name, engine_record
from grpolab.rollout.evaluation import evaluate
from grpolab.rollout.failures import TooManyFailures, check_failure_rate, failure_totals
from grpolab.run.checkpoints import prune, remove_temp_folders, save_checkpoint, set_aside
from grpolab.run.disk import CheckpointPlan, checkpoint_plan
from grpolab.run.health import HealthMonitor, HealthSettings, RunWarning
from grpolab.run.journal import MANIFEST, RunJournal
from grpolab.run.lock import LOCK_FILE, RunLock
from grpolab.run.parts import RunParts, build_parts, load_task, set_up
from grpolab.run.resume import ResumePlan, check_data, check_target, plan_resume
from grpolab.run.rundir import (
    MetricsLog,
    RunDirError,
    last_step,
    resolve_run_dir,
    rewind_metrics,
    said_warnings,
    start_leftovers,
    write_eval_records,
    write_json,
)
from grpolab.run.state import STATE_FILE, RunState
from grpolab.run.step import completion_rows, rl_step, vital_signs
from grpolab.run.stop import RunStopped, StopRequest
from grpolab.run.trackers import Trackers, check_trackers, identities, open_trackers


class Trainer:
    """One run: its parts (``self.parts``) and its run directory."""

    def __init__(self, cfg: RunConfig, console: Console | None = None, resume: bool = False):
        """A new run into ``cfg.output_dir`` (new or empty), or with ``resume`` the continuation of the run
        in that directory from its newest complete checkpoint (weights, optimizer, RNGs, data position).
        The run directory's lock is held from the first write (a resume: from the first check) to
        ``close``: one trainer per run directory.

        Under ``torchrun`` every rank builds its own trainer: rank 0 alone prints, writes files and holds
        the lock, and every rank takes the same decisions (``grpolab.parallel.ranks``)."""
        self.parts: RunParts | None = None
        self.lock: RunLock | None = None
        self.log: MetricsLog | None = None  # rank 0's
        self.journal: RunJournal | None = None  # rank 0's
        self.plan: ResumePlan | None = None
        self.health: HealthMonitor | None = None  # the run's warnings, from ``run``
        self.finished = False  # the run reached its last step: its trackers' runs are marked finished
        self.sent_through = -1  # the last step an earlier session may have sent to the trackers
        try:
            self._set_up(cfg, console, resume)
        except BaseException:
            self.close()
            raise

    def _set_up(self, cfg: RunConfig, console: Console | None, resume: bool) -> None:
        self.cfg, self.spec = cfg, cfg.algorithm
        setting = set_up(cfg, lambda ranks: Reporter((console or Console()) if ranks.is_main else Console(quiet=True)))
        self.ranks, self.reporter, self.console = setting.ranks, setting.reporter, setting.reporter.console
        # bad input is refused before anything is printed: one error line (every rank raises rank 0's error)
        self.run_dir, self.resumed_from = self.ranks.run_on_main(lambda: self._run_dir(resume))
        self.ranks.run_on_main(lambda: check_trackers(cfg.log))  # a missing package: one line, nothing moved
        task, val_examples = load_task(cfg, self.reporter)
        self.parts = build_parts(cfg, setting, task, val_examples, self.resumed_from)
        if resume:  # once the parts are built: a chat prompt's fingerprint holds the tokenizer's chat template
            self.ranks.run_on_main(
                lambda: self.plan.journal is None or check_data(self.plan.journal, task.data_fingerprint())
            )
        self.cfg, self.spec = self.parts.cfg, self.parts.spec  # "auto" settings resolved: config.json records them
        if resume:  # a resumed run keeps its teacher: another is refused before anything moves
            self.ranks.run_on_main(
                lambda: (
                    self.plan.journal is None
                    or check_teacher_record(
                        self.plan.journal.data.get("teacher"), self.parts.teacher, self.run_dir / MANIFEST
                    )
                )
            )
        if self.resumed_from is not None:
            self.parts.state.load(self.resumed_from)
        # the metrics of the steps before a resume
        self.records: list[dict[str, Any]] = self.ranks.run_on_main(lambda: self._prepare_run_dir(resume))
        if self.ranks.is_main:
            self.log = MetricsLog(self.run_dir / "metrics.jsonl", self._open_trackers(resume))

    def _open_trackers(self, resume: bool) -> Trackers | None:
        """Rank 0's trackers (``log.trackers``), on the tracker runs its manifest records (a resume continues
        them); each one's mode recorded in this session's entry. None without trackers."""
        settings = self.cfg.log
        if not settings.trackers:
            return None
        previous = self.journal.data.get("trackers") or {}
        runs = identities(settings, self.run_dir, previous)
        self.journal.record_trackers(runs)  # before they start: a run killed meanwhile resumes the same runs
        with self.reporter.phase(f"start trackers ({', '.join(settings.trackers)})", done_note=False):
            trackers, modes = open_trackers(
                settings,
                self.run_dir,
                runs,
                previous,
                self.journal.recorded_config(),
                first_step=self.plan.kept_step + 1 if resume else None,
                sent_through=self.sent_through,
                say=self.reporter.line,
            )
        self.journal.record_tracker_modes(modes)
        return trackers

    def _run_dir(self, resume: bool) -> tuple[Path, Path | None]:
        """(run directory, checkpoint resumed from). A new run refuses a used directory; a resume takes the
        run's lock, then every check of ``plan_resume`` (nothing on disk moves yet)."""
        if not resume:
            return resolve_run_dir(self.cfg.output_dir, self.spec.name), None
        run_dir = Path(self.cfg.output_dir or "")
        check_target(run_dir)
        self.lock = RunLock(run_dir).acquire()
        self.plan = plan_resume(self.cfg, on_check=lambda folder: self.reporter.line(f"verify checkpoint {folder}"))
        for folder, why in self.plan.damaged:
            self.reporter.line(
                f"checkpoint {folder.name} is damaged ({why}): set aside into checkpoints/damaged/; "
                f"continuing from {self.plan.checkpoint.name}"
            )
        if self.plan.checkpoint is None:
            self.reporter.line(
                f"run {run_dir} was stopped before its first checkpoint: starting it again from "
                "step 0 in place (what it wrote is set aside)"
            )
        return run_dir, self.plan.checkpoint

    def _prepare_run_dir(self, resume: bool) -> list[dict[str, Any]]:
        """Create the run directory (only once everything validated), lock it, write its config and
        manifest; or for a resume remove interrupted checkpoint writes, set damaged checkpoints aside,
        rewind the metrics to the checkpoint's step and record the resume. Returns the records kept."""
        if not resume:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self.lock = RunLock(self.run_dir).acquire()
            leftovers = start_leftovers(self.run_dir)
            if leftovers is None:
                raise RunDirError(f"output directory {self.run_dir} was filled by another process meanwhile")
            for path in leftovers:  # a temp config.json of a start killed before it wrote its config
                if path.name != LOCK_FILE:
                    path.unlink()
            self.journal = RunJournal.create(self.run_dir, self.cfg.model_dump(mode="json"), self._manifest_record())
            return []
        plan = self.plan
        if plan.journal is None:  # stopped between config.json and manifest.json: this start is its first
            for path in plan.stale:
                path.unlink(missing_ok=True)
            self.journal = RunJournal.create(self.run_dir, plan.config, self._manifest_record())
            return []
        self.journal = plan.journal
        self.sent_through = last_step(self.run_dir)  # before the rewind sets the redone steps' records aside
        removed = remove_temp_folders(self.run_dir)
        for folder, _ in plan.damaged:
            set_aside(folder)
        records = rewind_metrics(
            self.run_dir / "metrics.jsonl", plan.kept_step, session=plan.journal.session_number + 1
        )
        plan.journal.record_resume(plan.checkpoint, plan.step, plan.changes, plan.damaged, removed)
        return records

    def _manifest_record(self) -> dict[str, Any]:
        """What manifest.json records about a new run's start (``RunJournal`` adds the config and sessions)."""
        parts, threads = self.parts, self.parts.setting.threads
        return {
            "grpolab": VERSION,
            "grpolab_source": str(PACKAGE_DIR),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
            "command": sys.argv,
            "device": str(parts.device),
            "ranks": {"world": self.ranks.world, "strategy": self.cfg.dist.strategy},
            "cpu": {"threads": threads.threads, "cores": threads.cores, "busy_at_start": threads.busy},
            "model": model_record(parts.model, parts.model_dir),
            "task": parts.task.name,
            # a start from another run's checkpoint: its weights only, with a fresh optimizer and this seed
            "warm_start_from": (
                str(parts.policy.started_from)
                if parts.policy.started_from is not None
                else str(parts.model_dir)
                if (parts.model_dir / STATE_FILE).is_file()
                else None
            ),
            "data": parts.task.data_fingerprint(),
            "train_examples": len(parts.task.train_examples()),
            "val_examples": len(parts.val_examples),
            "algorithm": self.spec.model_dump(),
            "resolved": parts.resolved,  # each "auto" setting: what it became and why
            "precision": {
                "setting": parts.precision.name,
                "weights": dtype_name(parts.precision.storage),
                "compute": dtype_name(parts.precision.compute),
            },
            "rollout_engine": engine_record(self.cfg.rollout),
            "teacher": parts.teacher.record if parts.teacher is not None else None,
        }

    # ---- evaluation, the loop, the summary ------------------------------------------------
    def evaluate(self, step: int) -> dict[str, float]:
        """Every validation item (each rank its share, gathered); rank 0 writes the records."""
        parts, started, chunk = self.parts, time.perf_counter(), self.cfg.rollout.max_batch_size
        mine = len(self.ranks.share_chunks(len(parts.val_examples), chunk))
        with self.reporter.phase(f"eval step {step}", total=mine, unit="items") as phase:
            out, records = evaluate(
                parts.engine,
                parts.task,
                parts.val_examples,
                [parts.prompt_ids[e.id] for e in parts.val_examples],
                replace(parts.collector.sampling_params(0, 0), top_p=self.cfg.eval.top_p, top_k=self.cfg.eval.top_k),
                self.cfg.eval.pass_k,
                self.cfg.eval.pass_n,
                seed=self.cfg.seed + 7,
                chunk=chunk,
                on_items=phase.advance,
                ranks=self.ranks,
                measure=parts.learner.routing_of,
                reward_models=parts.reward_models,
            )
            phase.info = "  ".join(
                f"{k.removeprefix('val/')} {v:.3f}" if isinstance(v, float) else f"{k.removeprefix('val/')} {v}"
                for k, v in out.items()
                if "/layer" not in k
            )
        failed = [(r["failed"], r.get("error")) for r in records if r.get("failed")]
        check_failure_rate(failed, len(records), self.cfg.rollout.max_failure_rate, f"evaluation at step {step}")
        out["time/eval"] = time.perf_counter() - started
        if self.ranks.is_main:
            write_eval_records(self.run_dir, step, records)
            self.log.write({"step": step, **out})
            if self.cfg.log.completions_every:
                columns = ["id", "completion", "extracted", "gold", "correct", "format_ok", "length", "truncated"]
                rows = [[r.get(c) for c in columns] for r in records[: self.cfg.log.completions_max]]
                self.log.table(step, "val/completions", columns, rows)
        if self.health is not None:
            self.warn(self.health.record({"step": step, **out}))
        return out

    def _health_settings(self) -> HealthSettings:
        return HealthSettings(
            single_update=self.spec.is_single_update,
            no_signal_steps=self.cfg.warn.no_signal_steps,
            max_new_tokens=self.cfg.rollout.max_new_tokens,
        )

    def warn(self, warnings: list[RunWarning]) -> None:
        """Print each new warning once (``grpolab.run.health``); summary.json lists them all."""
        for warning in warnings:
            self.reporter.warning(warning.line())

    def run(self, stop: StopRequest | None = None) -> dict[str, Any]:
        """Steps from the state's step + 1 to ``cfg.steps``; with ``stop``, a requested stop ends the run
        after the current step with a resumable checkpoint (``RunStopped``)."""
        cfg, started, first = self.cfg, time.perf_counter(), self.parts.state.step + 1
        stop = stop or StopRequest()
        resumed = f" (resumed after step {first - 1})" if first > 1 else ""
        self.reporter.line(
            f"{self.spec.name} on {self.parts.task.name}, {cfg.steps} steps{resumed} -> run dir {self.run_dir}"
        )
        # warnings that save a wasted run: the records before a resume replayed (their warnings said then)
        self.health = HealthMonitor(self._health_settings())
        self.health.replay(self.records)
        if first > 1 and self.ranks.is_main:  # and those a finished session said at its end
            self.health.restore(said_warnings(self.run_dir), first - 1)
        if self.ranks.is_main:  # what the checkpoints will take, before the first is written
            plan = self.checkpoint_plan(first)
            self.reporter.line(plan.line())
            if (warning := plan.warning()) is not None:
                self.reporter.warning(warning)
        evals = {r["step"]: r for r in self.records if "val/accuracy" in r} if first > 1 else {0: self.evaluate(0)}
        records = [r for r in self.records if "reward_mean" in r]  # the step records
        log_every = cfg.log_every or (1 if self.reporter.plain else None)
        with self.reporter.phase("train", total=cfg.steps, unit="steps", done_note=False, done=first - 1) as bar:
            # an engine whose processes share the terminal's process group dies of the same Ctrl-C, so a
            # graceful stop could wait on a dead engine: with such an engine a signal still stops the run at
            # once. Under torchrun the ranks agree at each step's end whether any of them was asked to stop.
            stop.armed = capabilities(cfg.rollout.engine).graceful_stop
            for step in range(first, cfg.steps + 1):
                record = self.train_step(step, bar.set_status)
                self.parts.state.step = step
                stopping = self.ranks.any(stop.requested)
                records.append(record)
                if log_every and (step % log_every == 0 or step == cfg.steps):
                    left = bar.elapsed() / (step - first + 1) * (cfg.steps - step)
                    self.reporter.line(vital_signs(record, cfg.steps, left))
                self.warn(self.health.record(record))
                if step % cfg.eval.every == 0 or step == cfg.steps:
                    bar.set_status("evaluate")
                    evals[step] = self.evaluate(step)
                if step % cfg.checkpoint.every == 0 or step == cfg.steps or stopping:
                    bar.set_status("checkpoint")
                    with self.reporter.phase(f"checkpoint step {step}") as phase:
                        phase.info = self.save_checkpoint(step)
                if self.journal is not None:
                    self.journal.tick(step, time.perf_counter() - started)
                bar.set_status("")
                bar.advance(info=f"reward {record['reward_mean']:.3f}, val acc {evals[max(evals)]['val/accuracy']:.3f}")
                if stopping and step < cfg.steps:
                    raise RunStopped(
                        f"stopped after step {step} with a checkpoint; continue with: "
                        f"grpolab train --resume {self.run_dir}"
                    )
            stop.armed = False
        self.finished = True
        self.warn(self.health.finish())
        seconds = self.journal.total_seconds() if self.journal is not None else time.perf_counter() - started
        return self._summarize(evals, [r["reward_mean"] for r in records], seconds, failure_totals(records))

    def checkpoint_plan(self, first: int) -> CheckpointPlan:
        """The checkpoints of this session from step ``first``: each one's weights as saved (the model's
        parameters, tied ones once; a LoRA run's adapter: its trained parameters) and optimizer state."""
        policy, trained = self.parts.policy, self.parts.policy.trainable()
        saved = {id(p): p for p in (self.parts.model.parameters() if policy.saved is self.parts.model else trained)}
        return checkpoint_plan(
            sum(p.numel() * p.element_size() for p in saved.values()),
            self.parts.precision.optimizer_state_bytes(sum(p.numel() for p in trained)),
            first,
            self.cfg.steps,
            self.cfg.checkpoint.every,
            self.cfg.checkpoint.keep_last,
            self.run_dir,
        )

    def save_checkpoint(self, step: int) -> str:
        """Rank 0 writes the checkpoint of ``step`` (whole weights, every rank's RNGs in its state) and, with
        checkpoint.keep_last, removes the oldest once it verifies; the others gather what it needs and
        wait for it. Returns what was done, for the progress line."""
        weights = self.parts.policy.saved_state(full_state_dict(self.parts.model)) if self.parts.sharded else None
        state = self.parts.state.state_dict()

        def write() -> str:
            folder = save_checkpoint(
                self.parts.policy.saved,
                self.parts.tokenizer,
                self.run_dir,
                step,
                lambda tmp: RunState.save(state, tmp),
                weights,
            )
            keep = self.cfg.checkpoint.keep_last
            removed = prune(self.run_dir, keep, (STATE_FILE,)) if keep else []
            return str(folder) + (
                f"; removed {', '.join(p.name for p in removed)} (keep_last {keep})" if removed else ""
            )

        return self.ranks.run_on_main(write)

    def train_step(self, step: int, status: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
        """One RL step over the parts (``grpolab.run.step``), its record logged and returned; every
        ``log.completions_every`` steps (and the last) a table of its completions goes to the trackers."""
        every, tables = self.cfg.log.completions_every, []

        def keep(rollout) -> None:
            tables.append(completion_rows(self.parts, rollout, self.cfg.log.completions_max))

        wanted = self.log is not None and self.log.trackers is not None and every is not None
        due = wanted and (step % every == 0 or step == self.cfg.steps)
        record = rl_step(self.parts, step, status, on_rollout=keep if due else None)
        if self.log is not None:
            self.log.write(record)
            for columns, rows in tables:
                self.log.table(step, "completions", columns, rows)
        return record

    def _summarize(
        self, evals: dict[int, dict[str, float]], rewards: list[float], seconds: float, failures: dict[str, int]
    ) -> dict[str, Any]:
        first, last = evals[0], evals[max(evals)]
        window = max(1, len(rewards) // 10)  # the mean of the first and of the last 10% of steps
        summary = {
            "algorithm": self.spec.name,
            "run_dir": str(self.run_dir),
            "steps": self.cfg.steps,
            "val_accuracy": {"start": first["val/accuracy"], "final": last["val/accuracy"]},
            "val_format_rate": {"start": first["val/format_rate"], "final": last["val/format_rate"]},
            "train_reward": {
                "first": mean(rewards[:window]),
                "last": mean(rewards[-window:]),
                "steps_averaged": window,
            },
            "updates": dict(self.parts.state.updates),
            "wall_seconds": seconds,
            "sessions": self.journal.session_number if self.journal is not None else 1,
            "final_checkpoint": str(self.run_dir / "checkpoints" / f"step_{self.cfg.steps:06d}"),
            "warnings": [w.record() for w in self.health.warnings],
            "failed_samples": failures,  # by kind: samples whose rollout or reward failed (none trained)
        }
        if self.ranks.is_main:
            write_json(self.run_dir / "summary.json", summary)
        table = Table(title=f"{self.spec.name}: start -> end")
        for column in ("metric", "start", "end"):
            table.add_column(column)
        for key in ("val/accuracy", "val/format_rate", "val/completion_len_mean"):
            table.add_row(key, f"{first[key]:.3f}", f"{last[key]:.3f}")
        steps = "step" if window == 1 else f"{window} steps"
        table.add_row(
            f"train reward (mean of first / last {steps})",
            f"{summary['train_reward']['first']:.3f}",
            f"{summary['train_reward']['last']:.3f}",
        )
        table.add_row(
            "updates (actual/attempted)",
            "",
            f"{self.parts.state.updates['actual']}/{self.parts.state.updates['attempted']}",
        )
        self.console.print(table)
        if self.health.warnings:
            self.reporter.line(
                f"{len(self.health.warnings)} warning(s) above: "
                + ", ".join(f"{w.key} (step {w.step})" for w in self.health.warnings)
                + " (also in summary.json and grpolab report)"
            )
        if failures:
            total = sum(failures.values())
            self.reporter.line(
                f"{total} sample(s) failed and trained nothing: "
                + ", ".join(f"{kind} {n}" for kind, n in failures.items())
                + " (rollout/failed/<kind> in metrics.jsonl; failed_samples in summary.json)"
            )
        self.reporter.line(
            f"done in {format_seconds(seconds)}. Run directory {self.run_dir}: summary.json, "
            f"metrics.jsonl, eval/ (per-item records), manifest.json; final checkpoint "
            f"{summary['final_checkpoint']}; figures and CIs: grpolab report {self.run_dir}"
        )
        return summary

    def close(self) -> None:
        """Close the metrics log (its trackers' runs marked finished when the run reached its end, else left
        resumable) and the engine, then release the run directory's lock (safe to call twice)."""
        if self.log is not None:
            if self.log.trackers is not None:  # W&B online uploads what it still holds: it may take a while
                with self.reporter.phase("close trackers", done_note=None):
                    self.log.close(self.finished)
            self.log = None
        if self.parts is not None:
            self.parts.close()
        if self.lock is not None:
            self.lock.release()
            self.lock = None


def train(
    cfg: RunConfig, console: Console | None = None, resume: bool = False, stop: StopRequest | None = None
) -> dict[str, Any]:
    """Run ``cfg`` to the end (with ``resume``: continue the run in ``cfg.output_dir``); the engine is
    closed whatever happens."""
    trainer = None
    try:
        trainer = Trainer(cfg, console, resume)
        try:
            return trainer.run(stop)
        except (EngineDied, TooManyFailures) as died:  # one line, and where the run continues from
            raise type(died)(
                f"{died}; the run stopped after step {trainer.parts.state.step}: continue from its last "
                f"checkpoint with: grpolab train --resume {trainer.run_dir}"
            ) from None
    finally:
        if stop is not None:
            stop.armed = False
        if trainer is not None:
            trainer.close()
        trainer = None  # DDP's reducer before the process group
        end_process_group()
