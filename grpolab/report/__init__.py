"""``grpolab report DIR`` and ``grpolab compare RUN_A RUN_B``: results with paired confidence intervals.

``runs`` finds what is on disk, ``analysis`` turns the runs into numbers with ``grpolab.stats``,
``markdown`` and ``figures`` render them into DIR/report/.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from grpolab.progress import Reporter
from grpolab.report.analysis import analyse, comparison
from grpolab.report.runs import ReportError, Run, find_runs
from grpolab.stats import RESAMPLES

REPORT_DIR = "report"


def write_report(directory: Path, reporter: Reporter, baseline: str | None = None, resamples: int = RESAMPLES,
                 seed: int = 0) -> Path:
    """Write DIR/report/ (report.md, report.json, PNGs), replacing an earlier report as a whole."""
    from grpolab.report.figures import all_figures  # matplotlib only when figures are drawn
    from grpolab.report.markdown import render

    directory = Path(directory)
    title, runs = find_runs(directory)
    with reporter.phase(f"report: statistics of {len(runs)} runs ({resamples:,} resamples)"):
        data = analyse(title, runs, baseline, resamples, seed)
    tmp = Path(tempfile.mkdtemp(dir=directory, prefix=f".{REPORT_DIR}-"))
    try:
        with reporter.phase("report: figures") as phase:
            figures = all_figures(runs, data, tmp)
            phase.info = f"{len(figures)} figures"
        (tmp / "report.md").write_text(render(data, figures))
        (tmp / "report.json").write_text(json.dumps(data, indent=2, default=str))
        target = directory / REPORT_DIR
        old = directory / f".{REPORT_DIR}-old"
        shutil.rmtree(old, ignore_errors=True)
        if target.exists():
            target.rename(old)
        tmp.rename(target)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
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
