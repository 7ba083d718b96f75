"""The report's figures of Mixture-of-Experts runs: each run's expert load per layer over its steps."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np

from grpolab.studies.report.figures import plt, save_figure
from grpolab.studies.report.runs import Run

LOAD_KEY = re.compile(r"router/layer(\d+)/load$")


def layer_loads(run: Run) -> tuple[list[int], dict[int, np.ndarray]]:
    """(steps, {layer: loads [E, steps]}): the share of routed completion tokens each expert took at each
    training step of ``run`` (its ``router/layerN/load`` lists); empty for a dense run."""
    layers = sorted({int(m.group(1)) for r in run.train for k in r if (m := LOAD_KEY.match(k))})
    if not layers:
        return [], {}
    rows = [r for r in run.train if f"router/layer{layers[0]}/load" in r]
    return [r["step"] for r in rows], {
        layer: np.array([r[f"router/layer{layer}/load"] for r in rows]).T for layer in layers
    }


def load_heatmaps(runs: list[Run], out_dir: Path) -> list[tuple[str, str]]:
    """Per MoE run, one figure: a heatmap per layer (experts x steps, colour = load; 1/E is balanced)."""
    made = []
    for run in runs:
        steps, loads = layer_loads(run)
        if not loads:
            continue
        cols = min(4, len(loads))
        rows = math.ceil(len(loads) / cols)
        fig, axes = plt.subplots(rows, cols, figsize=(3.4 * cols, 2.6 * rows), squeeze=False)
        peak = max(float(v.max()) for v in loads.values())
        for ax, (layer, grid) in zip(axes.flat, loads.items()):
            image = ax.imshow(
                grid,
                aspect="auto",
                origin="lower",
                interpolation="nearest",
                cmap="viridis",
                vmin=0,
                vmax=peak,
                extent=(steps[0] - 0.5, steps[-1] + 0.5, -0.5, grid.shape[0] - 0.5),
            )
            ax.set_title(f"layer {layer}", fontsize=8)
            ax.set_xlabel("step", fontsize=7)
            ax.set_ylabel("expert", fontsize=7)
            ax.tick_params(labelsize=6)
        for ax in list(axes.flat)[len(loads) :]:
            ax.axis("off")
        experts = next(iter(loads.values())).shape[0]
        fig.colorbar(image, ax=axes, shrink=0.8, label=f"share of routed tokens (balanced: 1/{experts})")
        fig.suptitle(f"{run.name}: expert load per layer", y=1.04)
        title = f"{run.name}: expert load per layer over steps"
        made.append((title, save_figure(fig, out_dir, "router_load_" + re.sub(r"[^A-Za-z0-9_.-]", "_", run.name))))
    return made
