"""Grouped key/value heads attend as they are on a CPU (grpolab.models.grouped_attention): the same
outputs as transformers' sdpa, without its copies of the cache (repeat_kv), switched for generation only."""

from __future__ import annotations

import contextlib

import pytest
import torch
import transformers.integrations.sdpa_attention as sdpa_module

from grpolab.models.grouped_attention import SDPA_GROUPED, grouped_kv_attention
from grpolab.rollout import HFEngine, SamplingParams

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


def test_float32_backward_keeps_the_bf16_forward_and_computes_a_closer_gradient():
    """Float32Backward against float64 attention on the same bf16 inputs (softmax(q k^T / sqrt(d) + mask) v over
    grouped heads): its forward is torch's bf16 kernel's output bit for bit; its gradients come back in bf16 and
    are at least as close to float64's as the bf16 kernel's own backward (the slower one on a CPU)."""
    from grpolab.models.grouped_attention import Float32Backward

    torch.manual_seed(0)
    b, heads, groups, q_len, k_len, d = 3, 6, 3, 7, 11, 16
    inputs = [
        torch.randn(b, n, length, d).bfloat16() for n, length in ((heads, q_len), (groups, k_len), (groups, k_len))
    ]
    mask = torch.ones(q_len, k_len, dtype=torch.bool).tril(k_len - q_len).expand(b, 1, q_len, k_len).clone()
    mask[0, :, :, :3] = False  # a left-padded row
    grad = torch.randn(b, heads, q_len, d).bfloat16()

    def gradients(attend, dtype):
        leaves = [t.detach().clone().to(dtype).requires_grad_() for t in inputs]
        out = attend(*leaves)
        out.backward(grad.to(dtype))
        return out, [t.grad for t in leaves]

    def kernel(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    def formula(q, k, v):  # float64, heads of a group share their key/value head
        k, v = k.repeat_interleave(heads // groups, 1), v.repeat_interleave(heads // groups, 1)
        scores = (q @ k.transpose(-1, -2)) / d**0.5
        return scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v

    ours, ours_grads = gradients(lambda q, k, v: Float32Backward.apply(q, k, v, mask, None), torch.bfloat16)
    bf16, bf16_grads = gradients(kernel, torch.bfloat16)
    exact, exact_grads = gradients(formula, torch.float64)
    assert torch.equal(ours, bf16)
    assert all(g.dtype == torch.bfloat16 for g in ours_grads)
    for mine, theirs, reference in zip(ours_grads, bf16_grads, exact_grads):
        scale = reference.abs().max()
        mine_error = ((mine.double() - reference).abs().max() / scale).item()
        kernel_error = ((theirs.double() - reference).abs().max() / scale).item()
        assert mine_error <= max(kernel_error, 2**-8), (mine_error, kernel_error)


def _learned(model_dir, out, dtype: str, **settings) -> dict:
    """The metrics of one update on a run's first rollout batch."""
    from conftest import quick_config
    from rich.console import Console

    from grpolab.common.progress import Reporter
    from grpolab.run.parts import assemble

    cfg = quick_config(model_dir, out, **{"model.dtype": dtype, "rollout.sync_check": False, **settings})
    parts = assemble(cfg, lambda ranks: Reporter(Console(quiet=True)))
    try:
        return parts.learner.learn(parts.rollouts.batch(1))
    finally:
        parts.close()


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_training_in_bf16_attends_with_a_float32_backward_and_the_same_forward(
    warm_model_dir, tmp_path, monkeypatch, dtype
):
    """A bf16 run's training forwards attend through SDPA_GROUPED's Float32Backward: the same loss, bit for bit,
    as through sdpa, and the gradient's norm within 1% (its backward in float32); a float32 run's attend as the
    model's config says (sdpa), as before."""
    from grpolab.learning.learner import BatchForward
    from grpolab.models import grouped_attention

    calls, original = [], grouped_attention.Float32Backward

    class Counted(original):
        @staticmethod
        def forward(ctx, *args):
            calls.append(1)
            return original.forward(ctx, *args)

    monkeypatch.setattr(grouped_attention, "Float32Backward", Counted)
    metrics = _learned(warm_model_dir, tmp_path / "grouped", dtype)
    assert bool(calls) == (dtype == "bfloat16")
    if dtype == "float32":
        return
    monkeypatch.setattr(BatchForward, "attention", lambda self, model: contextlib.nullcontext())
    calls.clear()
    sdpa = _learned(warm_model_dir, tmp_path / "sdpa", dtype)
    assert calls == []
    assert metrics["loss"] == sdpa["loss"]
    assert abs(metrics["grad_norm"] - sdpa["grad_norm"]) <= 1e-2 * sdpa["grad_norm"]


def test_a_checkpointed_layer_recomputes_its_attention_as_its_forward_ran(warm_model_dir, tmp_path):
    """Gradient checkpointing recomputes each layer in the backward pass, which runs within the step's scope: it
    attends through the same function as the forward did (torch checks that the recomputation saves the same
    tensors), and the gradient is the one without checkpointing (its norm within 1%; the loss itself is a sum of
    rounding here, ratios of 1 times advantages that sum to 0 per group)."""
    plain = _learned(warm_model_dir, tmp_path / "plain", "bfloat16")
    checkpointed = _learned(
        warm_model_dir, tmp_path / "checkpointed", "bfloat16", **{"model.gradient_checkpointing": True}
    )
    assert abs(checkpointed["grad_norm"] - plain["grad_norm"]) <= 1e-2 * plain["grad_norm"]
