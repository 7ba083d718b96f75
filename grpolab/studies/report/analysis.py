"""Every number of a report, computed from the runs' files into plain dicts (written as report.json,
rendered by ``markdown``): the run table, paired comparisons with a baseline, the 2x2 interaction,
seed-level summaries, pass@k curves, reward models (``reward_models``) and failure examples. Seed groups
and the 2x2 pool runs only at a common step on shared items (``common``), and say which runs stopped early."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict
from typing import Any

import numpy as np

from grpolab.common.provenance import describe_cpu
from grpolab.objectives.stats import holm, interaction, mcnemar_exact, paired_difference, pass_at_k_curve, seed_summary
from grpolab.rollout.failures import failure_totals
from grpolab.run.health import HealthSettings, run_warnings
from grpolab.run.rundir import MANIFEST_FILE, wall_seconds
from grpolab.studies.report.common import Common, align, at_common_step, progress, steps_done  # noqa: F401 (align: re-exported)
from grpolab.studies.report.folder import read_json
from grpolab.studies.report.reward_models import reward_models
from grpolab.studies.report.runs import Outcomes, Run, outcomes, pair

FAILURE_KINDS = {  # what went wrong with an item; "failed": its rollout or reward failed (an unknown outcome)
    "wrong answer": lambda r: r["format_ok"] and not r["correct"] and not r.get("failed"),
    "bad format": lambda r: not r["format_ok"] and not r["truncated"] and not r.get("failed"),
    "truncated": lambda r: r["truncated"] and not r.get("failed"),
    "failed": lambda r: bool(r.get("failed")),
}


def run_row(run: Run) -> dict[str, Any]:
    """The run table's line: progress, start / final / best validation accuracy, final validation
    format rate, length and truncation, updates, tokens generated, wall time; ``skipped_lines`` (when
    not 0): unreadable lines of metrics.jsonl and the evaluation record files."""
    train, evals = run.train, run.evals
    row: dict[str, Any] = {
        "run": run.name,
        "state": run.state,
        "reason": run.reason,
        "algorithm": run.algorithm,
        "seed": run.seed,
        "steps_done": steps_done(run),
        "steps": run.total_steps,
    }
    if skipped := run.skipped_lines():
        row["skipped_lines"] = skipped
    if evals:
        first, last = evals[0], evals[-1]
        best = max(evals, key=lambda r: (r["val/accuracy"], -r["step"]))
        row |= {
            "start_accuracy": first["val/accuracy"] if first["step"] == 0 else None,
            "final_accuracy": last["val/accuracy"],
            "final_step": last["step"],
            "best_accuracy": best["val/accuracy"],
            "best_step": best["step"],
            "format_rate": last["val/format_rate"],
            "completion_len": last["val/completion_len_mean"],
            "truncation_rate": last["val/truncation_rate"],
        }
    if train:
        row |= {
            "attempted_updates": train[-1]["total_attempted_updates"],
            "actual_updates": train[-1]["total_actual_updates"],
            "tokens_generated": sum(r["response_tokens"] for r in train),
        }
        if failed := failure_totals(train):
            row["failed_samples"] = failed
    seconds = run.summary["wall_seconds"] if run.summary and "wall_seconds" in run.summary else wall_seconds(run.path)
    if seconds is not None:  # the one definition ``grpolab suite status`` shows too
        row["wall_seconds"] = seconds
    row["warnings"] = warnings_of(run)
    row["provenance"] = provenance_of(run)
    return row


def provenance_of(run: Run) -> dict[str, Any]:
    """When, where and on what code the run ran, from its manifest: the start date, and each distinct (grpolab
    commit, CPU, device, torch, transformers) of its sessions (a resume may run elsewhere); {} without one."""
    path = run.path / MANIFEST_FILE
    if not path.is_file():
        return {}
    manifest = read_json(path)
    places = []
    for session in manifest.get("sessions") or [{}]:
        where = session.get("where") or {}
        place = {"commit": where.get("grpolab_commit"), "cpu": describe_cpu(where.get("cpu"))}
        if place not in places:
            places.append(place)
    return {
        "started": manifest.get("started"),
        "places": places,
        "device": manifest.get("device"),
        "torch": manifest.get("torch"),
        "transformers": manifest.get("transformers"),
    }


def warnings_of(run: Run) -> list[dict[str, Any]]:
    """The run's warnings (``grpolab.run.health``): summary.json's list, else its metrics replayed (a run still
    running or stopped; ``finish`` only once it completed)."""
    if run.summary and "warnings" in run.summary:
        return run.summary["warnings"]
    found = run_warnings(run.metrics, HealthSettings.of_config(run.config), ended=run.state == "completed")
    return [w.record() for w in found]


def paired(a: Outcomes, b: Outcomes, resamples: int, seed: int) -> dict[str, Any]:
    """Outcomes ``a`` against ``b`` on the items both evaluated: accuracies, difference a - b with its
    paired bootstrap CI, discordant counts and the exact McNemar p-value."""
    matched = pair(a, b)
    out: dict[str, Any] = {
        "items": matched.shared,
        "unpaired_items": matched.only_one,
        "differing_prompts": matched.differing,
        "failed_items": matched.failed,
    }
    if matched.shared == 0:
        return out | {"note": "no items in common: not the same evaluation set"}
    diff = paired_difference(matched.a, matched.b, resamples, seed)
    test = mcnemar_exact(matched.a, matched.b)
    return out | {
        "accuracy": float(matched.a.mean()),
        "baseline_accuracy": float(matched.b.mean()),
        "difference": diff.estimate,
        "ci_low": diff.low,
        "ci_high": diff.high,
        "only_run_right": test.only_a,
        "only_baseline_right": test.only_b,
        "p_value": test.p_value,
    }


def comparison(run: Run, base: Run, resamples: int, seed: int) -> dict[str, Any]:
    """``run`` against ``base`` at each one's last evaluation."""
    a, b = outcomes(run), outcomes(base)
    if a is None or b is None:
        return {"run": run.name, "note": "no evaluation records yet"}
    return {"run": run.name, "step": a.step, "baseline_step": b.step, **paired(a, b, resamples, seed)}


