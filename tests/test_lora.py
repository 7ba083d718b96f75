"""LoRA adapters (``[model.lora]``, grpolab.models.lora) on tiny real models.

- the LoRA policy's gradient equals finite differences of the loss (float64), and the training
  forward's gradient equals it within float32 limits;
- the reference is the policy with its adapter off: equal to the separately loaded base model;
- the merged weights an engine loads give the peft model's log-probs, computed without touching the base;
- a LoRA run trains the adapter only (its optimizer holds nothing else), passes the hf engine's sync check,
  resumes exactly after a crash, and its checkpoint exports to a model transformers loads without peft;
- bad input gets one line.
"""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
import torch
from conftest import float64_norms, quick_config, quick_run, run_numbers, train_until
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from grpolab.commands.cli import main
from grpolab.config import LoraSettings, load_config
from grpolab.learning.shared_prefix import layout_units, unit_logprobs
from grpolab.models.lora import MergedWeights, add_adapter, linear_module_names
from grpolab.run.rundir import read_metrics
from grpolab.run.trainer import Trainer, train


def _ids(vocab: int, rows: int = 3, length: int = 9, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, vocab, (rows, length), generator=torch.Generator().manual_seed(seed))


def own_logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    """[N, L-1] log-probs of each next token by the model's own forward, in its dtype."""
    logits = model(input_ids=ids).logits[:, :-1]
    return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def training_logprobs(model, ids: torch.Tensor, prompt: int = 3) -> torch.Tensor:
    """[N, L] log-probs of the completion tokens (columns >= prompt) by grpolab's training forward."""
    n, length = ids.shape
    layout = layout_units(ids, [prompt] * n, [length] * n, [[r] for r in range(n)], shared=False)
    return unit_logprobs(model, layout, n, length).logprobs


def lora_model(make_tiny_model, tiny_model_dirs, arch="llama", dtype=torch.float32, **settings):
    model = make_tiny_model(arch).to(dtype)
    adapter = add_adapter(
        model, LoraSettings(**{"rank": 2, "alpha": 4, **settings}), seed=0, base_dir=tiny_model_dirs[arch]
    )
    adapter.model.to(dtype)  # peft makes the adapter float32 whatever the base
    with torch.no_grad():  # B starts at zero: move it so the adapter changes the policy
        for name, p in adapter.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.3)
    return adapter


def test_the_lora_policy_gradient_is_the_finite_difference_of_the_loss_in_float64(make_tiny_model, tiny_model_dirs):
    adapter = lora_model(make_tiny_model, tiny_model_dirs, dtype=torch.float64)
    model = adapter.model
    float64_norms(model)
    ids = _ids(model.config.vocab_size)
    weights = torch.linspace(-1.0, 1.0, ids.shape[1] - 1, dtype=torch.float64)  # an advantage-like weighting

    def loss() -> torch.Tensor:
        return -(own_logprobs(model, ids) * weights).sum()

    trainable = dict((n, p) for n, p in model.named_parameters() if p.requires_grad)
    assert trainable and all("lora_" in n for n in trainable)
    model.zero_grad()
    loss().backward()
    h = 1e-5
    for name, p in list(trainable.items())[:6]:
        for index in [(0, 0), (p.shape[0] - 1, p.shape[1] - 1)]:
            with torch.no_grad():
                p[index] += h
                up = loss().item()
                p[index] -= 2 * h
                down = loss().item()
                p[index] += h
            assert p.grad[index].item() == pytest.approx((up - down) / (2 * h), rel=1e-6, abs=1e-9), name
    # the training forward's gradient (float32 log-probs) is the same gradient
    float64_grads = {n: p.grad.clone() for n, p in trainable.items()}
    model.zero_grad()
    completion = (-(training_logprobs(model, ids, prompt=1)[:, 1:] * weights)).sum()
    completion.backward()
    for name, p in trainable.items():
        torch.testing.assert_close(p.grad, float64_grads[name], rtol=1e-4, atol=1e-6)


