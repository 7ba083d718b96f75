"""report.md from the analysis (``analysis.analyse``) and the figures written beside it."""

from __future__ import annotations

from typing import Any

from grpolab.common.progress import format_seconds
from grpolab.studies.report.decisions import decision_section

SEED_CAVEAT = (
    "Item-level intervals resample the evaluation items of one trained model each; they do not "
    "cover training-seed variance (another seed can move a run by more than its item CI). Compare "
    "configurations across seeds with the seed-level table."
)


def num(value: Any, fmt: str = ".3f") -> str:
    return "-" if value is None else format(value, fmt)


def ci(low: float, high: float, fmt: str = "+.3f") -> str:
    return f"[{num(low, fmt)}, {num(high, fmt)}]"


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]


def run_table(rows: list[dict[str, Any]]) -> list[str]:
    header = [
        "run",
        "state",
        "algorithm",
        "seed",
        "steps",
        "start acc",
        "final acc",
        "best acc (step)",
        "format",
        "mean len",
        "truncated",
        "updates actual/attempted",
        "tokens generated",
        "wall time",
    ]
    lines = []
    for r in rows:
        best = f"{num(r.get('best_accuracy'))} ({r['best_step']})" if "best_step" in r else "-"
        final = num(r.get("final_accuracy")) + (
            f" (step {r['final_step']})" if r.get("final_step") != r["steps"] and "final_step" in r else ""
        )
        updates = f"{r['actual_updates']}/{r['attempted_updates']}" if "actual_updates" in r else "-"
        lines.append(
            [
                r["run"],
                r["state"],
                r["algorithm"],
                str(r["seed"]),
                f"{r['steps_done']}/{r['steps'] or '-'}",
                num(r.get("start_accuracy")),
                final,
                best,
                num(r.get("format_rate")),
                num(r.get("completion_len"), ".1f"),
                num(r.get("truncation_rate")),
                updates,
                str(r.get("tokens_generated", "-")),
                format_seconds(r["wall_seconds"]) if "wall_seconds" in r else "-",
            ]
        )
    return table(header, lines)


def provenance_table(rows: list[dict[str, Any]]) -> list[str]:
    """When, on what code and where each run ran (a figure is only comparable with its date, commit and CPU)."""
    lines = []
    for r in rows:
        p = r.get("provenance") or {}
        places = p.get("places") or [{}]
        lines.append(
            [
                r["run"],
                str(p.get("started") or "-"),
                "; ".join(place.get("commit") or "-" for place in places),
                "; ".join(place.get("cpu") or "-" for place in places),
                str(p.get("device") or "-"),
                f"{p.get('torch') or '-'} / {p.get('transformers') or '-'}",
            ]
        )
    return table(["run", "started", "grpolab commit", "CPU", "device", "torch / transformers"], lines)


def skipped_notes(rows: list[dict[str, Any]]) -> list[str]:
    """One line per run whose files had unreadable lines (the run table's ``skipped_lines``), and one per run with
    failed samples (``failed_samples``: their rollout or reward failed, so they trained nothing)."""
    return [
        f"- run {r['run']}: {n} unreadable line{'s' if n > 1 else ''} skipped in metrics.jsonl or the evaluation "
        f"records ({'lines' if n > 1 else 'a line'} torn by a kill, or being written)"
        for r in rows
        if (n := r.get("skipped_lines"))
    ] + [
        f"- run {r['run']}: {sum(failed.values())} training samples failed and trained nothing ("
        + ", ".join(f"{kind} {n}" for kind, n in failed.items())
        + ")"
        for r in rows
        if (failed := r.get("failed_samples"))
    ]


def warnings_section(rows: list[dict[str, Any]]) -> list[str]:
    """Each run's warnings (``grpolab.run.health``): key, the step it first fired, its numbers, the likely cause
    and the setting to look at; nothing when no run warned."""
    found = [(r["run"], w) for r in rows for w in r.get("warnings", [])]
    if not found:
        return []
    out = [
        "## Warnings",
        "",
        "Signs that a run could not learn, each at the step it first showed (docs/running.md).",
        "",
    ]
    for run, w in found:
        numbers = ", ".join(f"{k} {v:g}" if isinstance(v, float) else f"{k} {v}" for k, v in w["evidence"].items())
        out.append(
            f"- **{run}**, step {w['step']}, `{w['key']}`: {w['what']} ({numbers}). "
            f"Likely cause: {w['cause']}. Look at: {w['setting']}."
        )
    return out + [""]


def flagged(names: list[str], early: list[str]) -> list[str]:
    """Run names, those that stopped early marked with ``*``."""
    return [f"{n}*" if n in early else n for n in names]


