"""HFEngine: the rollout contract on tiny random models (no mocks)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from conftest import assert_engine_contract

from grpolab.learning.batching import collate
from grpolab.models.logprobs import token_logprobs
from grpolab.models.weights import ModelWeights
from grpolab.rollout import Completion, HFEngine, RolloutEngine, SamplingParams

PROMPTS = ["12+34=", "7+8=<think>", "a"]


@pytest.fixture
def model(make_tiny_model):
    return make_tiny_model("llama")


@pytest.fixture
def prompts(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(p) for p in PROMPTS]


def _flat(groups: list[list[Completion]]) -> list[Completion]:
    return [c for g in groups for c in g]


def _sampled_logits(model, completions: list[Completion], pad_id: int):
    """Full-forward logits [T, V] that predicted each completion token, and the tokens [T]."""
    batch = collate(completions, pad_id)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    # column t of response_mask <-> logits at t - 1
    resp = batch.response_mask[:, 1:].bool()
    return logits[:, :-1][resp], batch.input_ids[:, 1:][resp]


def test_shapes_and_finish_reasons(model, tokenizer, prompts):
    engine = HFEngine(model, tokenizer, max_batch_size=5)  # 12 rows -> 3 generate calls
    assert isinstance(engine, RolloutEngine)
    assert engine.eos_token_ids == [tokenizer.eos_token_id]
    out = engine.generate(prompts, 4, SamplingParams(max_new_tokens=12, seed=0))
    assert [len(g) for g in out] == [4, 4, 4]
    assert_engine_contract(out, prompts, tokenizer, max_new_tokens=12)


def test_eos_included_and_nothing_after(model, tokenizer, prompts):
    params = SamplingParams(max_new_tokens=16, seed=3)
    free = _flat(HFEngine(model, tokenizer).generate(prompts, 2, params))
    # use a token the model actually emits as the EOS; rerunning with the same seed must cut there
    eos = free[0].completion_ids[2]
    engine = HFEngine(model, tokenizer, eos_token_ids=[eos])
    cut = _flat(engine.generate(prompts, 2, params))
    assert sum(eos in c.completion_ids for c in free) >= 1
    for f, c in zip(free, cut):
        if eos in f.completion_ids:
            k = f.completion_ids.index(eos)
            assert c.completion_ids == f.completion_ids[: k + 1] and c.finish_reason == "stop"
            assert c.logprobs == pytest.approx(f.logprobs[: k + 1], abs=1e-6)
        else:
            assert c.completion_ids == f.completion_ids


@pytest.mark.parametrize("stop_len", [1, 3])
def test_stop_strings_trim(model, tokenizer, prompts, stop_len):
    params = SamplingParams(max_new_tokens=20, temperature=0.8, seed=5)
    engine = HFEngine(model, tokenizer)
    free = _flat(engine.generate(prompts, 2, params))
    text = tokenizer.decode(free[1].completion_ids, skip_special_tokens=False)
    stop = text[4 : 4 + stop_len]
    stopped = _flat(
        engine.generate(
            prompts, 2, SamplingParams(max_new_tokens=20, temperature=0.8, seed=5, stop_strings=(stop, "\x00"))
        )
    )
    for f, s in zip(free, stopped):
        ids = f.completion_ids
        first = next(
            (k for k in range(len(ids)) if stop in tokenizer.decode(ids[: k + 1], skip_special_tokens=False)), None
        )
        if first is None:
            assert s.completion_ids == ids and s.finish_reason == f.finish_reason
        else:
            assert s.completion_ids == ids[: first + 1] and s.finish_reason == "stop"
            assert s.text.endswith(stop)
    assert stopped[1].finish_reason == "stop"


def test_seed_determinism_and_rng_isolation(model, tokenizer, prompts):
    engine = HFEngine(model, tokenizer)
    params = SamplingParams(max_new_tokens=10, seed=11)
    state = torch.get_rng_state()
    a = _flat(engine.generate(prompts, 3, params))
    assert torch.equal(torch.get_rng_state(), state)  # seeded calls leave the global RNG alone
    b = _flat(engine.generate(prompts, 3, params))
    c = _flat(engine.generate(prompts, 3, SamplingParams(max_new_tokens=10, seed=12)))
    assert [x.completion_ids for x in a] == [x.completion_ids for x in b]
    assert [x.completion_ids for x in a] != [x.completion_ids for x in c]


def test_a_share_split_on_a_batch_boundary_samples_what_the_whole_call_samples(model, tokenizer, prompts):
    """Data-parallel ranks: each row's draws are keyed by its global index (``prompt_offset``), so the calls
    of two ranks holding parts of the list draw the same rows as one call over it (any split:
    ``tests/test_refill.py``)."""
    engine = HFEngine(model, tokenizer, max_batch_size=3)  # 3 samples per prompt: one prompt per batch
    params = SamplingParams(max_new_tokens=10, seed=5)
    whole = _flat(engine.generate(prompts, 3, params))
    first = _flat(engine.generate(prompts[:1], 3, params))
    rest = _flat(engine.generate(prompts[1:], 3, replace(params, prompt_offset=1)))  # two batches
    assert [c.completion_ids for c in first + rest] == [c.completion_ids for c in whole]
    without_offset = _flat(engine.generate(prompts[1:], 3, params))  # drawn as the list's first rows
    assert [c.completion_ids for c in without_offset] != [c.completion_ids for c in rest]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "olmo2"])
@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 5, 0.9)])
def test_engine_logprobs_match_token_logprobs(make_tiny_model, tokenizer, prompts, arch, temperature, top_k, top_p):
    model = make_tiny_model(arch)
    params = SamplingParams(max_new_tokens=12, temperature=temperature, top_k=top_k, top_p=top_p, seed=1)
    completions = _flat(HFEngine(model, tokenizer).generate(prompts, 3, params))
    batch = collate(completions, tokenizer.pad_token_id)
    with torch.no_grad():
        lp = token_logprobs(
            model, batch.input_ids, batch.attention_mask, temperature=temperature, chunk_size=5
        ).logprobs
    mask = batch.response_mask.bool()
    assert (batch.engine_logprobs - lp)[mask].abs().max().item() < 1e-4


def test_greedy_is_argmax_continuation(model, tokenizer, prompts):
    out = HFEngine(model, tokenizer).generate(prompts, 2, SamplingParams(max_new_tokens=8, temperature=0))
    for prompt, group in zip(prompts, out):
        assert group[0].completion_ids == group[1].completion_ids
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(len(group[0].completion_ids)):
                ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
        assert group[0].completion_ids == ids[len(prompt) :]
        # greedy log-probs are reported at temperature 1
        batch = collate(group[:1], tokenizer.pad_token_id)
        with torch.no_grad():
            lp = token_logprobs(model, batch.input_ids, batch.attention_mask).logprobs
        m = batch.response_mask.bool()
        assert torch.allclose(batch.engine_logprobs[m], lp[m], atol=1e-4)


def _ranks(model, completions, pad_id):
    """Rank (0 = most likely) of every sampled completion token under the model."""
    logits, tokens = _sampled_logits(model, completions, pad_id)
    chosen = logits.gather(1, tokens[:, None])
    return (logits > chosen).sum(1)


def test_top_k_zero_is_really_disabled(model, tokenizer, prompts):
    """With vocab 107 > 50, tokens ranked >= 50 must be reachable (transformers' default top_k=50
    would make them impossible), even when the model's own generation config says otherwise."""
    assert model.config.vocab_size > 60
    # checkpoint defaults the engine must not inherit (min_p is not a SamplingParams field)
    model.generation_config.top_k = 3
    model.generation_config.min_p = 0.9
    model.generation_config.do_sample = True
    saved = model.generation_config
    params = SamplingParams(max_new_tokens=16, temperature=5.0, top_k=0, seed=0)
    completions = _flat(HFEngine(model, tokenizer).generate(prompts, 8, params))
    assert model.generation_config is saved
    assert _ranks(model, completions, tokenizer.pad_token_id).max().item() >= 50


