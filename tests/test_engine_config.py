"""Choosing the rollout engine from the config and the command line, and `grpolab bench` on hf."""

from __future__ import annotations

import copy
import importlib.util
import json
import sys

import pytest
import torch
from conftest import TASK_SETTINGS, bench_args, cli_pairs, quick_config

from grpolab.commands.cli import main
from grpolab.config import ConfigError, load_config
from grpolab.learning.learner import BatchForward
from grpolab.models.weights import ModelWeights
from grpolab.rollout.sync_check import WeightSyncError
from grpolab.run.trainer import Trainer

HAS_VLLM = importlib.util.find_spec("vllm") is not None


def test_engine_options_and_sync_limits():
    cfg = load_config(None, {})
    assert cfg.rollout.engine == "hf" and cfg.rollout.sync_check  # every engine checks itself by default
    cfg = load_config(None, {"engine": "vllm"})
    assert cfg.rollout.sync_check and cfg.rollout.sync_limits("float32") == (1e-3, 1e-4)
    assert cfg.rollout.sync_limits("bfloat16") == (None, 0.1)
    cfg = load_config(None, {"vllm_python": "/opt/py/bin/python", "rollout.sync_max_diff": 0.5})
    assert cfg.rollout.engine == "vllm" and cfg.rollout.vllm.python == "/opt/py/bin/python"
    assert cfg.rollout.sync_limits("float32") == (0.5, 1e-4)
    assert not load_config(None, {"rollout.sync_check": False}).rollout.sync_check
    with pytest.raises(ConfigError, match="needs rollout.engine 'vllm'"):
        load_config(None, {"engine": "hf", "vllm_python": "/opt/py/bin/python"})
    with pytest.raises(ConfigError, match="rollout.engine"):
        load_config(None, {"engine": "sglang"})
    with pytest.raises(ConfigError, match="rollout.vllm.sleep_level"):
        load_config(None, {"rollout.vllm.sleep_level": 3})


def test_bad_engine_input_is_one_line_and_leaves_no_run_dir(warm_model_dir, tmp_path, capsys):
    out = tmp_path / "run"
    base = ["train", "--model", str(warm_model_dir), "--output-dir", str(out)]
    assert main([*base, "--vllm-python", str(tmp_path / "no-python")]) == 2
    assert "no such interpreter" in capsys.readouterr().out
    if not HAS_VLLM:
        assert main([*base, "--engine", "vllm"]) == 2
        said = capsys.readouterr().out  # the one line naming vLLM's extra
        assert said.startswith("error: ") and "vLLM" in said and "pip install 'grpolab[vllm]'" in said
    assert not out.exists()


def test_hf_engine_checks_its_own_logprobs_by_default_from_the_update_forward(warm_model_dir, tmp_path, monkeypatch):
    trainer = Trainer(quick_config(warm_model_dir, tmp_path / "run"))
    frozen = []
    monkeypatch.setattr(BatchForward, "frozen", lambda self, model: frozen.append(model))
    record = trainer.train_step(1)
    assert not frozen  # one-update schedule: the check read the update's own forward, no extra pass
    assert 0 < record["sync/logprob_diff_max"] < 1e-4  # generate's KV-cached log-probs vs a full forward
    assert record["first_update/ratio_mean"] == 1.0
    # an engine sampling from other weights is caught before the update moves the trainer's
    stale = copy.deepcopy(trainer.parts.model)
    with torch.no_grad():
        stale.get_output_embeddings().weight.mul_(1.05)
    trainer.parts.engine.sync_weights(ModelWeights(stale))
    before = {k: v.clone() for k, v in trainer.parts.model.state_dict().items()}
    with pytest.raises(WeightSyncError):
        trainer.train_step(2)
    assert all(torch.equal(v, before[k]) for k, v in trainer.parts.model.state_dict().items())
    trainer.close()


