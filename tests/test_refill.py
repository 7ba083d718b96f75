"""The hf engine's refill: a call's rows join one running decoding batch as rows end, and every row samples what
it samples in any batch (counter-based draws, ``grpolab.rollout.hf.draws``). Tiny random models, no mocks."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from grpolab.rollout import Completion, HFEngine, SamplingParams
from grpolab.rollout.hf.draws import uniforms

# prompts of different lengths (left padding at every join) and a shared opening (a shared prefill at joins)
PROMPTS = ["12+34=", "7+8=<think>", "a", "Question: 5*6=", "Question: 99+1=<think>", "bc"]


@pytest.fixture
def prompts(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(p) for p in PROMPTS]


def _flat(groups: list[list[Completion]]) -> list[Completion]:
    return [c for g in groups for c in g]


def _same(a: list[Completion], b: list[Completion]) -> None:
    assert [(c.completion_ids, c.finish_reason) for c in a] == [(c.completion_ids, c.finish_reason) for c in b]
    for x, y in zip(a, b):
        assert x.logprobs == pytest.approx(y.logprobs, abs=5e-5)  # float32 rounding of other batch shapes


def _engine(model, tokenizer, rows: int, **kwargs) -> HFEngine:
    return HFEngine(model, tokenizer, max_batch_size=rows, eos_token_ids=[tokenizer.eos_token_id, *EOS], **kwargs)


EOS: list[int] = []


@pytest.fixture(autouse=True)
def _eos(tokenizer):
    """'5' ends rows too: tiny random models emit it often, so rows end at many different steps."""
    EOS[:] = tokenizer.encode("5")
    yield
    EOS.clear()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("shared", [True, False])
def test_a_call_of_three_batches_samples_what_one_batch_of_every_row_samples(
    make_tiny_model, tokenizer, prompts, arch, shared
):
    """6 prompts x 3 samples = 18 rows through a batch of 6 (rows join as others end) give the tokens, finish
    reasons and log-probs of one batch of 18; and the batch stays full while rows wait."""
    model = make_tiny_model(arch)
    params = SamplingParams(max_new_tokens=16, temperature=1.0, seed=7)
    whole = _engine(model, tokenizer, 18, shared_prefill=shared)
    one = _flat(whole.generate(prompts, 3, params))
    refilled = _engine(model, tokenizer, 6, shared_prefill=shared, refill_fraction=0.0)
    three = _flat(refilled.generate(prompts, 3, params))
    _same(three, one)
    assert len({len(c.completion_ids) for c in one}) > 3  # rows end at many steps: refill really interleaves
    assert whole.step_rows[0] == 18 and max(refilled.step_rows) == 6
    # refill_fraction 0: a place is filled at the step it frees, so the batch holds 6 live rows until no row
    # waits, then only shrinks; every row a forward computes is live (its logits give a token)
    full = next(i for i, rows in enumerate(refilled.step_rows) if rows < 6)
    assert set(refilled.step_rows[:full]) == {6}
    assert refilled.step_rows[full:] == sorted(refilled.step_rows[full:], reverse=True)
    assert sum(refilled.step_rows) == sum(len(c.completion_ids) for c in three)


def test_refill_at_a_fraction_waits_for_free_places(make_tiny_model, tokenizer, prompts):
    """refill_fraction 0.5 of 6 places: rows join only once 3 places are free (or every waiting row fits):
    the batch then runs with 4 or 5 live rows at some steps, and still samples the same completions."""
    model = make_tiny_model("llama")
    params = SamplingParams(max_new_tokens=16, seed=3)
    eager = _engine(model, tokenizer, 6, refill_fraction=0.0)
    lazy = _engine(model, tokenizer, 6, refill_fraction=0.5)
    _same(_flat(lazy.generate(prompts, 3, params)), _flat(eager.generate(prompts, 3, params)))
    assert {4, 5} & set(lazy.step_rows)


@pytest.mark.parametrize("rows", [1, 4, 7, 30])
def test_completions_do_not_depend_on_max_batch_size(make_tiny_model, tokenizer, prompts, rows):
    model = make_tiny_model("llama")
    params = SamplingParams(max_new_tokens=10, temperature=0.9, seed=11)
    _same(
        _flat(_engine(model, tokenizer, rows).generate(prompts, 5, params)),
        _flat(_engine(model, tokenizer, 30).generate(prompts, 5, params)),
    )


def test_a_rank_samples_what_one_process_samples_for_its_rows_whatever_the_split(make_tiny_model, tokenizer, prompts):
    """Data-parallel ranks: any split of the prompt list (not only on batch boundaries), each share called with
    its ``prompt_offset``, samples exactly the whole call's rows."""
    engine = _engine(make_tiny_model("llama"), tokenizer, 4)
    params = SamplingParams(max_new_tokens=10, seed=5)
    whole = _flat(engine.generate(prompts, 3, params))
    for cut in (1, 2, 5):
        first = _flat(engine.generate(prompts[:cut], 3, params))
        rest = _flat(engine.generate(prompts[cut:], 3, replace(params, prompt_offset=cut)))
        _same(first + rest, whole)
    unplaced = _flat(engine.generate(prompts[2:], 3, params))  # seeded as the list's first rows
    assert [c.completion_ids for c in unplaced] != [c.completion_ids for c in whole[6:]]