def test_top_k_and_top_p_are_honoured(model, tokenizer, prompts):
    engine = HFEngine(model, tokenizer)
    topk = _flat(engine.generate(prompts, 6, SamplingParams(max_new_tokens=12, temperature=3.0, top_k=4, seed=0)))
    assert _ranks(model, topk, tokenizer.pad_token_id).max().item() < 4

    temperature, top_p = 2.0, 0.5
    nucleus = _flat(
        engine.generate(prompts, 6, SamplingParams(max_new_tokens=12, temperature=temperature, top_p=top_p, seed=0))
    )
    logits, tokens = _sampled_logits(model, nucleus, tokenizer.pad_token_id)
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    p_tok = probs.gather(1, tokens[:, None])
    mass_above = (probs * (probs > p_tok)).sum(1)  # mass of strictly more likely tokens
    assert (mass_above < top_p + 1e-6).all()
    assert _ranks(model, nucleus, tokenizer.pad_token_id).max().item() >= 1  # not just greedy


def test_mode_restored_and_sync_is_noop(model, tokenizer, prompts):
    engine = HFEngine(model, tokenizer)
    model.train()
    engine.generate(prompts[:1], 1, SamplingParams(max_new_tokens=3, seed=0))
    assert model.training
    model.eval()
    engine.generate(prompts[:1], 1, SamplingParams(max_new_tokens=3, seed=0))
    assert not model.training
    engine.sync_weights(ModelWeights(model))
    assert engine.model is model
    engine.close()


