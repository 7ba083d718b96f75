"""Grouped key/value heads attend as they are on a CPU (grpolab.rollout.hf.grouped_attention): the same
outputs as transformers' sdpa, without its copies of the cache (repeat_kv), switched for generation only."""

from __future__ import annotations

import contextlib

import pytest
import torch
import transformers.integrations.sdpa_attention as sdpa_module

from grpolab.rollout import HFEngine, SamplingParams
from grpolab.rollout.hf.grouped_attention import SDPA_GROUPED, grouped_kv_attention

PROMPTS = ["12+34=", "7+8=<think>", "a"]  # of different lengths: the batch has a padding mask


@pytest.fixture
def repeats(monkeypatch) -> list[int]:
    """The calls of transformers' repeat_kv (the copy of grouped heads), recorded; each still runs."""
    calls, real = [], sdpa_module.repeat_kv
    monkeypatch.setattr(sdpa_module, "repeat_kv", lambda h, n: calls.append(n) or real(h, n))
    return calls


def _padded(tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    rows = [tokenizer.encode(p) for p in PROMPTS]
    width = max(map(len, rows))
    ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


@pytest.mark.parametrize("arch", ["llama", "qwen3", "olmo2"])
def test_grouped_attention_gives_sdpas_logits_without_repeating_heads(make_tiny_model, tokenizer, repeats, arch):
    """A padded prefill and two cached decoding steps: logits within float32 rounding of sdpa's, and
    repeat_kv never called (sdpa calls it in every layer of every step here)."""
    model = make_tiny_model(arch)
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    ids, mask = _padded(tokenizer)
    logits = {}
    for grouped in (False, True):
        repeats.clear()
        with torch.no_grad(), grouped_kv_attention(model) if grouped else contextlib.nullcontext(False) as switched:
            assert switched is grouped
            out = model(input_ids=ids, attention_mask=mask, use_cache=True)
            steps, cache, step_mask = [out.logits], out.past_key_values, mask
            for _ in range(2):
                step_mask = torch.cat([step_mask, torch.ones(len(ids), 1, dtype=step_mask.dtype)], 1)
                out = model(
                    input_ids=out.logits[:, -1:].argmax(-1),
                    attention_mask=step_mask,
                    past_key_values=cache,
                    use_cache=True,
                )
                steps.append(out.logits)
        logits[grouped] = torch.cat(steps, 1)
        assert (len(repeats) == 0) == grouped
    assert model.config._attn_implementation == "sdpa"
    torch.testing.assert_close(logits[True], logits[False], rtol=0, atol=1e-5)


def test_generation_attends_grouped_and_restores_sdpa(make_tiny_model, tokenizer, repeats):
    """The hf engine generates without repeat_kv and leaves the model on sdpa, after an error too."""
    model = make_tiny_model("llama")
    engine = HFEngine(model, tokenizer)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    out = engine.generate(prompts, 2, SamplingParams(max_new_tokens=6, seed=0))
    assert all(len(c.completion_ids) >= 1 for group in out for c in group)
    assert repeats == [] and model.config._attn_implementation == "sdpa"
    with pytest.raises(RuntimeError, match="inside"), grouped_kv_attention(model):
        assert model.config._attn_implementation == SDPA_GROUPED
        raise RuntimeError("inside")
    assert model.config._attn_implementation == "sdpa"


def test_other_attention_kernels_are_left_alone(make_tiny_model):
    model = make_tiny_model("llama")
    model.config._attn_implementation = "eager"
    with grouped_kv_attention(model) as switched:
        assert switched is False and model.config._attn_implementation == "eager"