def test_the_reference_is_the_policy_with_its_adapter_off(make_tiny_model, tiny_model_dirs):
    adapter = lora_model(make_tiny_model, tiny_model_dirs)
    base = make_tiny_model("llama")
    ids = _ids(base.config.vocab_size)
    with torch.no_grad():
        with adapter.disabled():
            off = training_logprobs(adapter.model, ids)
        on = training_logprobs(adapter.model, ids)
        torch.testing.assert_close(off, training_logprobs(base, ids), rtol=0, atol=1e-6)
    assert (on - off).abs().max() > 1e-3, "the adapter changes the policy"


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_merged_weights_give_the_peft_models_logprobs_and_leave_the_base_alone(make_tiny_model, tiny_model_dirs, arch):
    adapter = lora_model(make_tiny_model, tiny_model_dirs, arch=arch)
    base_before = {n: p.clone() for n, p in adapter.model.named_parameters() if "base_layer" in n}
    merged = MergedWeights(adapter.model)
    plain = make_tiny_model(arch)
    names = {n for n, _ in plain.named_parameters()}
    assert set(merged.weights) == names, "the plain model's names, tied weights once"
    with torch.no_grad():
        for name, p in plain.named_parameters():
            p.copy_(merged.weights[name])
        ids = _ids(plain.config.vocab_size)
        torch.testing.assert_close(own_logprobs(plain, ids), own_logprobs(adapter.model, ids), rtol=0, atol=1e-5)
    assert all(torch.equal(p, base_before[n]) for n, p in adapter.model.named_parameters() if n in base_before)


def test_an_unknown_target_module_is_refused_naming_the_models_linear_layers(make_tiny_model, tiny_model_dirs):
    model = make_tiny_model("llama")
    with pytest.raises(
        ValueError,
        match=r"model.lora.target_modules: qkv not a linear layer of LlamaForCausalLM; "
        r"its linear layers: down_proj, gate_proj, k_proj, o_proj, q_proj, "
        r"up_proj, v_proj",
    ):
        add_adapter(model, LoraSettings(target_modules=["q_proj", "qkv"]), seed=0, base_dir=tiny_model_dirs["llama"])
    assert "lm_head" not in linear_module_names(model)


def test_lora_settings_refuse_what_cannot_run():
    with pytest.raises(ValueError, match="model.lora.rank: Input should be greater than 0"):
        load_config(None, {"model.lora.rank": 0})
    with pytest.raises(ValueError, match="model.lora.dropout 0.1: the update's forward would differ"):
        load_config(None, {"model.lora.dropout": 0.1})
    assert load_config(None, {"model.lora.dropout": 0.1, "rollout.sync_check": False}).model.lora.dropout == 0.1


LORA = {"model.lora.rank": 4, "model.lora.alpha": 8, "algorithm.beta": 0.05, "steps": 4, "checkpoint.every": 2}


@pytest.fixture(scope="module")
def lora_run(warm_model_dir, tmp_path_factory):
    return quick_run(tmp_path_factory, warm_model_dir, "lora", **LORA)


def test_a_lora_run_trains_the_adapter_only_and_its_reference_costs_no_copy(warm_model_dir, tmp_path):
    trainer = Trainer(quick_config(warm_model_dir, tmp_path / "run", **LORA))
    try:
        parts = trainer.parts
        adapter_params = [p for n, p in parts.model.named_parameters() if "lora_" in n]
        assert {id(p) for g in parts.optimizer.param_groups for p in g["params"]} == {id(p) for p in adapter_params}
        assert parts.reference is parts.model, "the reference is the policy itself, adapter off"
        base = {n: p.clone() for n, p in parts.model.named_parameters() if not p.requires_grad}
        records = [trainer.train_step(step) for step in (1, 2)]
    finally:
        trainer.close()
    assert all(torch.equal(p, base[n]) for n, p in parts.model.named_parameters() if n in base)
    assert records[1]["kl_ref"] > 0 and records[1]["actual_updates"] == 1
    assert all(r["sync/logprob_diff_max"] < 1e-3 for r in records), "hf engine samples with the adapter on"