def test_sampling_params_validation():
    with pytest.raises(ValueError):
        SamplingParams(max_new_tokens=0)
    with pytest.raises(ValueError):
        SamplingParams(max_new_tokens=4, top_k=-1)
    with pytest.raises(ValueError):
        SamplingParams(max_new_tokens=4, top_p=0.0)
    with pytest.raises(ValueError):
        SamplingParams(max_new_tokens=4, stop_strings="</answer>")  # type: ignore[arg-type]
    assert SamplingParams(max_new_tokens=4, temperature=0).greedy


@pytest.mark.parametrize("arch", ["llama", "qwen3", "olmo2"])
def test_shared_prefill_samples_what_a_full_prefill_does(make_tiny_model, tokenizer, prompts, arch):
    """Each distinct prompt is prefilled once for its n samples (max_batch_size 5 splits a group between the
    first batch and the rows that join it): the same tokens, finish reasons and log-probs as a prefill of every
    row."""
    model = make_tiny_model(arch)
    backbone = model.get_decoder()
    widths: list[tuple[int, int]] = []
    hook = backbone.register_forward_pre_hook(
        lambda _, args, kwargs: widths.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )
    try:
        for params in (
            SamplingParams(max_new_tokens=10, temperature=0),
            SamplingParams(max_new_tokens=10, seed=5),
            SamplingParams(max_new_tokens=10, seed=5, stop_strings=["4"]),
        ):
            runs = {}
            for shared in (True, False):
                widths.clear()
                # refill_fraction 1: rows join 5 at a time (the last 2 once 2 places are free)
                engine = HFEngine(model, tokenizer, max_batch_size=5, shared_prefill=shared, refill_fraction=1.0)
                runs[shared] = _flat(engine.generate(prompts, 4, params))
                # prompts of 6, 5 and 1 tokens x 4 rows, 5 rows at a time: their prompts are 6, 5 and 1 wide
                prefills = [w for w in widths if w[1] > 1]
                # shared: the 2 distinct prompts of each group, all but their last column; then a token per row.
                # Not shared: the first batch's whole prompts, then each joining row's all but its last column
                # (that column is computed with the running rows' next token); 1-token prompts: nothing to prefill
                assert prefills == ([(2, 5), (2, 4)] if shared else [(5, 6), (5, 4)])
            for a, b in zip(runs[True], runs[False]):
                assert (a.completion_ids, a.finish_reason) == (b.completion_ids, b.finish_reason)
                assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    finally:
        hook.remove()


