"""benchmarks/gpu_check.py's own plumbing: its margins, its time guard, its environment record and its
refusal to overwrite a report (the sections themselves need CUDA or minutes: `--device cpu --quick`)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import gpu_check  # noqa: E402


def test_sync_margin_is_the_largest_step_mean_over_the_floor_the_check_uses():
    steps = [
        {"sync/noise_floor_mean": 2e-3, "sync/logprob_diff_mean": 2e-3},
        {"sync/noise_floor_mean": 2e-3, "sync/logprob_diff_mean": 3e-3},
        {"sync/noise_floor_mean": 2e-3, "sync/logprob_diff_mean": None},
    ]
    margin = gpu_check.sync_margin(steps, 3.0)
    assert margin["largest_mean_over_floor"] == pytest.approx(1.5)
    assert margin["headroom"] == pytest.approx(2.0) and margin["limit_multiple"] == 3.0
    assert gpu_check.sync_margin([{"sync/logprob_diff_mean": 1e-3}], 3.0)["headroom"] is None
    # a measured floor below the least the check allows (bf16: 1e-3) is raised to it, as the check does
    raised = gpu_check.sync_margin([{"sync/noise_floor_mean": 3e-5, "sync/logprob_diff_mean": 2.5e-4}], 3.0, 1e-3)
    assert raised["floor"] == 1e-3 and raised["largest_mean_over_floor"] == pytest.approx(0.25)


def test_a_section_past_the_budget_is_skipped_and_recorded(tmp_path):
    report = {"out": str(tmp_path / "r.json")}
    gpu_check.section(report, "late", lambda: {"never": True}, deadline=time.monotonic() - 1)
    gpu_check.section(report, "broken", lambda: 1 / 0)
    gpu_check.section(report, "fine", lambda: {"x": 1})
    written = json.loads((tmp_path / "r.json").read_text())
    assert written["late"] == {"ok": False, "error": "skipped: past the time budget", "seconds": 0.0}
    assert not written["broken"]["ok"] and written["broken"]["error"].startswith("ZeroDivisionError")
    assert written["fine"]["ok"] and written["fine"]["x"] == 1 and written["fine"]["seconds"] >= 0


def test_the_environment_names_the_machine_and_the_versions():
    env = gpu_check.environment()
    assert env["machine"] and env["python"] and env["torch"]
    assert env["packages"]["transformers"] and "typing-extensions" in env["packages"]


def test_an_existing_report_is_never_overwritten(tmp_path, capsys):
    (tmp_path / "gpu_check.json").write_text("earlier")
    assert gpu_check.main(["--out-dir", str(tmp_path), "--device", "cpu", "--quick"]) == 2
    assert capsys.readouterr().out.startswith("error: ")
    assert (tmp_path / "gpu_check.json").read_text() == "earlier" and not (tmp_path / "gpu_check.log").exists()


def test_prepared_warm_starts_are_the_ones_the_check_then_uses(tmp_path, monkeypatch):
    """``--download-wheels DIR`` warm-starts the sections' demo models into DIR/cache; ``--wheels DIR``
    points the cache there, and the sections' tasks find them without training (tiny recipe here)."""
    import os

    from grpolab.models.tinymodel import WarmStartSettings, warm_start_model

    settings = WarmStartSettings(steps=2, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
    prepared = gpu_check.prepare_warm_starts(tmp_path, settings)
    assert prepared and all(
        p.parent == tmp_path / "cache" / "tiny" and (p / "warm_start.json").is_file() for p in prepared
    )
    written = {p: (p / "warm_start.json").stat().st_mtime_ns for p in prepared}
    (tmp_path / "site").mkdir()  # the wheels' install, already done
    monkeypatch.delenv("GRPOLAB_CACHE", raising=False)
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    monkeypatch.setattr(sys, "path", list(sys.path))
    gpu_check.use_wheels(tmp_path)
    assert os.environ["GRPOLAB_CACHE"] == str(tmp_path / "cache")
    assert [warm_start_model(task, settings) for task in gpu_check.warm_start_tasks()] == prepared
    assert {p: (p / "warm_start.json").stat().st_mtime_ns for p in prepared} == written


def test_the_moe_section_rehearses_on_cpu(tmp_path, monkeypatch):
    """The MoE routing section on CPU at its quick sizes: both runs, the mismatch and sync figures of each step
    (replayed, the training forward routes as the engine did)."""
    monkeypatch.setenv("GRPOLAB_CACHE", str(tmp_path / "cache"))
    report = gpu_check.moe_routing("cpu", quick=True)
    assert set(report) == {"live", "replay"} and all(len(steps) == 2 for steps in report.values())
    for step in report["replay"]:
        assert 0 <= step["router/mismatch"] <= 1 and step["sync/logprob_diff_max"] < 100
