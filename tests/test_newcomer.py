"""A newcomer's first hour, in a fresh clone, with the README's and docs' commands only, output piped to a file as
a newcomer's `| tee run.log` would: `--help` listing the dotted fields, a typo's suggestion, a hub id trained from
a local Hugging Face cache offline, the GSM8K plumbing check (docs/gsm8k.md), a run that cannot learn saying so,
probe's heartbeat, and a run logging to W&B (offline) and Trackio.

Each claim also has a faster proof in the default tier (test_help, test_hub, test_health_run, test_progress /
test_probe, test_trackers); this module checks that they hold together from a clone, so it is slow (the GSM8K
check loads the real SmolLM2-135M-Instruct)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_hub import cache_snapshot
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    """A fresh clone of this repository's committed tree (what a newcomer gets from `git clone`)."""
    if not (ROOT / ".git").exists() or shutil.which("git") is None:
        pytest.skip("needs a git checkout and git")
    fresh = tmp_path_factory.mktemp("newcomer") / "fresh"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(fresh)], check=True)
    return fresh


def grpolab(clone: Path, log: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 900):
    """`grpolab ARGS` in the clone, its output piped to ``log`` (no terminal); returns (exit code, output)."""
    environment = {**os.environ, "PYTHONPATH": str(clone), "COLUMNS": "120", **(env or {})}
    environment.pop("FORCE_COLOR", None)
    with log.open("w") as out:
        done = subprocess.run(
            [sys.executable, "-m", "grpolab", *args],
            cwd=clone,
            env=environment,
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=timeout,
        )
    return done.returncode, log.read_text()


def test_help_lists_the_dotted_fields_and_a_typo_gets_a_suggestion(clone, tmp_path):
    code, text = grpolab(clone, tmp_path / "help.log", "train", "--help")
    assert code == 0
    for field in ("--optim.lr", "--rollout.group_size", "--model.revision", "--log.trackers", "--steps", "--algo"):
        assert field in text, field
    code, text = grpolab(clone, tmp_path / "typo.log", "demo", "--optim.lrr", "3e-4", "--output-dir", "runs/x")
    assert code == 2
    assert "did you mean optim.lr" in text
    assert not (clone / "runs" / "x").exists()


def test_a_hub_id_trains_offline_from_the_local_cache(clone, warm_model_dir, tmp_path):
    saved = tmp_path / "saved"
    AutoModelForCausalLM.from_pretrained(warm_model_dir).save_pretrained(saved)
    AutoTokenizer.from_pretrained(warm_model_dir).save_pretrained(saved)
    commit = "c0ffee" + "0" * 34
    cache = tmp_path / "hf" / "hub"
    cache_snapshot(cache, "newcomer-org/tiny-adder", commit, saved)
    offline = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache), "HF_HOME": str(tmp_path / "hf")}
    args = ("--task", "arithmetic", "--steps", "2", "--eval.n_examples", "16", "--threads", "1")
    code, text = grpolab(
        clone,
        tmp_path / "hub.log",
        "train",
        "--model",
        "newcomer-org/tiny-adder",
        *args,
        "--output-dir",
        "runs/hub",
        env=offline,
    )
    assert code == 0, text
    manifest = json.loads((clone / "runs" / "hub" / "manifest.json").read_text())
    assert manifest["model"]["hub_id"] == "newcomer-org/tiny-adder"
    assert manifest["model"]["revision"] == commit
    code, text = grpolab(clone, tmp_path / "absent.log", "train", "--model", "newcomer-org/absent", *args, env=offline)
    assert code == 2
    assert "grpolab download newcomer-org/absent" in text


def test_the_gsm8k_plumbing_check_runs_end_to_end(clone, tmp_path):
    pytest.importorskip("gguf")
    code, text = grpolab(
        clone, tmp_path / "gsm8k.log", "train", "--config", "configs/gsm8k_cpu_check.toml", "--output-dir", "runs/gsm8k"
    )
    assert code == 0, text
    run = clone / "runs" / "gsm8k"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["updates"]["actual"] >= 1  # the truncation penalty's signal: the update path ran
    assert sorted(p.name for p in (run / "eval").iterdir()) == ["step_000000.jsonl", "step_000003.jsonl"]
    assert "[format_zero_at_start]" in text  # SmolLM2 never writes the r1_zero format: said, not hidden
    assert "\r" not in text and "it/s" not in text  # no progress bars of the libraries in a piped log
    code, text = grpolab(clone, tmp_path / "report.log", "report", "runs/gsm8k")
    assert code == 0, text
    assert (run / "report" / "report.md").is_file()


def test_a_run_that_cannot_learn_says_so_and_logs_to_wandb_and_trackio(clone, tmp_path):
    env = {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path / "wandb"), "TRACKIO_DIR": str(tmp_path / "trackio")}
    code, text = grpolab(
        clone,
        tmp_path / "nosignal.log",
        "demo",
        "--steps",
        "2",
        "--rollout.max_new_tokens",
        "2",
        "--eval.n_examples",
        "16",
        "--threads",
        "1",
        "--log.trackers",
        "wandb,trackio",
        "--output-dir",
        "runs/nosignal",
        env=env,
    )
    assert code == 0, text
    assert "warning: [no_learning_signal]" in text
    summary = json.loads((clone / "runs" / "nosignal" / "summary.json").read_text())
    assert "no_learning_signal" in {w["key"] for w in summary["warnings"]}
    assert list((tmp_path / "wandb").rglob("*.wandb")), "W&B wrote no offline run file"
    assert list((tmp_path / "trackio").rglob("*.db")), "Trackio wrote no local database"


def test_probe_beats_while_piped_and_writes_its_report(clone, tmp_path):
    code, text = grpolab(
        clone,
        tmp_path / "probe.log",
        "probe",
        "--report",
        str(tmp_path / "probe.json"),
        "--threads",
        "1",
        env={"GRPOLAB_HEARTBEAT_SECONDS": "0.5"},
    )
    assert code == 0, text
    assert "elapsed" in text
    report = json.loads((tmp_path / "probe.json").read_text())
    assert report["complete"] is True