def learning(run: Run, resamples: int, seed: int) -> dict[str, Any] | None:
    """The run's last evaluation against its first (the start model), on the same items: what training
    changed, with its CI and p-value. None before a second evaluation."""
    steps = run.eval_steps
    if len(steps) < 2:
        return None
    start, last = outcomes(run, steps[0]), outcomes(run, steps[-1])
    return {"run": run.name, "step": last.step, "baseline_step": start.step, **paired(last, start, resamples, seed)}


def _cells(declared: list[Run]) -> tuple[dict[str, list[str]], dict[tuple[int, int], list[Run]]] | str:
    """(factor -> its two levels, (i, j) -> the runs of cell (level i, level j)), or a note when the
    declared factors are not exactly two with two levels each."""
    names = list(declared[0].factors)
    levels = {f: list(dict.fromkeys(r.factors.get(f) for r in declared)) for f in names}
    if len(names) != 2 or any(list(r.factors) != names for r in declared) or any(len(v) != 2 for v in levels.values()):
        return "factors declared, but not exactly two factors with two levels each: " + ", ".join(
            f"{f}: {'/'.join(map(str, v))}" for f, v in levels.items()
        )
    (fa, la), (fb, lb) = levels.items()
    return levels, {
        (i, j): [r for r in declared if r.factors == {fa: la[i], fb: lb[j]}] for i in (0, 1) for j in (0, 1)
    }


def _cell_rows(common: Common, cells: dict[tuple[int, int], list[Run]]) -> dict[tuple[int, int], np.ndarray]:
    """Each cell's per-item mean correctness over its runs [items]; ``common`` holds the cells' runs in
    the order of ``cells``."""
    rows, start = {}, 0
    for key, members in cells.items():
        rows[key] = common.correct[start : start + len(members)].mean(axis=0)
        start += len(members)
    return rows


def factorial(runs: list[Run], resamples: int, seed: int) -> dict[str, Any] | None:
    """The 2x2 interaction when the runs that declare factors declare the same two, with two levels
    each. Every cell's evaluated runs are taken at their common step (the latest step all of them
    evaluated) on the items all of them evaluated; a cell with several runs (seeds) counts each item's
    mean correctness over them. Runs that stopped before the others are named in ``stopped_early``."""
    declared = [r for r in runs if r.factors]
    if not declared:
        return None
    found = _cells(declared)
    if isinstance(found, str):
        return {"note": found}
    levels, cells = found
    (fa, la), (fb, lb) = levels.items()
    out: dict[str, Any] = {
        "factors": {fa: la, fb: lb},
        "cells": {f"{la[i]} x {lb[j]}": [r.name for r in members] for (i, j), members in cells.items()},
    }
    evaluated = {key: [r for r in members if r.eval_steps] for key, members in cells.items()}
    waiting = [r.name for members in cells.values() for r in members if not r.eval_steps]
    if waiting:
        out["not_evaluated"] = waiting
    if any(not members for members in evaluated.values()):
        return out | {"note": "a cell has no evaluated run yet"}
    flat = [r for members in evaluated.values() for r in members]
    common = at_common_step(flat)
    made = progress(flat)
    out |= {
        "step": common.step,
        "stopped_early": made["stopped_early"],
        "last_eval_step": dict(zip([r.name for r in flat], made["last_eval_step"])),
        "configured_steps": dict(zip([r.name for r in flat], made["configured_steps"])),
    }
    if common.note:
        return out | {"note": common.note}
    rows = _cell_rows(common, evaluated)
    y00, y01, y10, y11 = rows[0, 0], rows[0, 1], rows[1, 0], rows[1, 1]
    effect = interaction(y00, y01, y10, y11, resamples, seed)
    simple = {
        f"{fa} {la[0]} -> {la[1]} at {fb} {lb[j]}": paired_difference(rows[1, j], rows[0, j], resamples, seed)
        for j in (0, 1)
    }
    simple |= {
        f"{fb} {lb[0]} -> {lb[1]} at {fa} {la[i]}": paired_difference(rows[i, 1], rows[i, 0], resamples, seed)
        for i in (0, 1)
    }
    return out | {
        "items": common.items,
        "items_per_run": dict(zip([r.name for r in flat], common.items_per_run)),
        "cell_accuracy": {f"{la[i]} x {lb[j]}": float(rows[i, j].mean()) for i in (0, 1) for j in (0, 1)},
        "interaction": asdict(effect),
        "simple_effects": {k: asdict(v) for k, v in simple.items()},
    }


