"""token_logprobs against a naive float64 full-logits reference, for 4 architectures."""

from __future__ import annotations

import pytest
import torch

from grpolab.models.logprobs import TokenStats, enable_gradient_checkpointing, token_logprobs

ARCHS = ("llama", "qwen2", "qwen3", "olmo2")


def _batch(vocab: int, lengths: list[int], pad_id: int = 0, seed: int = 0):
    """Right-padded random batch: (input_ids [N, L], attention_mask [N, L])."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(lengths), width), dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(3, vocab, (n,), generator=g)
        mask[i, :n] = 1
    return ids, mask


def naive_stats(model, ids, mask, temperature=1.0) -> TokenStats:
    """Full [N, L, V] logits -> float64 log_softmax -> gather; entropy = -sum p log p."""
    logits = model(input_ids=ids, attention_mask=mask).logits.double() / temperature
    logp_all = torch.log_softmax(logits[:, :-1], dim=-1)
    logp = logp_all.gather(-1, ids[:, 1:, None]).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    zero = logp.new_zeros(ids.shape[0], 1)
    m = mask.double()
    return TokenStats(torch.cat([zero, logp], 1) * m, torch.cat([zero, ent], 1) * m)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("chunk_size,temperature", [(4, 1.0), (7, 0.7), (64, 1.3), (1, 1.0)])
def test_matches_naive_reference(make_tiny_model, arch, chunk_size, temperature):
    model = make_tiny_model(arch)
    ids, mask = _batch(model.config.vocab_size, [13, 9, 5])  # L = 13: chunk 4 and 7 don't divide
    with torch.no_grad():
        got = token_logprobs(model, ids, mask, temperature=temperature, chunk_size=chunk_size, with_entropy=True)
        ref = naive_stats(model, ids, mask, temperature)
    assert got.logprobs.dtype == torch.float32 and got.logprobs.shape == ids.shape
    assert got.entropy is not None and got.entropy.shape == ids.shape
    torch.testing.assert_close(got.logprobs.double(), ref.logprobs, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(got.entropy.double(), ref.entropy, atol=2e-5, rtol=1e-5)
    assert (got.logprobs[:, 0] == 0).all() and (got.logprobs[mask == 0] == 0).all()
    assert (got.logprobs[:, 1:][mask[:, 1:] == 1] < 0).all()


def test_entropy_off_by_default(make_tiny_model):
    model = make_tiny_model("llama")
    ids, mask = _batch(model.config.vocab_size, [6, 4])
    with torch.no_grad():
        assert token_logprobs(model, ids, mask).entropy is None


@pytest.mark.parametrize("arch", ARCHS)
def test_gradients_match_naive(make_tiny_model, arch):
    model = make_tiny_model(arch)
    ids, mask = _batch(model.config.vocab_size, [11, 8, 3], seed=1)
    g = torch.Generator().manual_seed(2)
    w_lp, w_ent = torch.randn(ids.shape, generator=g), torch.randn(ids.shape, generator=g)
    params = [p for p in model.parameters() if p.requires_grad]

    def grads(stats: TokenStats) -> list[torch.Tensor]:
        loss = (stats.logprobs.float() * w_lp).sum() + (stats.entropy.float() * w_ent).sum()
        return torch.autograd.grad(loss, params)

    got = grads(token_logprobs(model, ids, mask, temperature=0.8, chunk_size=3, with_entropy=True))
    ref = grads(naive_stats(model, ids, mask, temperature=0.8))
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_with_decoder_gradient_checkpointing(make_tiny_model):
    model = make_tiny_model("qwen3")
    ids, mask = _batch(model.config.vocab_size, [9, 6], seed=3)
    plain = torch.autograd.grad(token_logprobs(model, ids, mask, chunk_size=4).logprobs.sum(), list(model.parameters()))
    enable_gradient_checkpointing(model)
    model.train()  # checkpointing is only active in train mode; dropout is 0 in these configs
    ckpt = torch.autograd.grad(token_logprobs(model, ids, mask, chunk_size=4).logprobs.sum(), list(model.parameters()))
    for a, b in zip(ckpt, plain):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_bf16_model_gives_fp32_math(make_tiny_model):
    model = make_tiny_model("olmo2").to(torch.bfloat16)
    ids, mask = _batch(model.config.vocab_size, [10, 7], seed=4)
    with torch.no_grad():
        got = token_logprobs(model, ids, mask, chunk_size=4, with_entropy=True)
        ref = naive_stats(model, ids, mask)  # bf16 logits, float64 softmax
    assert got.logprobs.dtype == torch.float32 and got.entropy.dtype == torch.float32
    torch.testing.assert_close(got.logprobs.double(), ref.logprobs, atol=1e-4, rtol=1e-4)


def test_rejects_bad_arguments(make_tiny_model):
    model = make_tiny_model("llama")
    ids, mask = _batch(model.config.vocab_size, [4])
    with pytest.raises(ValueError):
        token_logprobs(model, ids, mask, temperature=0.0)
    with pytest.raises(ValueError):
        token_logprobs(model, ids, mask, chunk_size=0)
    with pytest.raises(ValueError):
        token_logprobs(model, ids, mask[:, :2])