@pytest.mark.parametrize("kind", ["rollout", "step"])
def test_bench_prints_and_writes_figures(kind, warm_model_dir, tmp_path, capsys):
    report = tmp_path / "bench.json"
    args = bench_args(kind, "hf", report, warm_model_dir)
    assert main(args) == 0
    results = json.loads(report.read_text())["results"]
    assert list(results) == ["hf"]
    figures = results["hf"]
    assert figures["tokens_per_s"] > 0
    if kind == "step":
        assert 0 < figures["sync_share"] < 1 and figures["step"] >= figures["generate"] + figures["train"]
    assert f"bench {kind}" in capsys.readouterr().out
    assert main(args) == 2  # the report exists: refused, not overwritten
    assert json.loads(report.read_text())["results"] == results
    assert main([*args[:2], "--engines", "tgi"]) == 2


def test_bench_without_engines_says_which_were_skipped_and_why(warm_model_dir, tmp_path, capsys, monkeypatch):
    """Every engine that can run, and a line for each that cannot (here vLLM, as an interpreter without it
    sees it); the JSON records them too."""
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm fails, as where it is not installed
    report = tmp_path / "bench.json"
    args = ["bench", "rollout", "--repeats", "1", "--json", str(report), "--model", str(warm_model_dir)]
    args += [*cli_pairs(TASK_SETTINGS), "--rollout.prompts_per_step", "2"]
    assert main([*args, "--rollout.max_new_tokens", "8", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "bench rollout: vllm skipped: vLLM is not installed in this interpreter" in out
    assert "skipped: vllm" in out  # the table's caption
    figures = json.loads(report.read_text())
    assert list(figures["results"]) == ["hf"] and figures["skipped"]["vllm"].startswith("vLLM is not installed")


def test_every_engine_the_config_accepts_is_registered_and_no_other():
    from typing import get_args

    from grpolab.config import RolloutConfig
    from grpolab.rollout.engines import ENGINES

    assert set(ENGINES) == set(get_args(RolloutConfig.model_fields["engine"].annotation))


@pytest.mark.parametrize("engine", ["hf", "vllm"])
@pytest.mark.parametrize("setting", [{"rollout.top_p": 0.9}, {"rollout.top_k": 20}])
def test_truncated_sampling_is_refused_in_training_on_every_engine(engine, setting):
    """A top-p / top-k sample is not from the policy whose log-probs the objective, the old policy and the sync
    check score, and no reweighting reaches the tokens it never samples: refused for every engine alike."""
    with pytest.raises(ConfigError, match="top_p = 1 and top_k = 0"):
        load_config(None, {"engine": engine, **setting})


def test_truncated_training_sampling_is_one_line_and_leaves_no_run_dir(warm_model_dir, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--model", str(warm_model_dir), "--output-dir", str(out), "--rollout.top_p", "0.9"]) == 2
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert len(lines) == 1 and "eval.top_p" in lines[0], lines
    assert not out.exists()


def test_pass_at_k_samples_with_the_eval_top_k(warm_model_dir, tmp_path):
    """Evaluation keeps top-p / top-k (eval.top_p, eval.top_k): with top_k = 1 every pass@k sample of an item is
    its most likely continuation, so an item's pass_n samples are all right or all wrong."""
    cfg = quick_config(warm_model_dir, tmp_path / "run", **{"eval.pass_k": [1, 4], "eval.pass_n": 4, "eval.top_k": 1})
    trainer = Trainer(cfg)
    trainer.evaluate(0)
    records = [json.loads(line) for line in (trainer.run_dir / "eval" / "step_000000.jsonl").read_text().splitlines()]
    trainer.close()
    assert len(records) == 16 and all(r["pass_correct"] in (0, 4) for r in records)


def test_evaluation_top_p_top_k_on_vllm_is_refused():
    from grpolab.rollout.engines import check_settings

    with pytest.raises(ConfigError, match="eval.top_p / top_k"):
        check_settings(load_config(None, {"engine": "vllm", "eval.top_k": 5}))