def early_note(early: list[str], last: dict[str, Any], configured: dict[str, Any], step: Any) -> list[str]:
    """The footnote of ``flagged``: where each early-stopped run last evaluated."""
    if not early:
        return []
    return [
        "",
        "\\* stopped early (or not finished): "
        + "; ".join(f"{n} last evaluated at step {last.get(n)} of {configured.get(n) or '?'}" for n in early)
        + (f"; every run is taken at step {step}, the latest step all of them evaluated." if step is not None else "."),
    ]


def learning_table(rows: list[dict[str, Any]]) -> list[str]:
    header = [
        "run",
        "steps",
        "items",
        "start acc",
        "final acc",
        "gain",
        "95% CI",
        "right only at the end",
        "right only at the start",
        "McNemar p",
    ]
    return table(
        header,
        [
            [
                c["run"],
                f"{c['baseline_step']} -> {c['step']}",
                str(c["items"]),
                num(c["baseline_accuracy"]),
                num(c["accuracy"]),
                num(c["difference"], "+.3f"),
                ci(c["ci_low"], c["ci_high"]),
                str(c["only_run_right"]),
                str(c["only_baseline_right"]),
                num(c["p_value"], ".3g"),
            ]
            for c in rows
            if "difference" in c
        ],
    )


def comparison_table(data: dict[str, Any]) -> list[str]:
    header = [
        "run",
        "step",
        "items",
        "run acc",
        "baseline acc",
        "difference",
        "95% CI",
        "run only right",
        "baseline only right",
        "McNemar p",
        "Holm p",
    ]
    rows, notes = [], []
    for c in data["comparisons"]:
        if "difference" not in c:
            notes.append(f"- {c['run']}: {c['note']}")
            continue
        rows.append(
            [
                c["run"],
                f"{c['step']} vs {c['baseline_step']}",
                str(c["items"]),
                num(c["accuracy"]),
                num(c["baseline_accuracy"]),
                num(c["difference"], "+.3f"),
                ci(c["ci_low"], c["ci_high"]),
                str(c["only_run_right"]),
                str(c["only_baseline_right"]),
                num(c["p_value"], ".3g"),
                num(c["p_holm"], ".3g"),
            ]
        )
        if c["unpaired_items"] or c["differing_prompts"] or c.get("failed_items"):
            notes.append(
                f"- {c['run']}: {c['unpaired_items']} items evaluated by one run only, "
                f"{c['differing_prompts']} with a different prompt and {c.get('failed_items', 0)} whose "
                "evaluation failed in either run were left out of the pairing"
            )
    return (table(header, rows) if rows else []) + notes


def factorial_section(f: dict[str, Any]) -> list[str]:
    if "factors" not in f:
        return [f["note"] + "."]
    (fa, la), (fb, lb) = f["factors"].items()
    early = f.get("stopped_early", [])
    lines = [
        f"Factors: {fa} ({' / '.join(la)}) x {fb} ({' / '.join(lb)}); cells: "
        + "; ".join(f"{cell}: {', '.join(flagged(names, early)) or 'none'}" for cell, names in f["cells"].items())
        + "."
    ]
    if f.get("not_evaluated"):
        lines += ["", f"Not evaluated yet, left out: {', '.join(f['not_evaluated'])}."]
    notes = early_note(early, f.get("last_eval_step", {}), f.get("configured_steps", {}), f.get("step"))
    if "note" in f:
        return lines + ["", f["note"] + "."] + notes
    e = f["interaction"]
    lines += [
        "",
        *table(["cell", "accuracy"], [[k, num(v)] for k, v in f["cell_accuracy"].items()]),
        "",
        *table(
            ["effect", "estimate", "95% CI"],
            [[k, num(v["estimate"], "+.3f"), ci(v["low"], v["high"])] for k, v in f["simple_effects"].items()]
            + [
                [
                    f"interaction ({fa} change at {fb} {lb[1]} minus at {fb} {lb[0]})",
                    num(e["estimate"], "+.3f"),
                    ci(e["low"], e["high"]),
                ]
            ],
        ),
        "",
        f"At step {f['step']} (the latest step every cell's runs evaluated), paired over the {f['items']} "
        "items all of them evaluated with the same prompt; a cell with several runs counts each item's mean "
        "correctness over them. An interaction CI that excludes 0 says the two changes do not simply add up.",
        *notes,
    ]
    return lines


