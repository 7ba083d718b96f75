"""What ``grpolab demo`` will do and roughly how long each part takes on this machine, said up front.

The estimate times three training steps of a model with the demo model's shapes (about a second) and
scales by ratios measured on 2 CPU cores (idle at 1 and 2 threads, and at 1 thread beside another
CPU-bound process): a warm-start step took 0.7x such a step, an RL step of the demo (32 prompts x 8
samples, <= 48 new tokens) 2.7-4.1x in three idle runs at 1 and 2 threads since prompts are shared in
training (the calibration step itself varies; 4.6-5.4x before), one greedy evaluation of 500 problems
3.4-7.7x.
"""

from __future__ import annotations

import time

import torch
from transformers import AutoModelForCausalLM

from grpolab.common.progress import Reporter, format_seconds
from grpolab.common.threads import choose_threads
from grpolab.config import RolloutConfig, RunConfig
from grpolab.models.sources import check_model_spec
from grpolab.models.tinymodel import (
    WarmStartSettings,
    default_cache_root,
    settings_config,
    warm_start_key,
    warm_start_settings,
)
from grpolab.run.rundir import resolve_run_dir
from grpolab.tasks import build_task

WARM_START_RATIO = 0.72  # warm-start step / calibration step
RL_STEP_RATIO = (2.7, 4.5)  # RL step / calibration step, per 32 x 8 completions of <= 48 tokens
EVAL_RATIO = (3.5, 7.5)  # evaluation / calibration step, per 500 problems
CALIBRATION_TOKENS = 64  # warm-start sequences: prompt + worked solution


def calibration_step_seconds(settings: WarmStartSettings, repeats: int = 3) -> tuple[float, int]:
    """(median seconds of one AdamW step on a batch shaped like the warm start's, parameter count) of a
    randomly initialised model with the demo model's shapes; the global RNG is left untouched."""
    config = settings_config(settings)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
        ids = torch.randint(0, settings.vocab_size, (settings.batch_size, CALIBRATION_TOKENS))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times = []
    for _ in range(repeats + 1):  # the first step warms up
        started = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - started)
    return sorted(times[1:])[len(times[1:]) // 2], sum(p.numel() for p in model.parameters())


def _span(seconds: tuple[float, float]) -> str:
    low, high = (format_seconds(s) for s in seconds)
    return f"~{low}" if low == high else f"~{low}-{high}"


def print_demo_plan(cfg: RunConfig, reporter: Reporter) -> None:
    """Say what the demo will do, with time estimates for this machine (hf engine)."""
    resolve_run_dir(cfg.output_dir, cfg.algorithm.name)  # bad input: one error line, before the plan
    task = build_task(cfg.task)
    check_model_spec(cfg.model.path, cfg.model.revision)
    torch.set_num_threads(choose_threads(cfg.threads).threads)  # the run measures again and agrees
    settings = warm_start_settings(task, cfg.model.warm_start)
    step, parameters = calibration_step_seconds(settings)
    shape = (cfg.rollout.prompts_per_step * cfg.rollout.group_size / 256) * (cfg.rollout.max_new_tokens / 48)
    n_val = cfg.eval.n_examples or len(task.validation_examples())
    evals = 1 + cfg.steps // cfg.eval.every + (cfg.steps % cfg.eval.every != 0)
    rl = tuple(cfg.steps * r * step * shape for r in RL_STEP_RATIO)
    ev = tuple(evals * r * step * n_val / 500 for r in EVAL_RATIO)
    cache = default_cache_root() / warm_start_key(task, settings)
    calibrated = RolloutConfig.model_fields["engine"].default  # the estimates' ratios were measured on it
    engine = (
        ""
        if cfg.rollout.engine == calibrated
        else f" (estimates for the {calibrated} engine; {cfg.rollout.engine} differs)"
    )
    lines = [
        f"grpolab demo: {cfg.algorithm.name} on {task.name} with a {parameters / 1e6:.1f}M-parameter "
        f"{settings.arch} model, {torch.get_num_threads()} cpu thread(s). Estimated on this machine{engine}:"
    ]
    if cfg.model.path is None and not (cache / "warm_start.json").exists():
        lines.append(
            f"  1. warm start: {settings.steps} supervised steps on worked solutions, "
            f"~{format_seconds(settings.steps * step * WARM_START_RATIO)} (once; cached in {cache.parent})"
        )
    else:
        lines.append("  1. warm start: cached, skipped")
    lines.append(
        f"  2. RL: {cfg.steps} steps of {cfg.rollout.prompts_per_step} prompts x {cfg.rollout.group_size} "
        f"samples (<= {cfg.rollout.max_new_tokens} new tokens), {_span(rl)}"
    )
    lines.append(
        f"  3. evaluation: greedy accuracy on {n_val} problems, {evals} times (every {cfg.eval.every} steps), "
        f"{_span(ev)} in all"
    )
    lines.append(f"  then: summary, metrics and checkpoints in {cfg.output_dir or 'runs/<time>-' + cfg.algorithm.name}")
    for line in lines:
        reporter.line(line)
