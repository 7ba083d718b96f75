"""Prepacked linear layers for generation on a CPU (grpolab.rollout.hf.packed_linear), on tiny real models."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from grpolab.learning.batching import collate
from grpolab.models.logprobs import token_logprobs
from grpolab.rollout import HFEngine, SamplingParams
from grpolab.rollout.hf import packed_linear
from grpolab.rollout.hf.packed_linear import bf16_packing_supported, packed_linears, packing_applies

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")


@pytest.fixture
def pack_every_layer(monkeypatch):
    """The tiny models' layers are all under the size that pays: pack them all the same."""
    monkeypatch.setattr(packed_linear, "MIN_PACKED_ELEMENTS", 0)
    monkeypatch.setattr(packed_linear, "MIN_PACKED_ELEMENTS_BF16", 0)


def _linears(model: nn.Module) -> list[nn.Linear]:
    return [m for m in model.modules() if type(m) is nn.Linear]


def _is_packed(layer: nn.Module) -> bool:
    return "forward" in layer.__dict__


@pytest.mark.parametrize("arch", ["llama", "qwen3", "olmo2"])
def test_packed_layers_give_the_models_own_logits_and_are_restored_after(make_tiny_model, arch, pack_every_layer):
    model = make_tiny_model(arch)
    ids = torch.randint(0, model.config.vocab_size, (3, 7))
    with torch.no_grad():
        before = model(input_ids=ids).logits
        with packed_linears(model, rows=3) as packed:
            assert packed and all(map(_is_packed, _linears(model)))
            inside = model(input_ids=ids).logits
        after = model(input_ids=ids).logits
    assert not any(map(_is_packed, _linears(model)))
    assert torch.equal(after, before)
    assert (inside - before).abs().max().item() < 1e-5


def test_a_shared_weight_is_packed_once_and_an_error_inside_restores_every_layer(
    make_tiny_model, monkeypatch, pack_every_layer
):
    model = make_tiny_model("llama")
    layers = model.model.layers
    layers[1].mlp.up_proj.weight = layers[0].mlp.up_proj.weight  # shared: one weight, one packed copy
    reorders = []
    original = torch.ops.mkldnn._reorder_linear_weight

    def count(weight, rows):
        reorders.append(weight.data_ptr())
        return original(weight, rows)

    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", count)
    with pytest.raises(RuntimeError, match="inside"), packed_linears(model, rows=4):
        raise RuntimeError("inside")
    weights = {m.weight.data_ptr() for m in _linears(model)}
    assert sorted(reorders) == sorted(weights) and len(weights) < len(_linears(model))
    assert not any(map(_is_packed, _linears(model)))


def test_only_layers_large_enough_to_gain_are_packed(make_tiny_model, monkeypatch):
    model = make_tiny_model("llama")  # hidden 32, vocabulary 107
    assert not packing_applies(model)
    monkeypatch.setattr(packed_linear, "MIN_PACKED_ELEMENTS", model.lm_head.weight.numel())
    with torch.no_grad(), packed_linears(model, rows=2) as packed:
        assert packed and [m for m in _linears(model) if _is_packed(m)] == [model.lm_head]