def seed_section(groups: list[dict[str, Any]]) -> list[str]:
    rows, notes = [], []
    for g in groups:
        early = g["stopped_early"]
        names = ", ".join(flagged(g["runs"], early))
        if "note" in g:
            rows.append([names, ", ".join(map(str, g["seeds"])), "-", "-", "-", "-", "-", "-", "-"])
            notes += ["", f"- {names}: {g['note']}."]
        else:
            rows.append(
                [
                    names,
                    ", ".join(map(str, g["seeds"])),
                    str(g["step"]),
                    str(g["items"]),
                    ", ".join(num(a) for a in g["accuracy"]),
                    num(g["mean"]),
                    num(g["std"]),
                    ci(g["ci_low"], g["ci_high"], ".3f"),
                    ci(g["t_low"], g["t_high"], ".3f"),
                ]
            )
        notes += early_note(
            early, dict(zip(g["runs"], g["last_eval_step"])), dict(zip(g["runs"], g["configured_steps"])), g["step"]
        )
    return (
        table(
            [
                "runs (same settings)",
                "seeds",
                "step",
                "items",
                "accuracy",
                "mean",
                "std",
                "seed bootstrap 95% CI",
                "Student-t 95% CI",
            ],
            rows,
        )
        + notes
        + [
            "",
            "Each seed's accuracy is taken at the group's common step (the latest step every seed evaluated) on "
            "the items all of them evaluated with the same prompt. The seed bootstrap resamples the training seeds: "
            "it can never be wider than their range, so with a handful of seeds it understates the uncertainty; "
            "the Student-t interval (seeds assumed normal) is the more cautious reading. Both need more seeds to be "
            "tight.",
        ]
    )


def pass_section(curves: dict[str, dict[int, dict[int, float]]]) -> list[str]:
    lines = []
    for name, by_step in curves.items():
        ks = sorted({k for c in by_step.values() for k in c})
        lines += [
            f"**{name}**",
            "",
            *table(
                ["step", *[f"pass@{k}" for k in ks]],
                [[str(s), *[num(c.get(k)) for k in ks]] for s, c in by_step.items()],
            ),
            "",
        ]
    return lines


def tool_section(rows: list[dict[str, Any]]) -> list[str]:
    header = ["run", "step", "tool-call rate", "valid calls", "turns", "acc. with a valid call", "acc. without"]
    lines = [
        [
            r["run"],
            str(r[f"{when}_step"]),
            *(
                num(r[when][k], ".2f" if k == "turns_mean" else ".3f")
                for k in ("call_rate", "valid_call_rate", "turns_mean", "accuracy_with_calls", "accuracy_without_calls")
            ),
        ]
        for r in rows
        for when in ("first", "last")
    ]
    return table(header, lines)


REWARD_MODEL_NOTE = (
    "Raw scores of each reward model over the training step's samples (the last step that scored them) and over "
    "the final evaluation's greedy completions; corr: their Pearson correlation with the verifier's correctness "
    "(- when either is constant), its change from the first to the last step with one. A correlation that falls "
    "while the score rises is the first sign of reward hacking."
)
LENGTH_NOTE = (
    "Items are ranked by completion length and cut into ten groups of near-equal size (equal lengths may fall in "
    "two adjacent groups). A mean score that rises with length while accuracy does not is a length bias of the "
    "reward model."
)


def _corr_change(row: dict[str, Any]) -> str:
    if "corr_change" not in row:
        return "-"
    return f"{num(row['corr_change'], '+.3f')} ({row['corr_first_step']} -> {row['corr_last_step']})"


def reward_model_section(rows: list[dict[str, Any]]) -> list[str]:
    """The reward models' table and, per run and model, its score by completion length decile."""
    header = [
        "run",
        "model",
        "step",
        "mean",
        "std",
        "min",
        "max",
        "corr",
        "corr change (steps)",
        "eval step",
        "eval mean",
        "eval corr",
    ]
    stats = ("mean", "std", "min", "max", "corr_correct")
    lines = [
        "",
        REWARD_MODEL_NOTE,
        "",
        *table(
            header,
            [
                [
                    r["run"],
                    r["model"],
                    str(r.get("step", "-")),
                    *(num(r.get(k)) for k in stats),
                    _corr_change(r),
                    str(r.get("eval_step", "-")),
                    num(r.get("eval_mean")),
                    num(r.get("eval_corr_correct")),
                ]
                for r in rows
            ],
        ),
    ]
    for r in rows:
        if r.get("deciles"):
            title = (
                f"**{r['run']} / {r['model']}**: score by completion length decile, evaluation at step "
                f"{r['length_step']} ({r['length_items']} items)"
            )
            lines += [
                "",
                title,
                "",
                *table(
                    ["decile", "length (tokens)", "items", "mean score", "accuracy"],
                    [
                        [
                            str(d["decile"]),
                            f"{d['min_length']}-{d['max_length']}",
                            str(d["items"]),
                            num(d["mean_score"]),
                            num(d["accuracy"]),
                        ]
                        for d in r["deciles"]
                    ],
                ),
            ]
    return lines + ["", LENGTH_NOTE]


