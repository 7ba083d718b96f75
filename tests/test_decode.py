"""The hf engine's decoding loop: the sampling step against its formula in float64, and decoding with
finished rows dropped against decoding with every row kept to the end."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grpolab.rollout.hf.decode import compaction, decode, sample_step


def reference_step(logits: np.ndarray, u: float, temperature: float, top_k: int, top_p: float) -> tuple[int, float]:
    """One row in float64 from the definitions: log p = log softmax(logits / T); the sampling distribution
    keeps the k largest (ties by index), then the smallest prefix by decreasing probability whose mass
    reaches top_p; the token is the first whose cumulative sampling probability exceeds u."""
    z = logits.astype(np.float64) / temperature
    logp = z - z.max() - np.log(np.exp(z - z.max()).sum())
    keep = np.ones(len(z), dtype=bool)
    order = np.argsort(-z, kind="stable")
    if top_k > 0:
        keep[:] = False
        keep[order[:top_k]] = True
    if top_p < 1.0:
        p = np.where(keep, np.exp(z - z.max()), 0.0)
        p /= p.sum()
        mass = np.cumsum(p[order])
        cut = np.zeros(len(z), dtype=bool)
        cut[order[: int(np.searchsorted(mass, top_p, side="left")) + 1]] = True
        keep &= cut
    p = np.where(keep, np.exp(z - z.max()), 0.0)
    p /= p.sum()
    token = int(np.searchsorted(np.cumsum(p), u, side="right"))
    return token, float(logp[token])


@settings(max_examples=200, deadline=None)
@given(
    st.integers(0, 2**32 - 1),
    st.sampled_from([0.7, 1.0, 1.3]),
    st.sampled_from([0, 1, 5]),
    st.sampled_from([1.0, 0.9, 0.5]),
)
def test_sampling_step_is_its_formula(seed, temperature, top_k, top_p):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(6, 40, generator=g) * 3
    uniform = torch.rand(6, generator=g, dtype=torch.float64)
    tokens, logprobs = sample_step(logits.clone(), uniform, temperature, top_k, top_p)
    for row in range(6):
        token, logp = reference_step(logits[row].numpy(), float(uniform[row]), temperature, top_k, top_p)
        # a draw within float32 rounding of a cumulative boundary may fall either side of it
        if tokens[row] != token:
            z = logits[row].double() / temperature
            assert abs(torch.softmax(z, -1)[: min(token, int(tokens[row])) + 1].sum() - uniform[row]) < 1e-5
            continue
        assert logprobs[row].item() == pytest.approx(logp, abs=1e-5)


def test_sampled_frequencies_follow_the_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -30.0]])
    probs = torch.softmax(logits.double() / 0.8, -1)[0]
    draws = torch.rand(200_000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    tokens, _ = sample_step(logits.expand(len(draws), -1).clone(), draws, 0.8)
    freq = torch.bincount(tokens, minlength=5).double() / len(draws)
    assert (freq - probs).abs().max() < 4 * (probs * (1 - probs) / len(draws)).sqrt().max()
    assert freq[4] == 0


def test_greedy_is_the_argmax_with_its_temperature_one_logprob():
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(1))
    tokens, logprobs = sample_step(logits.clone(), None, 0.0)
    assert torch.equal(tokens, logits.argmax(-1))
    torch.testing.assert_close(logprobs, torch.log_softmax(logits, -1).max(-1).values)


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_dropping_finished_rows_changes_no_rows_tokens(make_tiny_model, tokenizer, temperature):
    """Rows leave the batch as they end (every step, or once half the rows have ended) and decode what
    they decode kept to the end: each row's draws and logits are its own."""
    model = make_tiny_model("llama").eval()
    prompts = [tokenizer.encode(p) for p in ("12+34=", "7+8=<think>", "a", "99+1=")]
    width = max(map(len, prompts))
    ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in prompts]).repeat_interleave(3, 0)
    mask = (torch.arange(width) >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
    mask = mask.repeat_interleave(3, 0)
    eos = tokenizer.encode("5")  # a character tiny random models emit: rows end at different steps
    runs = {}
    for drop in (0.0, 0.5, float("inf")):
        torch.manual_seed(7)
        with torch.no_grad():
            runs[drop] = decode(
                model,
                ids,
                mask,
                max_new_tokens=24,
                temperature=temperature,
                top_k=0,
                top_p=1.0,
                eos_token_ids=eos,
                drop_fraction=drop,
            )
    kept = runs[float("inf")]
    assert any(kept.stopped) and not all(kept.stopped)
    assert len({len(t) for t in kept.tokens}) > 2
    for out in runs.values():
        assert out.tokens == kept.tokens and out.stopped == kept.stopped
        for a, b in zip(out.logprobs, kept.logprobs):
            assert a == pytest.approx(b, abs=1e-5)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.booleans(), min_size=1, max_size=40))
def test_compaction_keeps_the_live_rows_and_moves_only_those_past_the_kept_count(live):
    """Every live row is kept once; a live row among the first k (k = live rows) keeps its place; each row
    that moves comes from past k, into an ended row's place. No live row: row 0 alone, idle."""
    keep = compaction(live)
    k = sum(live)
    if not k:
        assert keep == [0]
        return
    assert sorted(keep) == [i for i, alive in enumerate(live) if alive]
    for place, row in enumerate(keep):
        assert row == place if live[place] else row >= k
