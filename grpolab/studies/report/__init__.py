"""``grpolab report DIR`` and ``grpolab compare RUN_A RUN_B``: results with paired confidence intervals.

``runs`` finds what is on disk, ``analysis`` turns the runs into numbers with ``grpolab.objectives.stats``,
``markdown`` and ``figures`` render them into DIR/report/, a folder ``folder`` marks as the report's own.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import re
from pathlib import Path
from typing import Any

from grpolab.common.atomic import atomic_folder
from grpolab.common.progress import Reporter
from grpolab.objectives.stats import RESAMPLES
from grpolab.studies.report.analysis import analyse, comparison
from grpolab.studies.report.decisions import decision_data, decision_figure
from grpolab.studies.report.folder import REPORT_DIR, check_replaceable, mark
from grpolab.studies.report.runs import ReportError, Run, find_runs


def write_report(
    directory: Path,
    reporter: Reporter,
    baseline: str | None = None,
    resamples: int = RESAMPLES,
    seed: int = 0,
    select: list[str] | None = None,
) -> Path:
    """Write DIR/report/ (report.md, report.json, PNGs), replacing an earlier report as a whole. Raises
    ReportError, before anything is computed or written, when DIR/report exists and is not a report's
    own folder (no marker: a run directory, a user's folder, a file).

    ``select``: run names or shell patterns (``grpo*``); the report covers the runs they match, in the
    directory's order, and goes to DIR/report-<the patterns> so that the whole directory's report stays."""
    from grpolab.studies.report.figures import all_figures  # matplotlib only when figures are drawn
    from grpolab.studies.report.markdown import render
    from grpolab.studies.report.routing import load_heatmaps

    directory = Path(directory)
    title, runs = find_runs(directory)
    target = directory / REPORT_DIR
    if select:
        runs = select_runs(runs, select)
        title = f"{title}: {', '.join(r.name for r in runs)}"
        target = directory / subset_folder(select)
    check_replaceable(target)
    with reporter.phase(f"report: statistics of {len(runs)} runs ({resamples:,} resamples)"):
        data = analyse(title, runs, baseline, resamples, seed)
        data["decisions"] = decision_data(directory) if not select else None
    with atomic_folder(target, replace=check_replaceable) as tmp:  # checked again: something may have appeared
        mark(tmp)
        with reporter.phase("report: figures") as phase:
            figures, notes = all_figures(runs, data, tmp)
            figures += load_heatmaps(runs, tmp)
            if data["decisions"] is not None and (made := decision_figure(data["decisions"], tmp)) is not None:
                figures.insert(0, made)
            phase.info = f"{len(figures)} figures" + (f", {len(notes)} flat series noted instead" if notes else "")
        data["figure_notes"] = notes
        (tmp / "report.md").write_text(render(data, figures))
        (tmp / "report.json").write_text(json.dumps(data, indent=2, default=str))
    return target / "report.md"


def select_runs(runs: list[Run], patterns: list[str]) -> list[Run]:
    """The runs whose names match any of ``patterns`` (names or shell patterns), in their order; ReportError
    naming a pattern that matches no run, with the runs there are."""
    for pattern in patterns:
        if not any(fnmatch.fnmatchcase(r.name, pattern) for r in runs):
            raise ReportError(f"--runs {pattern!r} matches no run here; runs: {', '.join(r.name for r in runs)}")
    return [r for r in runs if any(fnmatch.fnmatchcase(r.name, p) for p in patterns)]


def subset_folder(patterns: list[str]) -> str:
    """The report folder of a subset: report-<patterns joined by +>, with characters a folder name should not
    carry replaced by _ (and long lists shortened by a hash, so the name stays a valid file name)."""
    joined = "+".join(patterns)
    name = re.sub(r"[^A-Za-z0-9._+-]", "_", joined)
    if len(name) > 80:
        name = name[:60] + "-" + hashlib.sha256(joined.encode()).hexdigest()[:12]
    return f"{REPORT_DIR}-{name}"


def _single_run(path: Path) -> Run:
    if not (path / "config.json").is_file():
        raise ReportError(f"{path}: not a run directory (no config.json)")
    return find_runs(path)[1][0]


def compare_runs(run_a: Path, run_b: Path, resamples: int = RESAMPLES, seed: int = 0) -> dict[str, Any]:
    """Run A's last evaluation against run B's, paired over their shared items."""
    a, b = _single_run(Path(run_a)), _single_run(Path(run_b))
    return comparison(a, b, resamples, seed)


__all__ = ["ReportError", "compare_runs", "write_report"]
