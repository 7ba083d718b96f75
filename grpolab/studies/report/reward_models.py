"""The numbers of a report's reward model section: per run and reward model, the raw score's statistics at
the last training step and how its correlation with correctness moved over training (a falling one is the
first sign of reward hacking), the final evaluation's mean score and correlation, and the score by completion
length decile of the final evaluation's records (the length-bias check). Rendered by ``markdown``."""

from __future__ import annotations

from typing import Any

import numpy as np

from grpolab.studies.report.runs import Run, outcomes

PREFIX = "reward_model/"
STATS = ("mean", "std", "min", "max", "corr_correct")


def model_names(run: Run) -> list[str]:
    """The run's reward models, in order of first appearance of their ``[val/]reward_model/<name>/mean`` metric."""
    names: dict[str, None] = {}
    for record in run.metrics:
        for key in record:
            for prefix in (PREFIX, "val/" + PREFIX):
                if key.startswith(prefix) and key.endswith("/mean") and len(key) > len(prefix) + len("/mean"):
                    names.setdefault(key[len(prefix) : -len("/mean")], None)
    return list(names)


def length_deciles(
    lengths: np.ndarray, scores: np.ndarray, correct: np.ndarray, bins: int = 10
) -> list[dict[str, Any]]:
    """The score by completion length: items ranked by length (ties kept in item order) and cut at the rank
    quantiles into ``min(bins, items)`` groups of near-equal size (when the items do not divide evenly, the
    first groups hold one more), so equal lengths may fall in two adjacent groups.

    lengths, scores, correct (0/1): [items]. Returns one row per group, shortest first: ``decile`` (1-based),
    ``min_length`` and ``max_length`` (the group's range), ``items``, ``mean_score`` and ``accuracy``
    (mean of ``correct``); [] when there are no items."""
    lengths, scores, correct = (np.asarray(a, dtype=np.float64).reshape(-1) for a in (lengths, scores, correct))
    if not len(lengths) == len(scores) == len(correct):
        raise ValueError(f"lengths, scores and correct differ in size: {len(lengths)}, {len(scores)}, {len(correct)}")
    if not len(lengths):
        return []
    order = np.argsort(lengths, kind="stable")
    return [
        {
            "decile": k + 1,
            "min_length": int(lengths[g].min()),
            "max_length": int(lengths[g].max()),
            "items": len(g),
            "mean_score": float(scores[g].mean()),
            "accuracy": float(correct[g].mean()),
        }
        for k, g in enumerate(np.array_split(order, min(bins, len(order))))
    ]


def model_summary(run: Run, name: str) -> dict[str, Any]:
    """One reward model of one run: ``step`` and ``mean``/``std``/``min``/``max``/``corr_correct`` of the last
    training step that scored it (None where not logged: corr_correct when scores or correctness were
    constant); ``corr_first``/``corr_last`` at ``corr_first_step``/``corr_last_step`` and ``corr_change``
    (last - first), over the training steps with a correlation (two at least); ``eval_step``, ``eval_mean``
    and ``eval_corr_correct`` of the last evaluation that scored it; ``length_step``, ``length_items`` and
    ``deciles`` (``length_deciles``) of the last evaluation's records that carry its score."""
    key = PREFIX + name
    out: dict[str, Any] = {"run": run.name, "model": name}
    train = [r for r in run.train if f"{key}/mean" in r]
    if train:
        out |= {"step": train[-1]["step"], **{s: train[-1].get(f"{key}/{s}") for s in STATS}}
    corr = [(r["step"], r[f"{key}/corr_correct"]) for r in train if r.get(f"{key}/corr_correct") is not None]
    if len(corr) >= 2:
        (first_step, first), (last_step, last) = corr[0], corr[-1]
        out |= {
            "corr_first_step": first_step,
            "corr_first": first,
            "corr_last_step": last_step,
            "corr_last": last,
            "corr_change": last - first,
        }
    evals = [r for r in run.evals if f"val/{key}/mean" in r]
    if evals:
        out |= {
            "eval_step": evals[-1]["step"],
            "eval_mean": evals[-1][f"val/{key}/mean"],
            "eval_corr_correct": evals[-1].get(f"val/{key}/corr_correct"),
        }
    found = outcomes(run)
    scored = [r for r in found.records if name in (r.get("rewards") or {})] if found is not None else []
    if scored:
        out |= {
            "length_step": found.step,
            "length_items": len(scored),
            "deciles": length_deciles(
                np.array([r["length"] for r in scored]),
                np.array([r["rewards"][name] for r in scored]),
                np.array([bool(r["correct"]) for r in scored]),
            ),
        }
    return out


def reward_models(runs: list[Run]) -> list[dict[str, Any]]:
    """``model_summary`` of every reward model of every run ([] when no run has one)."""
    return [model_summary(run, name) for run in runs for name in model_names(run)]
