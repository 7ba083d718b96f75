"""``grpolab bench rollout|step``: every available rollout engine timed side by side, in one run,
on one config (the demo's by default).

rollout: generation of the same prompts (``rollout.prompts_per_step`` x ``rollout.group_size``
    samples, the config's sampling settings) after one warm-up call; completion tokens/s, the
    ratio to the hf engine, and the seconds of a weight sync.
step: whole RL steps (generation, reward, update, sync, and the vLLM sync check) after one
    warm-up step, with the phase split and the sync's share of a step.

Each engine gets its own run parts (``grpolab.run.parts``: model, optimizer, engine, ...), no run directory.
Without ``--engines`` every registered engine is tried; those this environment or config cannot run are
skipped with a line saying why (not installed, a setting it refuses, a model it cannot load here), and the
table's caption lists them.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

from grpolab.common.progress import Reporter
from grpolab.config import RunConfig

PHASES = ("generate", "reward", "train", "sync", "step")


def _parts(cfg: RunConfig, engine: str):
    from grpolab.run.parts import assemble

    return assemble(
        cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"engine": engine})}),
        lambda ranks: Reporter(Console(quiet=True)),
    )


def time_rollout(parts, repeats: int) -> dict[str, Any]:
    """Median seconds and tokens/s of ``repeats`` generations of one fixed prompt batch."""
    cfg = parts.cfg.rollout
    prompts = [parts.prompt_ids[e.id] for e in parts.prompts.take(cfg.prompts_per_step)]
    parts.engine.generate(prompts, cfg.group_size, parts.collector.sampling_params(0, 0))  # warm-up
    seconds, tokens = [], []
    for repeat in range(1, repeats + 1):
        started = time.perf_counter()
        out = parts.engine.generate(prompts, cfg.group_size, parts.collector.sampling_params(repeat, 0))
        seconds.append(time.perf_counter() - started)
        tokens.append(sum(len(c.completion_ids) for group in out for c in group))
    syncs = []
    for _ in range(repeats):
        started = time.perf_counter()
        parts.engine.sync_weights(parts.sync_source())
        syncs.append(time.perf_counter() - started)
    return {
        "sequences": len(prompts) * cfg.group_size,
        "tokens": statistics.mean(tokens),
        "seconds": statistics.median(seconds),
        "tokens_per_s": sum(tokens) / sum(seconds),
        "sync_seconds": statistics.median(syncs),
    }


def time_steps(parts, repeats: int) -> dict[str, Any]:
    """Mean seconds per phase over ``repeats`` RL steps after a warm-up step."""
    from grpolab.run.step import rl_step

    rl_step(parts, 1)  # steps count from 1: the batch of step t is sampled by the policy after step t - 1
    records = [rl_step(parts, step) for step in range(2, repeats + 2)]
    out = {phase: statistics.mean(r[f"time/{phase}"] for r in records) for phase in PHASES}
    out["tokens_per_s"] = statistics.mean(r["tokens_per_s"] for r in records)
    out["sync_share"] = out["sync"] / out["step"]
    out["logprob_diff_max"] = max((r.get("sync/logprob_diff_max", float("nan")) for r in records), default=None)
    return out


def run_bench(
    kind: str, cfg: RunConfig, engines: list[str], repeats: int, console: Console, skipped: dict[str, str] | None = None
) -> dict[str, Any]:
    """Time ``engines`` ("rollout" or "step"), print a table with ratios to the first engine, return the figures.
    ``skipped``: the engines left out, with why (None: ``engines`` were named by the user, and one that
    cannot start is an error); one that refuses this config's model as it starts joins them."""
    measure = time_rollout if kind == "rollout" else time_steps
    results: dict[str, Any] = {}
    chosen = skipped is None
    skipped = skipped if skipped is not None else {}
    for engine, why in skipped.items():
        console.print(f"bench {kind}: {engine} skipped: {why}", highlight=False, soft_wrap=True)
    for engine in engines:
        console.print(f"bench {kind}: {engine} ...")
        try:
            parts = _parts(
                cfg.model_copy(update={"steps": max(cfg.steps, repeats + 1)}), engine
            )  # async: its last batch
        except ValueError as err:  # e.g. an engine that cannot serve this model on this device
            if chosen:
                raise
            skipped[engine] = str(err)
            console.print(f"bench {kind}: {engine} skipped: {err}", highlight=False, soft_wrap=True)
            continue
        try:
            results[engine] = measure(parts, repeats)
        finally:
            parts.close()
    if not results:
        raise ValueError(
            f"bench {kind}: no engine can run this config ({'; '.join(f'{e}: {w}' for e, w in skipped.items())})"
        )
    table = _table(kind, cfg, results)
    if skipped:
        table.caption = (table.caption + "; " if table.caption else "") + f"skipped: {', '.join(skipped)}"
    console.print(table)
    return results


def _table(kind: str, cfg: RunConfig, results: dict[str, Any]) -> Table:
    r, first = cfg.rollout, next(iter(results))
    base = results[first]
    table = Table(
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        title=f"bench {kind}: {r.prompts_per_step} prompts x {r.group_size}, <= {r.max_new_tokens} new "
        f"tokens, temperature {r.temperature:g}; ratios to {first}",
    )
    if kind == "rollout":
        for column in ("engine", "tokens/call", "seconds/call", "tokens/s", "speed-up", "sync s"):
            table.add_column(column, justify="right")
        for name, m in results.items():
            table.add_row(
                name,
                f"{m['tokens']:.0f}",
                f"{m['seconds']:.3f}",
                f"{m['tokens_per_s']:.0f}",
                f"{m['tokens_per_s'] / base['tokens_per_s']:.2f}x",
                f"{m['sync_seconds']:.4f}",
            )
        return table
    table.caption = (
        "seconds per phase (mean of the timed steps): generate, reward, train, sync, whole step; "
        f"vs {first}: step speed-up; max|d|: engine vs trainer log-probs"
    )
    for column in ("engine", "gen", "reward", "train", "sync", "step", f"vs {first}", "sync%", "tok/s", "max|d|"):
        table.add_column(column, justify="right")
    for name, m in results.items():
        diff = m["logprob_diff_max"]
        table.add_row(
            name,
            *(f"{m[p]:.2f}" for p in PHASES),
            f"{base['step'] / m['step']:.2f}x",
            f"{100 * m['sync_share']:.1f}",
            f"{m['tokens_per_s']:.0f}",
            "-" if diff is None or math.isnan(diff) else f"{diff:.0e}",
        )
    return table
