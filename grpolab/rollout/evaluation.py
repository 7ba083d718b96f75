"""Validation: greedy accuracy, format rate, length, sampled pass@k (unbiased estimator), and one
record per item so that two runs on the same frozen items can be compared item by item.

An item whose rollout or reward failed (``Grade.ok`` False) has an unknown outcome, not a wrong one: its record
says ``failed`` (the kind) and ``error``, the accuracy and format rate are over the items that did not fail, and
``val/failed`` (``val/failed/<kind>``) counts the others; the report leaves them out of the pairing."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import replace
from statistics import mean
from typing import Any

from grpolab.objectives.stats import pass_at_k
from grpolab.parallel.ranks import Ranks
from grpolab.rollout.base import Completion, RolloutEngine, SamplingParams
from grpolab.rollout.failures import failure_counts
from grpolab.rollout.multiturn import tool_metrics
from grpolab.rollout.reward_models import RewardModels
from grpolab.tasks.base import Example, Grade, Task, grade_safely


def grade_completions(
    task: Task, examples: list[Example], completions: list[list[Completion]], reward_models: RewardModels | None = None
) -> list[list[Grade]]:
    """Grades [prompt][sample] of the completions of each example (with the task's ``grade_batch``; a completion
    an environment graded keeps its ``Completion.grade``), with ``reward_models``' raw scores as components."""
    items = [(c.text, ex, c.truncated) for ex, group in zip(examples, completions) for c in group if c.grade is None]
    try:
        graded = task.grade_batch(items) if items else []
    except Exception:
        graded = None  # graded one by one below, each failure counted
    if graded is None or len(graded) != len(items):
        graded = [grade_safely(task, *item) for item in items]
    fresh = iter(graded)
    flat = [c.grade if c.grade is not None else next(fresh) for group in completions for c in group]
    out, start = [], 0
    for group in completions:
        out.append(flat[start : start + len(group)])
        start += len(group)
    return reward_models.attach(task, examples, completions, out) if reward_models is not None else out


def prompt_sha256(prompt: str) -> str:
    """The first 16 hex digits of the prompt text's SHA-256: equal items have equal hashes."""
    return hashlib.sha256(prompt.encode()).hexdigest()[:16]


def item_record(task: Task, example: Example, completion: Completion, grade: Grade) -> dict[str, Any]:
    """What one greedy evaluation of one item produced (a line of ``eval/step_NNNNNN.jsonl``)."""
    return {
        "id": example.id,
        "prompt_sha256": prompt_sha256(task.prompt(example)),
        "completion": completion.text,
        "extracted": grade.extracted,
        "gold": example.answer,
        "format_ok": grade.format_reward > 0,
        "correct": grade.answer_reward > 0,
        "length": len(completion.completion_ids),
        "truncated": completion.truncated,
        **({"rewards": dict(grade.components)} if grade.components else {}),
        **({"failed": grade.failure, "error": grade.error} if not grade.ok else {}),
        **(
            {"turns": completion.turns, "tool_calls": completion.tool_calls}
            if completion.turns > 1 or completion.tool_calls
            else {}
        ),
    }


def greedy(sampling: SamplingParams) -> SamplingParams:
    """The rollout's settings (token limit, stop strings) for greedy decoding."""
    return replace(sampling, temperature=0.0, top_p=1.0, top_k=0, seed=None)


def evaluate(
    engine: RolloutEngine,
    task: Task,
    examples: list[Example],
    prompt_ids: list[list[int]],
    sampling: SamplingParams,
    pass_k: list[int],
    pass_n: int,
    seed: int,
    chunk: int | None = None,
    on_items: Callable[[int], None] | None = None,
    ranks: Ranks = Ranks(),
    measure: Callable[[list[Completion]], dict[str, float]] | None = None,
    reward_models: RewardModels | None = None,
) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Greedy metrics over ``examples`` and, when ``pass_k`` is set, pass@k from ``pass_n`` samples.

    ``sampling`` is the training rollout's: every generation here keeps its token limit and stop
    strings, so completions are cut and graded exactly as in training; the pass@k samples also use
    its temperature, and the top-p / top-k it carries (the run's ``eval.top_p`` / ``eval.top_k``),
    with ``seed``. Greedy completions are generated ``chunk`` prompts at a time (None: all at once; the
    hf engine's own batch size leaves its batches, and so its results, unchanged), and ``on_items(k)``
    is called as k more items finish. Data parallel
    (``ranks``): each rank generates and grades its ``share_chunks`` and the results are gathered, so
    every rank returns the metrics and records of all items. ``measure``: more metrics (``val/``-prefixed)
    from all greedy completions, on every rank (e.g. an MoE policy's routing of them). ``reward_models``
    score the greedy completions: their raw scores in the records and ``val/reward_model/...`` metrics.

    Returns (metrics, one ``item_record`` per example, with ``pass_n`` / ``pass_correct``: the sampled
    count (less its failed samples) and how many were correct, when ``pass_k`` is set).
    """
    step = chunk or max(1, len(prompt_ids))
    share = ranks.share_chunks(len(prompt_ids), step)
    completions = []
    for i in range(ranks.max(len(range(share.start, share.stop, step)))):  # the same calls on every rank
        start = share.start + i * step
        part = prompt_ids[start : min(start + step, share.stop)]
        completions += engine.generate(part, 1, greedy(sampling))
        if on_items is not None and part:
            on_items(len(part))
    grades = [g[0] for g in grade_completions(task, examples[share.start : share.stop], completions, reward_models)]
    correct = [None] * len(completions)  # per item: (samples that did not fail, correct ones) when pass_k
    if pass_k:
        sampled = engine.generate(
            prompt_ids[share.start : share.stop], pass_n, replace(sampling, seed=seed, prompt_offset=share.start)
        )
        correct = [
            (sum(g.ok for g in group), sum(g.ok and g.answer_reward > 0 for g in group))
            for group in grade_completions(task, examples[share.start : share.stop], sampled)
        ]
    if ranks.parallel:
        completions, grades, correct = map(list, zip(*ranks.concat(list(zip(completions, grades, correct)))))
    records = [item_record(task, ex, c[0], g) for ex, c, g in zip(examples, completions, grades)]
    valid = [g for g in grades if g.ok]  # every item failed: the accuracy is unknown (NaN)
    out = {
        "val/accuracy": mean(g.answer_reward for g in valid) if valid else float("nan"),
        "val/format_rate": mean(g.format_reward for g in valid) if valid else float("nan"),
        "val/completion_len_mean": mean(len(c[0].completion_ids) for c in completions),
        "val/truncation_rate": mean(c[0].truncated for c in completions),
    }
    failed = failure_counts(grades)
    if failed:
        out["val/failed"] = sum(failed.values())
        out.update({f"val/failed/{kind}": n for kind, n in failed.items()})
    if reward_models is not None:
        out.update(reward_models.metrics(grades, prefix="val/"))
    if measure is not None:
        out.update({f"val/{k}": v for k, v in measure([c[0] for c in completions]).items()})
    if task.toolset is not None:
        out.update(tool_metrics([c[0] for c in completions], [g.answer_reward > 0 for g in grades], prefix="val/tool/"))
    if pass_k:
        for k in pass_k:  # over the items with at least k samples that did not fail (NaN: none)
            estimates = [pass_at_k(n, c, k) for n, c in correct if n >= k]
            out[f"val/pass@{k}"] = mean(estimates) if estimates else float("nan")
        for record, (n, c) in zip(records, correct):
            record.update(pass_n=n, pass_correct=c)
    return out, records
