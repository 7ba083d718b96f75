"""A real run that cannot learn says so: in its log, summary.json and the report (grpolab.run.health); the
final table labels its train reward honestly; one wall time everywhere."""

from __future__ import annotations

import io
import json
import re

from conftest import quick_config
from rich.console import Console

from grpolab.common.progress import Reporter
from grpolab.config import load_run_config
from grpolab.run.rundir import wall_seconds
from grpolab.run.trainer import train
from grpolab.studies.report import write_report


def test_a_run_without_learning_signal_warns_in_log_summary_and_report(warm_model_dir, tmp_path):
    # two new tokens cannot hold an answer: every completion is cut off, every reward 0, every group all-equal,
    # the step-0 evaluation's format rate 0; 2 steps < warn.no_signal_steps (5): that warning comes at the end
    out = io.StringIO()
    run = tmp_path / "run"
    cfg = quick_config(warm_model_dir, run, **{"rollout.max_new_tokens": 2, "rollout.prompts_per_step": 2})
    summary = train(cfg, Console(file=out, force_terminal=False, width=100))
    log = out.getvalue()
    expected = ["format_zero_at_start", "truncation", "no_learning_signal"]

    warned = re.findall(r"^\d\d:\d\d:\d\d warning: \[(\w+)\] step (\d+): ", log, re.M)
    assert warned == [("format_zero_at_start", "0"), ("truncation", "0"), ("no_learning_signal", "2")], log
    no_signal = next(line for line in log.splitlines() if "[no_learning_signal]" in line)
    assert "steps_in_a_row 2" in no_signal and "total_actual_updates 0" in no_signal
    assert "Likely cause:" in no_signal and "rollout.group_size" in no_signal
    assert "\x1b[" not in log  # plain in a piped log
    assert "3 warning(s) above: format_zero_at_start (step 0), truncation (step 0), no_learning_signal (step 2)" in log
    assert "train reward (mean of first / last step)" in log

    on_disk = json.loads((run / "summary.json").read_text())
    assert on_disk["warnings"] == summary["warnings"]
    assert [w["key"] for w in on_disk["warnings"]] == expected
    assert on_disk["train_reward"] == {"first": 0.0, "last": 0.0, "steps_averaged": 1}
    assert on_disk["updates"]["actual"] == 0

    report = write_report(run, Reporter(Console(file=io.StringIO())))
    text = report.read_text()
    section = text.split("## Warnings", 1)[1].split("\n## ", 1)[0]
    for key in expected:
        assert f"`{key}`" in section, section
    assert "Look at: rollout.max_new_tokens, rollout.stop_strings" in section
    row = json.loads((run / "report" / "report.json").read_text())["runs"][0]
    # the report's wall time is summary.json's, which is the manifest's sessions (what suite status shows)
    assert row["wall_seconds"] == on_disk["wall_seconds"] == wall_seconds(run)

    # a resume replays the steps before it: nothing is said twice, and its summary keeps every warning
    out = io.StringIO()
    resumed = train(load_run_config(run, {"steps": 3}), Console(file=out, force_terminal=False), resume=True)
    assert "warning:" not in out.getvalue() and "3 warning(s) above" in out.getvalue()
    assert resumed["warnings"] == on_disk["warnings"]


def test_suite_status_and_report_give_one_wall_time(tmp_path):
    """They disagreed (1m14s vs 1m41s): status counted from the process's launch to its exit, the report
    summed the training seconds. Both now read the run's sessions (grpolab.run.rundir.wall_seconds)."""
    from grpolab.studies.manifest import RunRecord, SuiteManifest
    from grpolab.studies.report.analysis import run_row
    from grpolab.studies.report.runs import Run
    from grpolab.studies.suite.status import status_table

    run = tmp_path / "runs" / "a"
    run.mkdir(parents=True)
    (tmp_path / "a.json").write_text(json.dumps({"steps": 3}))
    sessions = [{"seconds": 60.0}, {"seconds": 14.0}]  # a run resumed once
    (run / "manifest.json").write_text(json.dumps({"sessions": sessions}))
    record = RunRecord(
        name="a",
        state="stopped",
        run_dir=str(run),
        config_file=str(tmp_path / "a.json"),
        config_sha256="0",
        started="2026-12-06T10:00:00+0000",
        ended="2026-12-06T10:01:41+0000",  # 1m41s from launch to exit: loading, engine start, teardown
    )
    SuiteManifest(suite="s", source_file="s.toml", runs=[record]).save(tmp_path)
    out = io.StringIO()
    Console(file=out, width=300).print(status_table(tmp_path))
    assert "wall time" in out.getvalue() and "1m14s" in out.getvalue() and "1m41s" not in out.getvalue()
    assert run_row(Run("a", run, "stopped"))["wall_seconds"] == 74.0  # no summary.json: the same sessions