def test_packing_stays_off_where_it_does_not_apply(make_tiny_model, pack_every_layer):
    model = make_tiny_model("llama")
    assert packing_applies(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the trainer's bf16 compute context
        assert not packing_applies(model)
        with packed_linears(model, rows=2) as packed:
            assert not packed and not any(map(_is_packed, _linears(model)))
    mixed = make_tiny_model("llama")
    mixed.lm_head.to(torch.bfloat16)
    assert not packing_applies(mixed)  # one dtype throughout, or nothing
    # bf16 weights: packed where oneDNN runs bf16 natively (AVX512-BF16, AMX), else not
    assert packing_applies(model.to(torch.bfloat16)) == bf16_packing_supported()


needs_bf16 = pytest.mark.skipif(not bf16_packing_supported(), reason="needs a CPU with native bf16 (AVX512-BF16, AMX)")


@needs_bf16
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_bf16_packed_layers_give_bf16_f_linears_logits(make_tiny_model, arch, pack_every_layer):
    model = make_tiny_model(arch).to(torch.bfloat16)
    ids = torch.randint(0, model.config.vocab_size, (5, 9))
    with torch.no_grad():
        before = model(input_ids=ids).logits
        with packed_linears(model, rows=5) as packed:
            assert packed and all(map(_is_packed, _linears(model)))
            inside = model(input_ids=ids).logits
    assert not any(map(_is_packed, _linears(model)))
    assert inside.dtype == before.dtype == torch.bfloat16
    # the same bf16 products in another summation order at most: within bf16 rounding of the logits
    torch.testing.assert_close(inside.float(), before.float(), rtol=2**-7, atol=2**-7 * before.abs().max().item())


@needs_bf16
def test_bf16_weights_under_bf16_autocast_are_packed_as_autocasts_linear(make_tiny_model, pack_every_layer):
    """The hf engine's copy of float32 masters: bf16 linear weights, float32 norms and embedding, generating
    under the trainer's autocast. A packed layer casts its float32 input to bf16 as autocast's linear does."""
    model = make_tiny_model("llama")
    for layer in _linears(model):
        layer.to(torch.bfloat16)
    ids = torch.randint(0, model.config.vocab_size, (4, 6))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        before = model(input_ids=ids).logits
        with packed_linears(model, rows=4) as packed:
            assert packed
            inside = model(input_ids=ids).logits
    assert inside.dtype == before.dtype
    torch.testing.assert_close(inside.float(), before.float(), rtol=2**-7, atol=2**-7 * before.abs().max().item())
    with torch.autocast("cpu", dtype=torch.float16):  # another autocast dtype decides the matmul itself
        assert not packing_applies(model)


@needs_bf16
def test_bf16_layers_are_packed_from_their_own_size_up(make_tiny_model, monkeypatch):
    model = make_tiny_model("llama").to(torch.bfloat16)  # hidden 32, vocabulary 107
    assert not packing_applies(model)  # every layer below MIN_PACKED_ELEMENTS_BF16
    monkeypatch.setattr(packed_linear, "MIN_PACKED_ELEMENTS_BF16", model.lm_head.weight.numel())
    monkeypatch.setattr(packed_linear, "MIN_PACKED_ELEMENTS", 0)  # the float32 threshold does not apply
    with torch.no_grad(), packed_linears(model, rows=2) as packed:
        assert packed and [m for m in _linears(model) if _is_packed(m)] == [model.lm_head]


@pytest.mark.parametrize("pack", [True, False])
def test_the_hf_engine_samples_on_packed_weights_at_the_trainers_logprobs(
    make_tiny_model, tokenizer, pack, pack_every_layer
):
    """The engine generates through packed layers (pack_weights, the default) and the sampled tokens'
    log-probs stay the trainer's; after a weight change the next call packs the new weights."""
    model = make_tiny_model("llama")
    prompts = [tokenizer.encode(p) for p in ("12+34=", "7+8=", "a")]
    seen: list[bool] = []
    hook = model.lm_head.register_forward_pre_hook(lambda layer, _: seen.append(_is_packed(layer)))
    engine = HFEngine(model, tokenizer, pack_weights=pack)
    params = SamplingParams(max_new_tokens=10, temperature=0.9, seed=3)
    try:
        for _ in range(2):
            seen.clear()
            completions = [c for g in engine.generate(prompts, 4, params) for c in g]
            assert seen and set(seen) == {pack}
            batch = collate(completions, tokenizer.pad_token_id)
            with torch.no_grad():
                lp = token_logprobs(model, batch.input_ids, batch.attention_mask, temperature=0.9).logprobs
            mask = batch.response_mask.bool()
            assert (batch.engine_logprobs - lp)[mask].abs().max().item() < 1e-4
            with torch.no_grad():  # a training step's worth of change
                for p in model.parameters():
                    p.add_(torch.randn_like(p), alpha=0.05)
    finally:
        hook.remove()
    assert not any(map(_is_packed, _linears(model)))