def seed_group(members: list[Run], resamples: int, seed: int) -> dict[str, Any]:
    """Runs of the same settings at different seeds, each scored at their common step on their shared
    items: accuracy per seed, mean, std, a bootstrap CI over seeds and the Student-t CI; a ``note``
    instead of numbers when the runs have no step or no items in common."""
    common = at_common_step(members)
    out: dict[str, Any] = {
        "runs": [r.name for r in members],
        "seeds": [r.seed for r in members],
        "step": common.step,
        "items": common.items,
        **progress(members),
    }
    if common.note:
        return out | {"note": common.note}
    accuracy = [float(a) for a in common.correct.mean(axis=1)]
    summary = seed_summary(accuracy, resamples, seed)
    return out | {
        "items_per_run": common.items_per_run,
        "accuracy": accuracy,
        "mean": summary.mean,
        "std": summary.std,
        "ci_low": summary.interval.low,
        "ci_high": summary.interval.high,
        "t_low": summary.t_low,
        "t_high": summary.t_high,
    }


def seed_groups(runs: list[Run], resamples: int, seed: int) -> list[dict[str, Any]]:
    """Configurations run at several seeds (runs with evaluation records whose settings differ only in
    the seed), each summarised by ``seed_group``."""
    groups: dict[str, list[Run]] = defaultdict(list)
    for run in runs:
        if run.config and run.eval_steps:
            groups[run.setting_key()].append(run)
    return [seed_group(members, resamples, seed) for members in groups.values() if len({r.seed for r in members}) >= 2]


def pass_curves(run: Run) -> dict[int, dict[int, float]]:
    """pass@k curves (k -> mean unbiased pass@k) at the first and last evaluations with samples."""
    steps = [s for s in run.eval_steps if "pass_n" in next(iter(run.records(s)), {})]
    curves = {}
    for step in sorted({steps[0], steps[-1]}) if steps else []:
        records = run.records(step)
        samples = [r["pass_n"] for r in records]  # each item's samples that did not fail
        curves[step] = pass_at_k_curve(max(samples), [r["pass_correct"] for r in records], samples)
    return curves


def failures(run: Run, per_kind: int = 2) -> dict[str, list[dict[str, Any]]]:
    """A few failed items of the last evaluation, by kind."""
    found = outcomes(run)
    if found is None:
        return {}
    picked = {kind: [r for r in found.records if test(r)][:per_kind] for kind, test in FAILURE_KINDS.items()}
    questions = run.questions() if any(picked.values()) else {}
    return {kind: [{**r, "question": questions.get(r["id"])} for r in records] for kind, records in picked.items()}


TOOL_KEYS = ("call_rate", "valid_call_rate", "turns_mean", "accuracy_with_calls", "accuracy_without_calls")


def tool_use(run: Run) -> dict[str, Any] | None:
    """Tool use at the first and last evaluation (``val/tool/...``); None for a run without tools."""
    evals = [r for r in run.evals if "val/tool/call_rate" in r]
    if not evals:
        return None
    pick = lambda r: {k: r.get(f"val/tool/{k}") for k in TOOL_KEYS}  # noqa: E731
    return {
        "run": run.name,
        "first_step": evals[0]["step"],
        "first": pick(evals[0]),
        "last_step": evals[-1]["step"],
        "last": pick(evals[-1]),
    }


def analyse(title: str, runs: list[Run], baseline: str | None, resamples: int, seed: int) -> dict[str, Any]:
    """Everything the report says, as JSON-ready data."""
    names = [r.name for r in runs]
    if baseline is not None and baseline not in names:
        raise ValueError(f"--baseline {baseline!r} is not a run here; runs: {', '.join(names)}")
    base = next(r for r in runs if r.name == (baseline or names[0]))
    comparisons = [comparison(r, base, resamples, seed) for r in runs if r is not base]
    tested = [c for c in comparisons if "p_value" in c]
    for c, adjusted in zip(tested, holm([c["p_value"] for c in tested])):
        c["p_holm"] = adjusted
    return {
        "title": title,
        "resamples": resamples,
        "seed": seed,
        "baseline": base.name,
        "runs": [run_row(r) for r in runs],
        "comparisons": comparisons,
        "learning": [found for r in runs if (found := learning(r, resamples, seed))],
        "factorial": factorial(runs, resamples, seed),
        "seed_groups": seed_groups(runs, resamples, seed),
        "pass_at_k": {r.name: curves for r in runs if (curves := pass_curves(r))},
        "failures": {r.name: f for r in runs if (f := failures(r))},
        "tool_use": [found for r in runs if (found := tool_use(r))],
        "reward_models": reward_models(runs),
    }