def test_stop_strings_eos_and_the_token_limit_end_rows_under_refill(make_tiny_model, tokenizer, prompts):
    """Each way a row ends, under refill (batch of 4) and in one batch of every row: the same rows, each ending
    where its own rule says."""
    model = make_tiny_model("qwen3")
    params = SamplingParams(max_new_tokens=12, temperature=0.8, seed=2)
    free = _flat(_engine(model, tokenizer, 18).generate(prompts, 3, params))
    # stop strings the free completions hold (one a single character, one of two) but not every one of them
    params = replace(
        params,
        stop_strings=(tokenizer.decode(free[4].completion_ids[3:5]), tokenizer.decode(free[9].completion_ids[2:3])),
    )
    refilled = _flat(_engine(model, tokenizer, 4, refill_fraction=0.0).generate(prompts, 3, params))
    _same(refilled, _flat(_engine(model, tokenizer, 18).generate(prompts, 3, params)))
    reasons = set()
    for c in refilled:
        text = tokenizer.decode(c.completion_ids, skip_special_tokens=False)
        if c.finish_reason == "length":
            assert len(c.completion_ids) == 12 and not any(s in text for s in params.stop_strings)
            reasons.add("length")
        elif c.completion_ids[-1] in [tokenizer.eos_token_id, *EOS]:
            reasons.add("eos")
        else:
            assert any(text.endswith(s) for s in params.stop_strings)
            assert not any(s in tokenizer.decode(c.completion_ids[:-1]) for s in params.stop_strings)
            reasons.add("stop string")
        assert not set(c.completion_ids[:-1]) & {tokenizer.eos_token_id, *EOS}
    assert reasons == {"length", "eos", "stop string"}


def test_greedy_under_refill_is_model_generate(make_tiny_model, tokenizer, prompts):
    model = make_tiny_model("llama")
    out = _flat(
        HFEngine(model, tokenizer, max_batch_size=2, refill_fraction=0.0).generate(
            prompts, 1, SamplingParams(max_new_tokens=8, temperature=0)
        )
    )
    for prompt, c in zip(prompts, out):
        with torch.no_grad():
            ref = model.generate(
                torch.tensor([prompt]),
                max_new_tokens=8,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
            )[0, len(prompt) :].tolist()
        assert c.completion_ids == ref


def test_uniforms_are_a_function_of_seed_row_and_token_index():
    a = uniforms(9, [0, 1, 2, 3], [0, 0, 5, 5])
    assert a.dtype == torch.float64 and ((a >= 0) & (a < 1)).all()
    assert torch.equal(uniforms(9, [3, 0], [5, 0]), a[[3, 0]])  # no state: order and company do not matter
    assert len(set(a.tolist())) == 4 and not torch.equal(uniforms(10, [0, 1, 2, 3], [0, 0, 5, 5]), a)
    assert torch.equal(uniforms(9 + 2**64, [1], [0]), uniforms(9, [1], [0]))  # seeds modulo 2**64
    many = uniforms(1, list(range(4000)) * 25, [t for t in range(25) for _ in range(4000)])
    assert abs(many.mean().item() - 0.5) < 0.01 and abs(many.var().item() - 1 / 12) < 0.005


def test_join_rows_trims_the_shared_padding_and_left_pads_the_narrower_side(make_tiny_model):
    """A running cache of 2 rows x 5 columns (its first 2 columns padding in every row) joined by 3 rows x 4
    columns: 5 rows x 4 columns, the running rows' last 3 columns right-aligned after a zero column, the joining
    rows as they were, and room for more columns without a new buffer."""
    from grpolab.rollout.hf.kv_cache import ReservedLayer, join_rows, joins_rows, reserved_cache

    config = make_tiny_model("llama").config
    running, joining = reserved_cache(config, 5), reserved_cache(config, 4)
    assert joins_rows(running)
    heads, dim = config.num_key_value_heads, config.hidden_size // config.num_attention_heads
    for layer in range(config.num_hidden_layers):
        old = torch.arange(2 * heads * 5 * dim, dtype=torch.float32).reshape(2, heads, 5, dim)
        running.update(old, -old, layer)
        joining.update(torch.full((3, heads, 4, dim), 7.0), torch.full((3, heads, 4, dim), -7.0), layer)
    assert join_rows(running, joining, 3, trim=2, room=6) == 4
    for layer in running.layers:
        assert isinstance(layer, ReservedLayer) and layer.keys.shape == (5, heads, 4, dim)
        old = torch.arange(2 * heads * 5 * dim, dtype=torch.float32).reshape(2, heads, 5, dim)
        assert (layer.keys[:2, :, 0] == 0).all() and torch.equal(layer.keys[:2, :, 1:], old[:, :, 2:])
        assert torch.equal(layer.values[:2, :, 1:], -old[:, :, 2:])
        assert (layer.keys[2:] == 7).all() and (layer.values[2:] == -7).all()
        assert layer._keys.shape[2] == 4 + 6
    # rows with nothing cached (one-token prompts) join as zeros
    assert join_rows(running, None, 1, trim=0, room=2) == 4
    assert running.layers[0].keys.shape[0] == 6 and (running.layers[0].keys[5] == 0).all()
