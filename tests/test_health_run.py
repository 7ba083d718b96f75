"""A real run that cannot learn says so: in its log, summary.json and the report (grpolab.run.health); the
final table labels its train reward honestly; one wall time everywhere."""

from __future__ import annotations

import io
import json
import re

from conftest import quick_config
from rich.console import Console

from grpolab.common.progress import Reporter
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
