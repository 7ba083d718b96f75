"""The hf engine's own compute-dtype copy of the weights (grpolab.rollout.hf.engine_weights), on tiny real models."""

from __future__ import annotations

import pytest
import torch

from grpolab.models.precision import resolve_precision
from grpolab.models.weights import ModelWeights
from grpolab.rollout import HFEngine, SamplingParams
from grpolab.rollout.hf import decode as decode_module
from grpolab.rollout.hf import packed_linear
from grpolab.rollout.hf.engine_weights import copy_refusal
from grpolab.rollout.hf.packed_linear import bf16_packing_supported

MASTER = resolve_precision("fp32_master", torch.bfloat16)  # float32 storage, bf16 compute


def _engine(model, tokenizer, precision=MASTER, mode="matmul") -> HFEngine:
    return HFEngine(
        model,
        tokenizer,
        compute_context=lambda: precision.autocast(torch.device("cpu")),
        compute_dtype=precision.compute,
        copy_mode=mode,
    )


def _prompts(tokenizer) -> list[list[int]]:
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in ("1 + 2 = ", "hello")]


def _matches_master(engine: HFEngine, model) -> bool:
    """Every copy weight equals its master cast to the copy's dtype."""
    return all(torch.equal(mine, theirs.detach().to(mine.dtype)) for mine, theirs in engine.copy.pairs())


def _change(model) -> None:
    with torch.no_grad():  # an optimizer step
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)


def test_the_matmul_copy_casts_what_autocast_casts_and_each_sync_refreshes_it(make_tiny_model, tokenizer):
    model = make_tiny_model("llama")
    model.model.embed_tokens.weight = model.lm_head.weight  # tied, as SmolLM2's
    engine = _engine(model, tokenizer)
    copy = engine.copy.model
    assert engine.generation_model is copy and copy is not model and engine.copy.autocast
    linears = [m for m in copy.modules() if isinstance(m, torch.nn.Linear)]
    assert {m.weight.dtype for m in linears} == {torch.bfloat16}  # every matmul's weight, the output layer's too
    # the embedding and the norms as the trainer holds them: autocast leaves them float32
    assert copy.model.embed_tokens.weight.dtype == torch.float32 and copy.model.norm.weight.dtype == torch.float32
    assert copy.model.embed_tokens.weight is not copy.lm_head.weight  # a tied output layer gets its bf16 copy
    assert not any(p.requires_grad for p in copy.parameters())
    for (name, mine), (_, theirs) in zip(copy.named_buffers(), model.named_buffers()):
        assert mine.dtype == theirs.dtype and torch.equal(mine, theirs), name  # rotary frequencies float32
    assert _matches_master(engine, model)
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # the master is untouched

    _change(model)
    assert not _matches_master(engine, model)  # not refreshed per step: only by the sync
    before = [p.clone() for p in copy.parameters()]
    engine.sync_weights(ModelWeights(model, version=1))
    assert engine.copy.model is copy and _matches_master(engine, model) and engine.copy.refreshes == 1
    assert all(not torch.equal(a, b) for a, b in zip(before, copy.parameters()))
    assert copy.model.embed_tokens.weight is not copy.lm_head.weight


def test_the_all_copy_is_a_bf16_model(make_tiny_model, tokenizer):
    model = make_tiny_model("llama")
    model.model.embed_tokens.weight = model.lm_head.weight
    engine = _engine(model, tokenizer, mode="all")
    copy = engine.copy.model
    assert not engine.copy.autocast and {p.dtype for p in copy.parameters()} == {torch.bfloat16}
    assert copy.model.embed_tokens.weight is copy.lm_head.weight  # tied weights stay tied
    assert {b.dtype for b in copy.buffers()} == {torch.float32}  # as transformers' own bf16 load keeps them
    _change(model)
    engine.sync_weights(ModelWeights(model, version=1))
    assert _matches_master(engine, model)


