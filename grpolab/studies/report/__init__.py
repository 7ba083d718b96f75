"""``grpolab report DIR`` and ``grpolab compare RUN_A RUN_B``: results with paired confidence intervals.

``runs`` finds what is on disk, ``analysis`` turns the runs into numbers with ``grpolab.objectives.stats``,
``markdown`` and ``figures`` render them into DIR/report/, a folder ``folder`` marks as the report's own.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from grpolab.common.atomic import atomic_folder
from grpolab.common.progress import Reporter
from grpolab.objectives.stats import RESAMPLES
from grpolab.studies.report.analysis import analyse, comparison
from grpolab.studies.report.folder import REPORT_DIR, check_replaceable, mark
from grpolab.studies.report.runs import ReportError, Run, find_runs


def write_report(
    directory: Path, reporter: Reporter, baseline: str | None = None, resamples: int = RESAMPLES, seed: int = 0
) -> Path:
    """Write DIR/report/ (report.md, report.json, PNGs), replacing an earlier report as a whole. Raises
    ReportError, before anything is computed or written, when DIR/report exists and is not a report's
    own folder (no marker: a run directory, a user's folder, a file)."""
    from grpolab.studies.report.figures import all_figures  # matplotlib only when figures are drawn
    from grpolab.studies.report.markdown import render
    from grpolab.studies.report.routing import load_heatmaps

    directory = Path(directory)
    title, runs = find_runs(directory)
    target = directory / REPORT_DIR
    check_replaceable(target)
    with reporter.phase(f"report: statistics of {len(runs)} runs ({resamples:,} resamples)"):
        data = analyse(title, runs, baseline, resamples, seed)
    with atomic_folder(target, replace=check_replaceable) as tmp:  # checked again: something may have appeared
        mark(tmp)
        with reporter.phase("report: figures") as phase:
            figures, notes = all_figures(runs, data, tmp)
            figures += load_heatmaps(runs, tmp)
            phase.info = f"{len(figures)} figures" + (f", {len(notes)} flat series noted instead" if notes else "")
        data["figure_notes"] = notes
        (tmp / "report.md").write_text(render(data, figures))
        (tmp / "report.json").write_text(json.dumps(data, indent=2, default=str))
    return target / "report.md"


def _single_run(path: Path) -> Run:
    if not (path / "config.json").is_file():
        raise ReportError(f"{path}: not a run directory (no config.json)")
    return find_runs(path)[1][0]


def compare_runs(run_a: Path, run_b: Path, resamples: int = RESAMPLES, seed: int = 0) -> dict[str, Any]:
    """Run A's last evaluation against run B's, paired over their shared items."""
    a, b = _single_run(Path(run_a)), _single_run(Path(run_b))
    return comparison(a, b, resamples, seed)


__all__ = ["ReportError", "compare_runs", "write_report"]