def test_a_lora_run_resumes_exactly_after_a_crash(warm_model_dir, lora_run, tmp_path):
    run = tmp_path / "run"
    train_until(quick_config(warm_model_dir, run, **LORA), stop_at=4)  # after step 3's records (checkpoint at 2)
    assert main(["train", "--resume", str(run)]) == 0
    assert run_numbers(run) == run_numbers(lora_run)
    final = "checkpoints/step_000004/adapter_model.safetensors"
    a, b = load_file(run / final), load_file(lora_run / final)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_lora_checkpoint_exports_to_a_model_loaded_without_peft(lora_run, tmp_path, capsys):
    checkpoint, out = lora_run / "checkpoints" / "step_000004", tmp_path / "merged"
    assert json.loads((checkpoint / "adapter_config.json").read_text())["r"] == 4
    assert main(["export", str(checkpoint), str(out)]) == 0
    merged = AutoModelForCausalLM.from_pretrained(out)
    assert not any("lora" in n for n, _ in merged.named_parameters())
    from peft import PeftModel

    base = json.loads((checkpoint / "adapter_config.json").read_text())["base_model_name_or_path"]
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), checkpoint)
    ids = _ids(merged.config.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(own_logprobs(merged, ids), own_logprobs(peft_model, ids), rtol=0, atol=1e-5)
        base_logprobs = own_logprobs(AutoModelForCausalLM.from_pretrained(base), ids)
        assert (own_logprobs(merged, ids) - base_logprobs).abs().max() > 0
    capsys.readouterr()
    assert main(["export", str(checkpoint), str(out)]) == 2
    assert "exists and is not empty; not overwritten" in capsys.readouterr().out
    assert main(["export", str(lora_run / "checkpoints"), str(tmp_path / "x")]) == 2
    assert "no checkpoint.json; not loaded" in capsys.readouterr().out


# ~30 s a case (a vLLM engine, a second interpreter); default tier: test_rollout_vllm.py's adapter sync, served
# exactly, and test_trainer_vllm.py's per-step sync check of a run on vLLM
@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM")
@pytest.mark.parametrize("lora_sync", ["merged", "adapter"])
def test_vllm_generates_with_the_lora_policy_and_passes_its_sync_check(warm_model_dir, tmp_path, lora_sync):
    """merged: the merged weights, in this process; adapter: vLLM's LoRA, under another interpreter."""
    run = tmp_path / "run"
    other = {"rollout.vllm.python": sys.executable} if lora_sync == "adapter" else {}
    train(
        quick_config(
            warm_model_dir, run, engine="vllm", **{**LORA, "steps": 2, **other, "rollout.vllm.lora_sync": lora_sync}
        )
    )
    records = [r for r in read_metrics(run / "metrics.jsonl") if "reward_mean" in r]
    assert len(records) == 2 and all(r["sync/logprob_diff_max"] < 1e-3 for r in records)


def test_the_probe_reports_the_adapters_share_and_the_free_reference(warm_model_dir, tmp_path):
    from grpolab.commands.probe import run_probe

    full = run_probe(quick_config(warm_model_dir, tmp_path / "a", reference="frozen"), tmp_path / "full.json")
    lora = run_probe(
        quick_config(warm_model_dir, tmp_path / "b", reference="frozen", **{"model.lora.rank": 2}),
        tmp_path / "lora.json",
    )
    assert full["parameters"]["trained"] == full["parameters"]["total"]
    assert full["parameters"]["reference"] == "a frozen copy"
    assert lora["parameters"]["reference"] == "the policy, adapter off (no copy)"
    assert lora["parameters"]["lora_rank"] == 2
    assert 0 < lora["parameters"]["trained"] < full["parameters"]["trained"] / 5
    assert lora["precision"]["optimizer_state_bytes"] < full["precision"]["optimizer_state_bytes"] / 5
    assert full["parameters"]["bytes"]["reference_weights"] == 4 * full["parameters"]["total"]
    assert lora["parameters"]["bytes"]["reference_weights"] == 0


def test_with_bf16_compute_the_base_stays_in_bf16_and_the_adapter_trains_in_float32(warm_model_dir, tmp_path):
    """No float32 master copy of weights that never change: the base in bf16 (2 bytes a parameter), the adapter,
    its gradients and its AdamW state in float32; the policy trains under autocast and passes the sync check."""
    from grpolab.commands.probe import run_probe

    report = run_probe(
        quick_config(
            warm_model_dir, tmp_path / "b", reference="frozen", **{"model.dtype": "bfloat16", "model.lora.rank": 2}
        ),
        tmp_path / "bf16.json",
    )
    n, trained, part = report["parameters"]["total"], report["parameters"]["trained"], report["parameters"]["bytes"]
    assert report["precision"]["setting"] == "fp32_master" and report["precision"]["compute"] == "torch.bfloat16"
    assert part["frozen_weights"] == 2 * (n - trained)
    assert part["trained_weights"] == part["gradients"] == 4 * trained
    # AdamW's two float32 moments, and a float32 step count per tensor
    assert (
        part["optimizer_state"] == report["precision"]["optimizer_state_bytes"] == pytest.approx(8 * trained, rel=0.01)
    )
    trainer = Trainer(quick_config(warm_model_dir, tmp_path / "run", **{**LORA, "model.dtype": "bfloat16"}))
    try:
        record = trainer.train_step(1)
        dtypes = {p.dtype for n, p in trainer.parts.model.named_parameters() if "lora_" in n}
    finally:
        trainer.close()
    assert dtypes == {torch.float32} and record["sync/logprob_diff_mean"] < 0.1
    # bf16 rollouts: algorithm.rollout_correction auto is token_truncate (TIS), and its metrics are logged
    assert trainer.parts.cfg.algorithm.rollout_correction == "token_truncate"
    assert 0 <= record["rollout_truncated_frac"] < 1 and record["rollout_masked_frac"] == 0
    assert record["rollout_is_weight_max"] <= 2.0 and record["rollout_kl_k3"] > 0


def test_a_run_starts_from_another_lora_runs_checkpoint(lora_run, tmp_path, capsys):
    """A suite's init_from names the earlier run's final checkpoint: its base and its adapter start this run."""
    checkpoint = lora_run / "checkpoints" / "step_000004"
    config = json.loads((lora_run / "config.json").read_text())
    start = {
        "model.path": str(checkpoint),
        "steps": 1,
        "eval.every": 1,
        "checkpoint.every": 1,
        "rollout.prompts_per_step": 4,
        "rollout.group_size": 8,
        "rollout.max_new_tokens": 40,
        **{f"task.{k}": v for k, v in config["task"].items()},
    }
    summary = train(
        load_config(None, {**start, "model.lora.rank": 4, "model.lora.alpha": 8, "output_dir": str(tmp_path / "next")})
    )
    last = [r for r in read_metrics(lora_run / "metrics.jsonl") if "val/accuracy" in r][-1]
    assert summary["val_accuracy"]["start"] == last["val/accuracy"], "it starts where the other run ended"
    assert json.loads((tmp_path / "next" / "manifest.json").read_text())["warm_start_from"] == str(checkpoint)
    capsys.readouterr()
    assert (
        main(
            [
                "train",
                *[f"--{k}={v}" for k, v in start.items() if k != "task.name"],
                "--output-dir",
                str(tmp_path / "full"),
            ]
        )
        == 2
    )
    assert "is a LoRA checkpoint: set [model.lora]" in capsys.readouterr().out
    assert not (tmp_path / "full").exists()