@pytest.mark.parametrize("mode", ["matmul", "all"])
def test_generation_runs_on_the_copy_and_samples_from_float32_logits(make_tiny_model, tokenizer, monkeypatch, mode):
    model = make_tiny_model("qwen3")
    engine = _engine(model, tokenizer, mode=mode)
    seen = []
    sample_step = decode_module.sample_step

    def recording(logits, uniform, temperature, top_k=0, top_p=1.0):
        tokens, logprobs = sample_step(logits, uniform, temperature, top_k, top_p)
        seen.append((logits.dtype, logprobs.dtype, torch.is_autocast_enabled("cpu")))
        return tokens, logprobs

    monkeypatch.setattr(decode_module, "sample_step", recording)
    heads = []
    handle = engine.copy.model.lm_head.register_forward_hook(lambda m, a, out: heads.append(out.dtype))
    out = engine.generate(_prompts(tokenizer), 2, SamplingParams(max_new_tokens=5, temperature=1.0, seed=0))
    handle.remove()
    assert heads and set(heads) == {torch.bfloat16}  # the copy's bf16 output layer computed the logits
    assert seen and {(a, b) for a, b, _ in seen} == {(torch.float32, torch.float32)}  # log-prob math in float32
    assert {autocast for _, _, autocast in seen} == {mode == "matmul"}
    assert all(c.logprobs and all(lp <= 0 for lp in c.logprobs) for group in out for c in group)
    assert model.training is False and engine.copy.model.training is False


def test_the_matmul_copy_samples_what_the_training_model_under_autocast_samples(make_tiny_model, tokenizer):
    """Its weights are the values autocast gives the trainer's matmuls: the same tokens, the same log-probs."""
    model = make_tiny_model("olmo2")
    params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=4)
    on_the_copy = _engine(model, tokenizer).generate(_prompts(tokenizer), 3, params)
    on_the_model = HFEngine(model, tokenizer, compute_context=lambda: MASTER.autocast(torch.device("cpu"))).generate(
        _prompts(tokenizer), 3, params
    )
    for a, b in zip((c for g in on_the_copy for c in g), (c for g in on_the_model for c in g)):
        assert a.completion_ids == b.completion_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5


@pytest.mark.parametrize("storage", [torch.float32, torch.bfloat16])
def test_no_copy_where_the_weights_are_in_the_compute_dtype(make_tiny_model, tokenizer, storage):
    model = make_tiny_model("llama").to(storage)
    precision = resolve_precision("bf16_compensated", storage)  # compute == storage: float32, or bf16 weights
    engine = _engine(model, tokenizer, precision)
    assert engine.copy is None and engine.generation_model is model
    engine.sync_weights(ModelWeights(model, version=1))
    assert engine.copy is None
    out = engine.generate(_prompts(tokenizer)[:1], 1, SamplingParams(max_new_tokens=3, temperature=1.0, seed=0))
    assert len(out[0][0].completion_ids) >= 1
    assert HFEngine(model, tokenizer).copy is None  # no compute dtype given: never a copy


def test_paths_a_copy_cannot_stand_in_for_keep_the_autocast(make_tiny_model, tokenizer):
    from peft import LoraConfig, inject_adapter_in_model

    model = make_tiny_model("llama")
    assert copy_refusal(model, torch.bfloat16) is None
    mixed = make_tiny_model("llama")
    mixed.lm_head.to(torch.bfloat16)
    assert "mixed dtypes" in copy_refusal(mixed, torch.bfloat16)
    assert "not on the CPU" in copy_refusal(make_tiny_model("llama").to("meta"), torch.bfloat16)
    lora = inject_adapter_in_model(LoraConfig(r=2, target_modules=["q_proj"]), make_tiny_model("llama"))
    assert "LoRA" in copy_refusal(lora, torch.bfloat16)
    engine = _engine(lora, tokenizer)
    assert engine.copy is None and engine.generation_model is lora
    out = engine.generate(_prompts(tokenizer)[:1], 1, SamplingParams(max_new_tokens=3, temperature=1.0, seed=0))
    assert out[0][0].completion_ids


