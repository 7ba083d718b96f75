"""The report's figures carry information: a flat series is a line of report.md, not a flat figure; a phase that
never took a millisecond is a note, the others are drawn in a readable unit; runs that coincide stay visible.
On metrics files written here (the real runs' report: test_report.py)."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib.pyplot as plt
from matplotlib import image

from grpolab.studies.report.figures import all_figures, run_styles, time_unit
from grpolab.studies.report.runs import Run

DATA = {"comparisons": [], "baseline": None, "resamples": 10_000, "seed": 0, "pass_at_k": {}}


def write_run(folder: Path, reward: list[float], sync: float = 2e-5) -> Run:
    """A run directory with one training record per step: clip fraction 0 and ratio 1 at every step (on-policy)."""
    folder.mkdir(parents=True)
    records = [
        {
            "step": step,
            "reward_mean": r,
            "clip_low_frac": 0.0,
            "clip_high_frac": 0.0,
            "ratio_mean": 1.0,
            "entropy": 1.0 + 0.1 * step,
            "time/generate": 0.4 + 0.01 * step,
            "time/reward": 0.002,
            "time/train": 2.0 + 0.1 * step,
            "time/sync": sync,
        }
        for step, r in enumerate(reward, start=1)
    ]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return Run(folder.name, folder, "completed")


def test_flat_series_become_notes_that_give_their_value(tmp_path):
    runs = [write_run(tmp_path / "a", [0.1, 0.3, 0.5, 0.6]), write_run(tmp_path / "b", [0.2, 0.2, 0.4, 0.7])]
    out = tmp_path / "report"
    out.mkdir()
    figures, notes = all_figures(runs, DATA, out)
    names = {name for _, name in figures}
    assert {"reward.png", "entropy.png", "phase_seconds.png"} <= names
    assert not {"clip_fraction.png", "ratio_mean.png"} & names
    assert not (out / "clip_fraction.png").exists()
    assert "clip fraction (low + high): 0 at every step of all 2 runs (no figure)" in notes
    assert "importance ratio (mean): 1 at every step of all 2 runs (no figure)" in notes
    assert "seconds per phase: sync never took 1 ms (at most 0.020 ms); its panel is a note" in notes
    assert not any(note.startswith(("train reward", "entropy", "seconds per phase: reward")) for note in notes)
    # a metric flat in one run but not the other is drawn
    runs.append(write_run(tmp_path / "c", [0.1, 0.2, 0.3, 0.4], sync=0.004))
    figures, notes = all_figures(runs, DATA, out)
    assert not any("sync" in note for note in notes)


def test_each_panel_reads_in_seconds_or_milliseconds():
    assert time_unit(0.004) == (1e3, "ms") and time_unit(0.9) == (1e3, "ms")
    assert time_unit(1.0) == (1.0, "s") and time_unit(250.0) == (1.0, "s")


def test_runs_that_coincide_stay_visible(tmp_path):
    """Every run has its own colour, dash pattern and marker (the first 20 share no triple), and is drawn thinner
    than the one before and above it: a copy of a run shows as a thin line of its own colour inside the first's."""
    styles = list(run_styles([Run(f"r{i}", tmp_path, "completed") for i in range(20)]).values())
    assert len({(s["color"], s["linestyle"], s["marker"]) for s in styles}) == 20
    widths, orders = [s["linewidth"] for s in styles], [s["zorder"] for s in styles]
    assert widths == sorted(widths, reverse=True) and len(set(widths)) == 20 and orders == sorted(set(orders))
    # two runs with the same rewards: both colours are in the reward figure's axes (the first's under the second's)
    runs = [write_run(tmp_path / "a", [0.1, 0.5, 0.3, 0.8]), write_run(tmp_path / "b", [0.1, 0.5, 0.3, 0.8])]
    out = tmp_path / "report"
    out.mkdir()
    all_figures(runs, DATA, out)
    pixels = image.imread(out / "reward.png")[:, :, :3]
    plot_area = pixels[:, : int(pixels.shape[1] * 0.75)]  # left of the legend, which shows both anyway
    for colour in plt.get_cmap("tab10").colors[:2]:
        near = (abs(plot_area - colour) < 0.08).all(axis=-1)
        assert near.sum() > 50, colour
