"""The report's PNG figures (matplotlib, headless): one figure per metric against step with the runs
overlaid, validation accuracy with its item-bootstrap band, seconds per phase, pass@k and the paired
differences against the baseline."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after the headless backend is chosen)

from grpolab.objectives.stats import mean_interval  # noqa: E402
from grpolab.studies.report.runs import Run  # noqa: E402

Series = Callable[[dict[str, Any]], float | None]


def _key(name: str) -> Series:
    return lambda r: r.get(name)


def _clip(r: dict[str, Any]) -> float | None:
    if "clip_low_frac" not in r:
        return None
    return r["clip_low_frac"] + r.get("clip_high_frac", 0.0)


# (file stem, title, which records: train or val, value of a record)
CURVES: list[tuple[str, str, str, Series]] = [
    ("reward", "train reward (mean)", "train", _key("reward_mean")),
    ("val_format_rate", "validation format rate", "val", _key("val/format_rate")),
    ("train_format_rate", "train format rate", "train", _key("format_rate")),
    ("clip_fraction", "clip fraction (low + high)", "train", _clip),
    ("ratio_mean", "importance ratio (mean)", "train", _key("ratio_mean")),
    ("kl_ref", "KL to the reference", "train", _key("kl_ref")),
    ("entropy", "entropy (mean per token)", "train", _key("entropy")),
    ("completion_length", "completion length (mean tokens)", "train", _key("completion_len_mean")),
    ("truncation_rate", "truncation rate", "train", _key("truncation_rate")),
    ("grad_norm", "grad norm (before clipping)", "train", _key("grad_norm")),
    (
        "router_violation",
        "MoE: worst expert-load violation (max load / mean load - 1)",
        "train",
        _key("router/load_max_violation"),
    ),
    ("router_confidence", "MoE: routing confidence (mass of the selected experts)", "train", _key("router/confidence")),
    ("router_entropy", "MoE: router entropy (nats)", "train", _key("router/entropy")),
    ("router_aux_loss", "MoE: load-balancing loss (k when balanced)", "train", _key("router/aux_loss")),
    (
        "router_mismatch",
        "MoE: routing mismatch, training forwards vs the record (engine or old forward)",
        "train",
        _key("router/mismatch"),
    ),
    (
        "val_router_violation",
        "MoE: worst expert-load violation (validation, greedy)",
        "val",
        _key("val/router/load_max_violation"),
    ),
    ("tool_call_rate", "tool-call rate (validation, greedy)", "val", _key("val/tool/call_rate")),
    (
        "tool_accuracy",
        "accuracy of trajectories with a valid tool call (validation)",
        "val",
        _key("val/tool/accuracy_with_calls"),
    ),
]
PHASES = ["time/generate", "time/reward", "time/train", "time/sync"]


def _points(records: list[dict[str, Any]], value: Series) -> tuple[list[int], list[float]]:
    pairs = [(r["step"], v) for r in records if (v := value(r)) is not None]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def run_styles(runs: list[Run]) -> dict[str, dict[str, Any]]:
    """A colour and line style per run, the same in every figure (10 colours, then dashed, then dotted)."""
    colours = plt.get_cmap("tab10").colors
    return {
        run.name: {"color": colours[i % 10], "linestyle": ("-", "--", ":")[i // 10 % 3]} for i, run in enumerate(runs)
    }


def _legend(ax) -> None:
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))


def save_figure(fig, out_dir: Path, stem: str) -> str:
    name = f"{stem}.png"
    fig.savefig(out_dir / name, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return name


def _new(title: str, xlabel: str = "step"):
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.grid(alpha=0.3)
    return fig, ax


def metric_curves(runs: list[Run], out_dir: Path, styles: dict[str, dict[str, Any]]) -> list[tuple[str, str]]:
    """One figure per metric that some run logged; [(title, file name)]."""
    made = []
    for stem, title, kind, value in CURVES:
        series = [(run.name, *_points(run.train if kind == "train" else run.evals, value)) for run in runs]
        if not any(steps for _, steps, _ in series):
            continue
        fig, ax = _new(title)
        for name, steps, values in series:
            if steps:
                ax.plot(steps, values, label=name, linewidth=1.2, **styles[name])
        _legend(ax)
        made.append((title, save_figure(fig, out_dir, stem)))
    return made


def accuracy_curve(
    runs: list[Run], out_dir: Path, resamples: int, seed: int, styles: dict[str, dict[str, Any]]
) -> tuple[str, str] | None:
    """Validation accuracy against step, each point with its item-bootstrap 95% band."""
    fig, ax = _new("validation accuracy (greedy) with item-bootstrap 95% band")
    drawn = False
    for run in runs:
        steps = run.eval_steps
        if not steps:
            continue
        bands = [mean_interval([float(r["correct"]) for r in run.records(s)], resamples, seed) for s in steps]
        ax.plot(
            steps,
            [b.estimate for b in bands],
            marker="o",
            markersize=3,
            linewidth=1.2,
            label=run.name,
            **styles[run.name],
        )
        ax.fill_between(
            steps, [b.low for b in bands], [b.high for b in bands], color=styles[run.name]["color"], alpha=0.12
        )
        drawn = True
    if not drawn:
        plt.close(fig)
        return None
    ax.set_ylim(-0.02, 1.02)
    _legend(ax)
    return "validation accuracy", save_figure(fig, out_dir, "val_accuracy")


def phase_seconds(runs: list[Run], out_dir: Path, styles: dict[str, dict[str, Any]]) -> tuple[str, str] | None:
    """Seconds per phase (generate, reward, train, sync) against step, one panel per phase."""
    if not any(run.train for run in runs):
        return None
    fig, axes = plt.subplots(2, 2, figsize=(10, 6), sharex=True)
    for ax, key in zip(axes.flat, PHASES):
        ax.set_title(f"seconds: {key.removeprefix('time/')}")
        ax.grid(alpha=0.3)
        for run in runs:
            steps, values = _points(run.train, _key(key))
            if steps:
                ax.plot(steps, values, label=run.name, linewidth=1, **styles[run.name])
    axes.flat[1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    for ax in axes[1]:
        ax.set_xlabel("step")
    return "seconds per phase", save_figure(fig, out_dir, "phase_seconds")


def pass_at_k_figure(curves: dict[str, dict[int, dict[int, float]]], out_dir: Path) -> tuple[str, str] | None:
    if not curves:
        return None
    fig, ax = _new("pass@k (sampled, unbiased estimator)", xlabel="k")
    for name, by_step in curves.items():
        for step, curve in by_step.items():
            ax.plot(list(curve), list(curve.values()), marker="o", markersize=3, label=f"{name} step {step}")
    ax.set_xscale("log", base=2)
    _legend(ax)
    return "pass@k", save_figure(fig, out_dir, "pass_at_k")


def differences_figure(comparisons: list[dict[str, Any]], baseline: str, out_dir: Path) -> tuple[str, str] | None:
    """Each run's paired accuracy difference against the baseline with its 95% CI."""
    shown = [c for c in comparisons if "difference" in c]
    if not shown:
        return None
    fig, ax = plt.subplots(figsize=(7, 0.9 + 0.35 * len(shown)))
    ys = range(len(shown))
    ax.errorbar(
        [c["difference"] for c in shown],
        ys,
        fmt="o",
        capsize=3,
        xerr=[[c["difference"] - c["ci_low"] for c in shown], [c["ci_high"] - c["difference"] for c in shown]],
    )
    ax.axvline(0.0, color="grey", linewidth=1)
    ax.set_yticks(list(ys), [c["run"] for c in shown])
    ax.invert_yaxis()
    ax.set_xlabel(f"validation accuracy minus {baseline}'s (paired items, 95% bootstrap CI)")
    ax.grid(alpha=0.3, axis="x")
    return f"difference against {baseline}", save_figure(fig, out_dir, "differences")


def all_figures(runs: list[Run], data: dict[str, Any], out_dir: Path) -> list[tuple[str, str]]:
    styles = run_styles(runs)
    made = [
        differences_figure(data["comparisons"], data["baseline"], out_dir),
        accuracy_curve(runs, out_dir, data["resamples"], data["seed"], styles),
        *metric_curves(runs, out_dir, styles),
        phase_seconds(runs, out_dir, styles),
        pass_at_k_figure(data["pass_at_k"], out_dir),
    ]
    return [m for m in made if m is not None]
