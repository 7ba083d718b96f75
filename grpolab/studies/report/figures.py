"""The report's PNG figures (matplotlib, headless): one figure per metric against step with the runs
overlaid, validation accuracy with its item-bootstrap band, seconds per phase, pass@k and the paired
differences against the baseline.

Figures carry information or are not drawn: a metric with one value in every run at every step (the clip
fraction 0 and the ratio 1 of on-policy runs) becomes a line of report.md that gives the value; a phase
that never took a millisecond (a weight sync that hands over nothing) is a note in its panel and in
report.md; the other panels choose seconds or milliseconds by their largest value. Runs that coincide stay
visible: each run has its own colour, dash pattern and marker, and each run is drawn thinner than the one
before and on top of it, so a run equal to an earlier one shows as a thin line inside the earlier's
wider one."""

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
    ("engine_kl", "KL(engine || trainer), k3 on the engine's samples", "train", _key("rollout_kl_k3")),
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
BELOW_NOTE_SECONDS = 1e-3  # a phase that never took this long is noted, not plotted
MARKERS = ("o", "s", "^", "v", "D", "P", "X", "<", ">", "*")
DASHES = ("-", "--", "-.", ":")


def _points(records: list[dict[str, Any]], value: Series) -> tuple[list[int], list[float]]:
    pairs = [(r["step"], v) for r in records if (v := value(r)) is not None]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def run_styles(runs: list[Run]) -> dict[str, dict[str, Any]]:
    """A colour, dash pattern and marker per run, the same in every figure (the k-th run: the k-th of 10 colours,
    of 4 dash patterns, of 10 markers, so no two of the first 20 runs share all three), and a width and drawing
    order: each run thinner than the one before and drawn above it, so that coinciding lines all show."""
    colours = plt.get_cmap("tab10").colors
    n = max(len(runs), 1)
    return {
        run.name: {
            "color": colours[i % 10],
            "linestyle": DASHES[i % 4],
            "marker": MARKERS[i % 10],
            "linewidth": 1.0 + 2.0 * (n - 1 - i) / max(n - 1, 1),
            "zorder": 2 + i,
        }
        for i, run in enumerate(runs)
    }


def _plot(ax, steps: list[int], values: list[float], label: str, style: dict[str, Any]) -> None:
    """One run's line: its style, markers at about 12 points whatever the number of steps."""
    ax.plot(steps, values, label=label, markersize=3.5, markevery=max(1, len(steps) // 12), **style)


def constant(values: list[float]) -> float | None:
    """The one value of ``values`` when they are all equal (to float rounding), else None."""
    if not values:
        return None
    low, high = min(values), max(values)
    return low if high - low <= 1e-9 * max(1.0, abs(high)) else None


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


def metric_curves(
    runs: list[Run], out_dir: Path, styles: dict[str, dict[str, Any]], notes: list[str] | None = None
) -> list[tuple[str, str]]:
    """One figure per metric that some run logged; [(title, file name)]. A metric with a single value in every
    run at every step gets no figure: a line in ``notes`` gives the value."""
    made = []
    for stem, title, kind, value in CURVES:
        series = [(run.name, *_points(run.train if kind == "train" else run.evals, value)) for run in runs]
        if not any(steps for _, steps, _ in series):
            continue
        same = constant([v for _, _, values in series for v in values])
        if same is not None:
            if notes is not None:
                which = "the run" if len(runs) == 1 else f"all {sum(1 for _, s, _ in series if s)} runs"
                notes.append(f"{title}: {same:.6g} at every step of {which} (no figure)")
            continue
        fig, ax = _new(title)
        for name, steps, values in series:
            if steps:
                _plot(ax, steps, values, name, styles[name])
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
        ax.plot(steps, [b.estimate for b in bands], markersize=3.5, label=run.name, **styles[run.name])
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


def phase_seconds(
    runs: list[Run], out_dir: Path, styles: dict[str, dict[str, Any]], notes: list[str] | None = None
) -> tuple[str, str] | None:
    """Time per phase (generate, reward, train, sync) against step, one panel per phase, in seconds or, when the
    phase never took a second, milliseconds; a phase that never took ``BELOW_NOTE_SECONDS`` is a note in its
    panel and in ``notes`` instead of a line at the floor."""
    if not any(run.train for run in runs):
        return None
    fig, axes = plt.subplots(2, 2, figsize=(10, 6), sharex=True)
    for ax, key in zip(axes.flat, PHASES):
        phase = key.removeprefix("time/")
        ax.grid(alpha=0.3)
        series = [(run.name, *_points(run.train, _key(key))) for run in runs]
        longest = max((v for _, _, values in series for v in values), default=0.0)
        if longest < BELOW_NOTE_SECONDS:
            ax.set_title(f"{phase}: under {BELOW_NOTE_SECONDS * 1e3:g} ms")
            ax.text(0.5, 0.5, f"never over {longest * 1e3:.3f} ms: not drawn", ha="center", va="center")
            if notes is not None:
                notes.append(
                    f"seconds per phase: {phase} never took {BELOW_NOTE_SECONDS * 1e3:g} ms "
                    f"(at most {longest * 1e3:.3f} ms); its panel is a note"
                )
            continue
        scale, unit = time_unit(longest)
        ax.set_title(f"{phase} ({unit})")
        for name, steps, values in series:
            if steps:
                _plot(ax, steps, [v * scale for v in values], name, styles[name])
    fig.legend(*_handles(axes), fontsize=7, loc="upper left", bbox_to_anchor=(0.91, 0.9))
    for ax in axes[1]:
        ax.set_xlabel("step")
    return "time per phase", save_figure(fig, out_dir, "phase_seconds")


def time_unit(longest: float) -> tuple[float, str]:
    """(factor, unit) for a panel whose largest time is ``longest`` seconds: seconds from one second up, else ms."""
    return (1.0, "s") if longest >= 1.0 else (1e3, "ms")


def _handles(axes) -> tuple[list, list[str]]:
    """The legend entries of the panels, each run once (a panel that is a note has none)."""
    seen: dict[str, Any] = {}
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(label, handle)
    return list(seen.values()), list(seen)


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


def all_figures(runs: list[Run], data: dict[str, Any], out_dir: Path) -> tuple[list[tuple[str, str]], list[str]]:
    """Every figure as (title, file name), and the notes that stand for figures not drawn."""
    styles, notes = run_styles(runs), []
    made = [
        differences_figure(data["comparisons"], data["baseline"], out_dir),
        accuracy_curve(runs, out_dir, data["resamples"], data["seed"], styles),
        *metric_curves(runs, out_dir, styles, notes),
        phase_seconds(runs, out_dir, styles, notes),
        pass_at_k_figure(data["pass_at_k"], out_dir),
    ]
    return [m for m in made if m is not None], notes