def test_moe_routing_is_recorded_from_the_copys_routers(tokenizer):
    from grpolab.models.routing import routers
    from grpolab.models.tinymodel import build_model

    torch.manual_seed(0)
    experts = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
    model = build_model(tokenizer, "qwen3_moe", hidden_size=32, num_layers=2, num_heads=2, experts=experts).eval()
    engine = _engine(model, tokenizer)
    assert engine.copy is not None
    calls = {"copy": 0, "master": 0}

    def counter(key):
        return lambda *args: calls.__setitem__(key, calls[key] + 1)

    handles = [r.register_forward_hook(counter("copy")) for r in routers(engine.copy.model)]
    handles += [r.register_forward_hook(counter("master")) for r in routers(model)]
    groups = engine.generate(_prompts(tokenizer), 2, SamplingParams(max_new_tokens=6, temperature=1.0, seed=1))
    for handle in handles:
        handle.remove()
    assert calls["copy"] > 0 and calls["master"] == 0
    for c in (c for group in groups for c in group):
        fed = len(c.prompt_ids) + len(c.completion_ids) - 1  # the last sampled token is never fed back
        assert c.routed_experts is not None and (c.routed_experts[:fed] >= 0).all()


@pytest.mark.skipif(not bf16_packing_supported(), reason="needs a CPU with native bf16 (AVX512-BF16, AMX)")
@pytest.mark.parametrize("mode", ["matmul", "all"])
def test_the_bf16_copy_generates_on_packed_weights(make_tiny_model, tokenizer, monkeypatch, mode):
    monkeypatch.setattr(packed_linear, "MIN_PACKED_ELEMENTS_BF16", 0)  # the tiny layers are below the size that pays
    model = make_tiny_model("llama")
    engine = _engine(model, tokenizer, mode=mode)
    head = engine.copy.model.lm_head
    seen = []
    handle = head.register_forward_pre_hook(lambda layer, _: seen.append("forward" in layer.__dict__))
    engine.generate(_prompts(tokenizer), 2, SamplingParams(max_new_tokens=4, temperature=1.0, seed=0))
    handle.remove()
    assert seen and set(seen) == {True} and "forward" not in head.__dict__


@pytest.fixture
def cached_dtypes(monkeypatch) -> set[torch.dtype]:
    """The dtypes the decoding cache's layers return their keys and values in, recorded as they are written."""
    from grpolab.rollout.hf import kv_cache

    seen: set[torch.dtype] = set()
    update = kv_cache.ReservedLayer.update

    def recording(self, *args, **kwargs):
        keys, values = update(self, *args, **kwargs)
        seen.update((keys.dtype, values.dtype))
        return keys, values

    monkeypatch.setattr(kv_cache.ReservedLayer, "update", recording)
    return seen


@pytest.mark.parametrize("family", ["llama", "olmo2"])
def test_under_autocast_the_cache_keeps_its_keys_in_bf16_and_samples_the_same(
    make_tiny_model, tokenizer, monkeypatch, cached_dtypes, family
):
    """The keys leave the rotary embedding in float32 and autocast cast the whole key cache to bf16 at every step;
    the cache now stores each column in bf16 once, when written: the same values reach attention, so the same
    tokens and the bit-identical log-probs come out (the float32 cache as it was, patched back, is the reference)."""
    from grpolab.rollout.hf import kv_cache

    model = make_tiny_model(family)
    params = SamplingParams(max_new_tokens=10, temperature=1.0, seed=11)
    now = _engine(model, tokenizer).generate(_prompts(tokenizer), 3, params)
    assert cached_dtypes == {torch.bfloat16}
    cached_dtypes.clear()
    monkeypatch.setattr(kv_cache, "storage_dtype", lambda states: states.dtype)
    before = _engine(model, tokenizer).generate(_prompts(tokenizer), 3, params)
    if family == "llama":  # OLMo-2's key norm already returns bf16 keys: its cache was bf16 before too
        assert torch.float32 in cached_dtypes
    for a, b in zip((c for g in now for c in g), (c for g in before for c in g)):
        assert a.completion_ids == b.completion_ids and a.logprobs == b.logprobs


def test_without_autocast_the_cache_keeps_the_states_dtype(make_tiny_model, tokenizer, cached_dtypes):
    HFEngine(make_tiny_model("llama"), tokenizer).generate(
        _prompts(tokenizer), 2, SamplingParams(max_new_tokens=4, seed=1)
    )
    assert cached_dtypes == {torch.float32}
