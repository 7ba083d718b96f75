"""GSM8K through the whole pipeline on tiny random models, and `grpolab probe`."""

from __future__ import annotations

import json

import pytest
from conftest import ARCHS, GSM8K_DIR
from transformers import AutoModelForCausalLM

from grpolab.commands.cli import main
from grpolab.commands.probe import run_probe
from grpolab.config import load_config
from grpolab.run.rundir import read_metrics
from grpolab.run.trainer import Trainer, train

DATA = {
    "task": "gsm8k",
    "task.train_path": str(GSM8K_DIR / "train.jsonl"),
    "task.test_path": str(GSM8K_DIR / "test.jsonl"),
}


def small_gsm8k(model_dir, out, **overrides):
    base = {
        **DATA,
        "model": str(model_dir),
        "output_dir": str(out),
        "steps": 2,
        "task.n_train": 16,
        "task.n_val": 4,
        "rollout.prompts_per_step": 2,
        "rollout.group_size": 4,
        "rollout.max_new_tokens": 16,
        "optim.micro_batch_size": 1,
        "model.gradient_checkpointing": True,
        "model.logprob_chunk_size": 32,
        "eval.every": 1,
        "checkpoint.every": 2,
        "reference": "frozen",
    }
    return load_config(None, {**base, **overrides})


def test_two_step_gsm8k_run_through_the_full_pipeline(long_context_model_dirs, tmp_path):
    summary = train(small_gsm8k(long_context_model_dirs["llama"], tmp_path / "run"))
    run = tmp_path / "run"
    steps = [m for m in read_metrics(run / "metrics.jsonl") if "reward_mean" in m]
    assert [m["step"] for m in steps] == [1, 2]
    assert all("kl_ref" in m or m["actual_updates"] == 0 for m in steps)
    assert summary["val_accuracy"]["start"] == 0.0  # a random model does not solve GSM8K
    AutoModelForCausalLM.from_pretrained(summary["final_checkpoint"])
    manifest = json.loads((run / "manifest.json").read_text())
    data = manifest["data"]
    assert data["train_rows"] == 16 and data["validation_rows"] == 4
    assert len(data["train_sha256"]) == 64 and len(data["prompt_template_sha256"]) == 64
    assert len(manifest["model"]["config_sha256"]) == 64


def test_prompt_longer_than_the_limit_is_an_error_listing_ids(long_context_model_dirs, tmp_path):
    cfg = small_gsm8k(long_context_model_dirs["llama"], tmp_path / "run", **{"rollout.max_prompt_tokens": 420})
    with pytest.raises(ValueError, match=r"prompts are longer than 420 tokens.*Example ids: train-"):
        Trainer(cfg)
    assert not (tmp_path / "run").exists(), "a refused run leaves nothing on disk"


def test_gsm8k_needs_an_existing_model_dir(tmp_path, capsys):
    args = ["train", *[f"--{k}={v}" for k, v in DATA.items()], "--output-dir", str(tmp_path / "o")]
    assert main(args) == 2
    assert "model.path (--model DIR or a hub id org/name) is required" in capsys.readouterr().out
    assert main([*args, "--model", str(tmp_path / "missing")]) == 2
    assert "model directory not found" in capsys.readouterr().out
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("arch", ARCHS)
def test_probe_does_two_real_updates_and_reports(arch, long_context_model_dirs, tmp_path):
    cfg = small_gsm8k(long_context_model_dirs[arch], tmp_path / "unused", **{"rollout.max_new_tokens": 8})
    report = run_probe(cfg, tmp_path / "probe.json")
    assert json.loads((tmp_path / "probe.json").read_text())["batch"] == report["batch"]
    assert report["batch"]["sequences"] == 8
    assert report["batch"]["sequence_length"] == report["batch"]["prompt_tokens"] + 8
    # gradient checkpointing: no shared prompts, one row per micro-batch of micro_batch_size 1
    assert not report["batch"]["shared_prompts"] and report["batch"]["micro_batches"] == 8
    for update in report["updates"]:
        assert update["parameter_tensors_with_nonzero_grad"] == update["parameter_tensors"]
        assert update["grad_norm"] > 0
    assert report["optimizer_state_initialised"] and report["peak_memory_mb"] > 0
    # the whole rollout batch at once, and its largest cache counted from the model's shapes
    assert report["generation"]["completions"] == report["batch"]["sequences"] == 8
    config = json.loads((long_context_model_dirs[arch] / "config.json").read_text())
    kv_heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    assert report["generation"]["kv_cache_bytes"] == (
        2 * config["num_hidden_layers"] * 8 * kv_heads * head_dim * 4 * report["batch"]["sequence_length"]
    )
    assert not (tmp_path / "unused").exists(), "the probe leaves no run directory behind"
    with pytest.raises(FileExistsError):
        run_probe(cfg, tmp_path / "probe.json")


@pytest.mark.slow  # about 3 minutes on 2 cores: 256 sequences of 512 new tokens at micro-batch 1
def test_probe_at_the_reference_config_shapes(long_context_model_dirs, tmp_path):
    """configs/gsm8k_olmo2_1b.toml's batch (32 x 8, 512 new tokens, micro-batch 1) with a tiny model standing in."""
    cfg = load_config("configs/gsm8k_olmo2_1b.toml", {**DATA, "model": str(long_context_model_dirs["llama"])})
    report = run_probe(cfg, tmp_path / "probe.json")
    assert report["batch"]["sequences"] == 256 and report["batch"]["max_new_tokens"] == 512
    assert report["batch"]["micro_batch_size"] == 1 and report["batch"]["logprob_chunk_size"] == 32
    assert report["shapes"]["logits_chunk"][1] == 32
    assert report["optimizer_state_initialised"]
