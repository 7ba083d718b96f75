"""vLLM serving a LoRA run's policy with its own LoRA (``rollout.vllm.lora_sync = "adapter"``): only the
adapter moves each step, reloaded in place, and the engine samples exactly the peft policy's log-probs.
The ``merged`` mode is tested beside the runs in test_lora.py; both modes' runs pass the per-step sync check."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, GPTJConfig

from grpolab.config import LoraSettings, load_config
from grpolab.learning.batching import collate
from grpolab.models.logprobs import token_logprobs
from grpolab.models.lora import AdapterWeights, add_adapter
from grpolab.rollout import SamplingParams
from grpolab.rollout.sync_check import logprob_diff

pytest.importorskip("vllm")
TOL = 1e-4


def _move_adapter(adapter, seed: int) -> None:
    """Every adapter weight to new random values (B too, so the policy leaves the base)."""
    with torch.no_grad():
        for name, p in adapter.peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(seed + len(name))))


def _diff(model, completions, pad_id: int):
    batch = collate(completions, pad_id)
    with torch.no_grad():
        lp = token_logprobs(model, batch.input_ids, batch.attention_mask).logprobs
    return logprob_diff(batch.engine_logprobs, lp, batch.response_mask)


def assert_serves_the_synced_adapter_exactly(engine, model_dir, tokenizer) -> None:
    """``engine`` (on ``model_dir``'s weights, started with ``lora_rank=4``) serves each adapter synced into it,
    reloaded under the same id; not the base's log-probs, and not an adapter that moved after its sync."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    adapter = add_adapter(model, LoraSettings(rank=4, alpha=8), seed=0, base_dir=model_dir)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = [tokenizer.encode(p) for p in ("12+34=", "7+8=<think>", "9+9=18;" * 30)]
    params = SamplingParams(max_new_tokens=16, temperature=1.0, seed=5)

    def sampled():
        return [c for g in engine.generate(prompts, 3, params) for c in g]

    for seed in (1, 2):  # the second sync reloads the adapter under the same id
        _move_adapter(adapter, seed)
        engine.sync_weights(AdapterWeights(adapter))
        completions = sampled()
        assert _diff(adapter.model, completions, tokenizer.pad_token_id).max_abs_diff < TOL
        assert _diff(base, completions, tokenizer.pad_token_id).mean_abs_diff > 1e-2, "not the base"
    _move_adapter(adapter, 3)  # not synced: the engine still serves the last adapter
    assert _diff(adapter.model, sampled(), tokenizer.pad_token_id).mean_abs_diff > 1e-2


@pytest.mark.slow  # its own engine (~25 s); default tier: test_rollout_vllm.py's shared engine runs the same check
def test_vllm_serves_the_synced_adapter_exactly_and_reloads_it_in_place(vllm_model_dir, tokenizer):
    from grpolab.rollout.vllm.engine import VLLMEngine

    engine = VLLMEngine(
        vllm_model_dir, tokenizer, dtype="float32", seed=0, max_model_len=256, kv_cache_bytes=64 << 20, lora_rank=4
    )
    try:
        assert_serves_the_synced_adapter_exactly(engine, vllm_model_dir, tokenizer)
    finally:
        engine.close()


@pytest.mark.slow  # its own engine (~25 s); default tier: test_lora.py's merged weights give the peft model's log-probs
def test_a_tied_models_trained_head_is_served_untied_by_the_merged_sync(vllm_model_dir, tokenizer):
    """LoRA with modules_to_save = ["lm_head"] on a tied model: the policy's head trains apart from its embedding.
    vLLM builds a tied model's head as its embedding (and skips lm_head.* when loading); the engine the run
    builds serves it untied, so its log-probs stay the trainer's as the head drifts from the embedding."""
    from grpolab.models.lora import MergedWeights, trains_tied_head
    from grpolab.models.precision import resolve_precision
    from grpolab.rollout.engines import EngineRequest, build_engine

    model = AutoModelForCausalLM.from_pretrained(vllm_model_dir, dtype=torch.float32).eval()
    assert model.config.tie_word_embeddings
    adapter = add_adapter(
        model, LoraSettings(rank=4, alpha=8, modules_to_save=["lm_head"]), seed=0, base_dir=vllm_model_dir
    )
    assert trains_tied_head(adapter.model) and not trains_tied_head(
        AutoModelForCausalLM.from_pretrained(vllm_model_dir, dtype=torch.float32)
    )
    base = AutoModelForCausalLM.from_pretrained(vllm_model_dir, dtype=torch.float32).eval()
    cfg = load_config(None, {"rollout.engine": "vllm", "rollout.vllm.kv_cache_gib": 0.0625})
    engine = build_engine(
        EngineRequest(
            cfg.rollout, adapter.model, tokenizer, vllm_model_dir, 0, 256, resolve_precision("float32", torch.float32)
        )
    )
    prompts = [tokenizer.encode(p) for p in ("12+34=", "7+8=<think>")]
    params = SamplingParams(max_new_tokens=16, temperature=1.0, seed=5)
    try:
        for seed in (1, 2):  # the head drifts further from the embedding at each step
            _move_adapter(adapter, seed)
            with torch.no_grad():
                head = adapter.model.get_output_embeddings().modules_to_save["default"].weight
                head.add_(0.5 * torch.randn(head.shape, generator=torch.Generator().manual_seed(seed)))
            engine.sync_weights(MergedWeights(adapter.model))
            completions = [c for g in engine.generate(prompts, 3, params) for c in g]
            assert _diff(adapter.model, completions, tokenizer.pad_token_id).max_abs_diff < TOL
            assert _diff(base, completions, tokenizer.pad_token_id).mean_abs_diff > 1e-2, "not the base"
    finally:
        engine.close()


def test_an_engine_without_lora_refuses_an_adapter(vllm_model_dir):
    from grpolab.rollout.vllm.engine import VLLMEngine

    engine = VLLMEngine.__new__(VLLMEngine)  # no engine processes: the refusal comes before any
    engine.lora_rank = None
    with pytest.raises(ValueError, match="started without LoRA"):
        engine.sync_adapter_from_folder(vllm_model_dir)


def test_adapter_sync_refuses_what_vllms_lora_cannot_serve(tmp_path):
    from grpolab.rollout.vllm.engine import lora_engine_kwargs

    GPTJConfig(n_embd=32, n_layer=1, n_head=2, architectures=["GPTJForCausalLM"]).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="vLLM has no LoRA support for GPTJForCausalLM: use rollout.vllm.lora_sync"):
        lora_engine_kwargs(str(tmp_path), 8)
    with pytest.raises(ValueError, match="vLLM serves adapters of rank <= 512"):
        lora_engine_kwargs(str(tmp_path), 600)
    with pytest.raises(ValueError, match="lora_sync 'adapter' needs \\[model.lora\\]"):
        load_config(None, {"rollout.vllm.lora_sync": "adapter"})
    with pytest.raises(ValueError, match="vLLM's LoRA cannot serve model.lora.modules_to_save"):
        load_config(None, {"rollout.vllm.lora_sync": "adapter", "model.lora.modules_to_save": ["lm_head"]})