def _tool_note(record: dict[str, Any]) -> str:
    calls = record.get("tool_calls") or []
    if not calls:
        return ""
    errors = [c["error"] for c in calls if c["error"]]
    return f", {len(calls)} tool call(s) in {record['turns']} turns" + (
        f" (errors: {'; '.join(errors)})" if errors else ""
    )


def failure_section(failures: dict[str, dict[str, list[dict[str, Any]]]], limit: int = 600) -> list[str]:
    lines = []
    for name, kinds in failures.items():
        lines.append(f"**{name}**")
        for kind, records in kinds.items():
            for r in records:
                text = r["completion"] if len(r["completion"]) <= limit else r["completion"][:limit] + " [...]"
                question = f" {r['question']!r}" if r.get("question") else ""
                lines += [
                    "",
                    f"- {kind}: item `{r['id']}`{question}, gold `{r['gold']}`, extracted "
                    f"`{r['extracted']}`, {r['length']} tokens{_tool_note(r)}",
                    "",
                    "  ```",
                    *[f"  {t}" for t in text.splitlines() or [""]],
                    "  ```",
                ]
        lines.append("")
    return lines


def render(data: dict[str, Any], figures: list[tuple[str, str]]) -> str:
    """The whole report.md; ``figures`` are (title, file name in the report folder)."""
    out = [
        f"# Report: {data['title']}",
        "",
        f"Intervals: percentile bootstrap, {data['resamples']:,} resamples, seed {data['seed']}; p-values: exact "
        "McNemar (two-sided binomial test on the discordant items), and Holm-adjusted over the comparisons "
        "with the baseline (family-wise error).",
        "",
    ]
    unfinished = [r for r in data["runs"] if r["state"] != "completed"]
    if unfinished:
        out += [
            "Not complete: "
            + "; ".join(
                f"{r['run']} is {r['state']}" + (f" ({r['reason']})" if r["reason"] else "") for r in unfinished
            )
            + ". Their numbers are those of what exists.",
            "",
        ]
    skipped = skipped_notes(data["runs"])
    out += [
        "## Runs",
        "",
        *run_table(data["runs"]),
        "",
        *skipped,
        *([""] if skipped else []),
        "Accuracy is greedy validation accuracy; format, mean length and truncation are of the final evaluation.",
        "",
        "Where and when (from each run's manifest; a resumed run lists each place it ran):",
        "",
        *provenance_table(data["runs"]),
        "",
    ]
    out += warnings_section(data["runs"])
    if data.get("decisions"):
        out += ["## Decisions", "", *decision_section(data["decisions"]), ""]
    if data["learning"]:
        out += [
            "## What training changed",
            "",
            "Each run's last evaluation against its first (the start model), paired over the same items.",
            "",
            *learning_table(data["learning"]),
            "",
        ]
    if data["comparisons"]:
        out += [
            f"## Paired comparisons against {data['baseline']}",
            "",
            "Each run's last evaluation against the baseline's, item by item on the items both evaluated.",
            "",
            *comparison_table(data),
            "",
            SEED_CAVEAT,
            "",
        ]
    if data["factorial"]:
        out += ["## 2x2 interaction", "", *factorial_section(data["factorial"]), ""]
    if data["seed_groups"]:
        out += ["## Across training seeds", "", *seed_section(data["seed_groups"]), ""]
    if data["pass_at_k"]:
        out += ["## pass@k (sampled, unbiased estimator)", "", *pass_section(data["pass_at_k"])]
    out += ["## Figures", ""] + [line for title, name in figures for line in (f"![{title}]({name})", "")]
    if data.get("figure_notes"):
        out += ["Not drawn, as a figure would show nothing more:", ""]
        out += [f"- {note}" for note in data["figure_notes"]] + [""]
    if data.get("tool_use"):
        out += [
            "## Tool use",
            "",
            "Greedy validation trajectories at the first and last evaluation; accuracy split by "
            "whether a trajectory made a valid tool call.",
            "",
            *tool_section(data["tool_use"]),
            "",
        ]
    if data.get("reward_models"):
        out += ["## Reward models", *reward_model_section(data["reward_models"]), ""]
    if data["failures"]:
        out += ["## Failure examples (last evaluation)", "", *failure_section(data["failures"])]
    return "\n".join(out).rstrip() + "\n"