@pytest.mark.parametrize("arch", ["llama", "qwen3", "olmo2"])
@pytest.mark.parametrize("n", [1, 3])
def test_a_prefix_all_prompts_share_is_prefilled_once(make_tiny_model, tokenizer, arch, n):
    """Prompts opening with the same 10 tokens (a system prompt's stand-in): the backbone runs over those
    once, then over each distinct prompt's rest, then a token per row; the tokens sampled are those of a
    full prefill of every row, at the log-probs of the model's own unpadded forward. n = 1 (evaluation)
    shares the prefix too."""
    model = make_tiny_model(arch)
    prompts = [tokenizer.encode(p) for p in ("Question: 12+34=", "Question: 7+8=", "Question: 5*6=<think>")]
    widths: list[tuple[int, int]] = []
    hook = model.get_decoder().register_forward_pre_hook(
        lambda _, args, kwargs: widths.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )
    params = SamplingParams(max_new_tokens=8, seed=11)
    try:
        shared = _flat(HFEngine(model, tokenizer, shared_prefill=True).generate(prompts, n, params))
        prefills = [w for w in widths if w[1] > 1]
        full = _flat(HFEngine(model, tokenizer, shared_prefill=False).generate(prompts, n, params))
    finally:
        hook.remove()
    rest = max(len(p) for p in prompts) - 10 - 1  # the longest prompt's rest, all but its last token
    assert prefills == [(1, 10), (3, rest)]
    assert [(c.completion_ids, c.finish_reason) for c in shared] == [(c.completion_ids, c.finish_reason) for c in full]
    logits, tokens = _sampled_logits(model, shared, tokenizer.pad_token_id)
    own = torch.log_softmax(logits.float(), -1).gather(1, tokens[:, None]).squeeze(1)
    assert torch.tensor([lp for c in shared for lp in c.logprobs]) == pytest.approx(own, abs=1e-5)


def test_prompt_layout_puts_the_shared_prefix_left_and_the_rest_right():
    from grpolab.rollout.hf.decode import left_padded_positions
    from grpolab.rollout.hf.prefill import prompt_layout

    ids, mask = prompt_layout([[5, 6, 7, 8], [5, 6, 9]], pad_id=0, prefix=2)
    assert ids.tolist() == [[5, 6, 7, 8], [5, 6, 0, 9]]
    assert mask.tolist() == [[1, 1, 1, 1], [1, 1, 0, 1]]
    assert left_padded_positions(mask).tolist() == [[0, 1, 2, 3], [0, 1, 1, 2]]
    ids, mask = prompt_layout([[5, 6, 7, 8], [5, 6, 9]], pad_id=0)
    assert (ids.tolist(), mask.tolist()) == ([[5, 6, 7, 8], [0, 5, 6, 9]], [[1, 1, 1, 1], [0, 1, 1, 1]])


def test_a_short_common_prefix_is_not_prefilled_apart(make_tiny_model, tokenizer):
    """Two distinct prompts sharing 3 tokens save 3 positions (< MIN_SAVED_TOKENS): one prefill of both."""
    model = make_tiny_model("llama")
    widths: list[tuple[int, int]] = []
    hook = model.get_decoder().register_forward_pre_hook(
        lambda _, args, kwargs: widths.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )
    try:
        HFEngine(model, tokenizer).generate(
            [tokenizer.encode("abc12"), tokenizer.encode("abc345")], 2, SamplingParams(max_new_tokens=2, seed=0)
        )
    finally:
        hook.remove()
    assert [w for w in widths if w[1] > 1] == [(2, 5)]
