"""Shared prompts and token-budget micro-batches change the speed of the training forward, not its numbers.

- The shared-prompt forward (and the one-row-per-sequence forward both share with it) against the
  previous path, ``token_logprobs`` on right-padded rows: log-probs, entropies and parameter gradients
  on Llama, Qwen3 and OLMo-2 shaped models, with uneven groups, an empty completion and a prompt
  shared by two groups.
- The planner: every row exactly once, units share a prompt, budgets and counts hold (hypothesis).
- Whole RL steps with shared prompts / token budgets on and off end in the same parameters.
"""

from __future__ import annotations

import pytest
import torch
from conftest import quick_config
from hypothesis import given, settings
from hypothesis import strategies as st

from grpolab.learning.packing import MicroBatchPlanner, prompt_keys
from grpolab.learning.shared_prefix import layout_units, unit_logprobs
from grpolab.models.fidelity import forward_fidelity
from grpolab.models.logprobs import token_logprobs
from grpolab.run.trainer import Trainer

GROUPS = ((5, [3, 7, 1, 4]), (9, [2, 6, 0]), (4, [5]), (5, [6, 2]))  # (prompt length, completion lengths)


def _batch(vocab: int, seed: int = 0):
    """Right-padded rows of GROUPS; the first and last groups share their prompt tokens."""
    gen = torch.Generator().manual_seed(seed)
    rows, plens = [], []
    prompts = [torch.randint(3, vocab, (p,), generator=gen) for p, _ in GROUPS]
    prompts[3] = prompts[0]
    for prompt, (p, comps) in zip(prompts, GROUPS):
        for c in comps:
            rows.append(torch.cat([prompt, torch.randint(3, vocab, (c,), generator=gen)]))
            plens.append(p)
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, : len(r)], mask[i, : len(r)] = r, 1
    response = torch.zeros(ids.shape)
    for i, r in enumerate(rows):
        response[i, plens[i] : len(r)] = 1
    return ids, mask, response, plens, [len(r) for r in rows]


def _grads(model, logprobs, weights):
    model.zero_grad(set_to_none=True)
    (logprobs * weights).sum().backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("arch", ["llama", "qwen3", "olmo2"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_shared_prompts_give_the_previous_paths_logprobs_and_gradients(make_tiny_model, arch, attn):
    model = make_tiny_model(arch)
    model.set_attn_implementation(attn)
    ids, mask, response, plens, slens = _batch(model.config.vocab_size)
    weights = torch.randn(ids.shape, generator=torch.Generator().manual_seed(1)) * response
    before = token_logprobs(model, ids, mask, temperature=0.7, with_entropy=True)  # the previous path
    grads_before = _grads(model, before.logprobs, weights)
    keys = prompt_keys(ids, torch.tensor(plens))
    assert keys[-2:] == [0, 0] and len(set(keys)) == 3  # the shared prompt is recognised
    planner = MicroBatchPlanner(keys, plens, slens, share=True, max_sequences=64)
    units = planner.units(list(range(len(ids))))
    assert sorted(map(len, units)) == [1, 3, 6]
    for shared in (True, False):
        layout = layout_units(ids, plens, slens, units, shared)
        stats = unit_logprobs(model, layout, len(ids), ids.shape[1], temperature=0.7, chunk_tokens=5, with_entropy=True)
        order = torch.tensor([r for u in units for r in u])  # output rows are in unit order
        assert torch.equal(stats.logprobs != 0, response[order] != 0)  # completion tokens only
        torch.testing.assert_close(stats.logprobs, before.logprobs[order] * response[order], rtol=0, atol=1e-5)
        torch.testing.assert_close(stats.entropy, before.entropy[order] * response[order], rtol=0, atol=1e-5)
        grads = _grads(model, stats.logprobs, weights[order])
        scale = max(g.abs().max() for g in grads_before)
        assert max((g - h).abs().max() for g, h in zip(grads, grads_before)) <= 1e-5 * scale


def test_sharing_blocker_names_what_prevents_it(make_tiny_model):
    model = make_tiny_model("qwen3")
    assert forward_fidelity(model).share_blocker is None
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert "gradient checkpointing" in forward_fidelity(model).share_blocker
    sliding = make_tiny_model("qwen2")
    sliding.config.layer_types = ["sliding_attention"] * len(sliding.config.layer_types)
    assert "sliding-window" in forward_fidelity(sliding).share_blocker
    sliding.config.layer_types = ["full_attention", "linear_attention"]
    assert "other than full attention (linear_attention)" in forward_fidelity(sliding).share_blocker


@st.composite
def _rows(draw):
    groups = draw(
        st.lists(
            st.tuples(st.integers(1, 30), st.lists(st.integers(0, 40), min_size=1, max_size=9)), min_size=1, max_size=8
        )
    )
    keys, plens, slens = [], [], []
    for g, (p, comps) in enumerate(groups):
        for c in comps:
            keys.append(g), plens.append(p), slens.append(p + c)
    return keys, plens, slens


@settings(max_examples=200, deadline=None)
@given(_rows(), st.booleans(), st.integers(1, 12), st.one_of(st.none(), st.integers(1, 200)), st.randoms())
def test_planner_partitions_rows_within_the_limits(rows, share, max_sequences, max_tokens, rng):
    keys, plens, slens = rows
    planner = MicroBatchPlanner(keys, plens, slens, share=share, max_sequences=max_sequences, max_tokens=max_tokens)
    step = list(range(len(keys)))
    rng.shuffle(step)  # an optimizer step's rows in any order (shuffled minibatches)
    micro_batches = [m.tolist() for m in planner.plan(torch.tensor(step))]
    assert sorted(r for m in micro_batches for r in m) == sorted(step)
    if not share and max_tokens is None:  # the previous split, in order
        assert micro_batches == [step[i : i + max_sequences] for i in range(0, len(step), max_sequences)]
    for micro in micro_batches:
        units = planner.runs(micro)
        assert all(len({keys[r] for r in u}) == 1 for u in units)
        assert share or all(len(u) == 1 for u in units)
        if max_tokens is None:
            assert len(micro) <= max_sequences
        elif len(units) > 1:  # a unit longer than the budget goes alone
            assert len(units) * max(map(planner.cost, units)) <= max_tokens
    if share:  # a prompt's rows are cut into several units only when the limits force it
        for micro in micro_batches:
            for unit in planner.runs(micro):
                assert planner.cost(unit) <= (max_tokens or float("inf")) or len(unit) == 1
                assert max_tokens is not None or len(unit) <= max_sequences


@pytest.mark.parametrize(
    "overrides",
    [
        {"optim.shared_prompts": True},
        {"optim.shared_prompts": True, "optim.micro_batch_tokens": 300},
        {"optim.shared_prompts": False, "optim.micro_batch_tokens": 300},
    ],
)
def test_rl_steps_end_in_the_same_parameters(warm_model_dir, tmp_path, overrides):
    """GSPO (4 minibatches: frozen old log-probs, shuffled) with a KL reference, 2 steps: the
    parameters and metrics agree with shared prompts and token budgets off."""
    common = {
        "algorithm.name": "gspo",
        "algorithm.beta": 0.04,
        "reference": "frozen",
        "steps": 2,
        "eval.every": 100,
        "checkpoint.every": 100,
    }
    results = []
    for i, extra in enumerate(({"optim.shared_prompts": False}, overrides)):
        trainer = Trainer(quick_config(warm_model_dir, tmp_path / str(i), **common, **extra))
        try:
            records = [trainer.train_step(step) for step in range(2)]
            results.append((records, [p.detach().clone() for p in trainer.parts.model.parameters()]))
        finally:
            trainer.close()
    (records_a, params_a), (records_b, params_b) = results
    # AdamW divides each gradient element by its own RMS: on an element whose gradient is float32 summation
    # noise, another summation order moves the weight by a fraction of lr (1e-3) per update (8 updates here;
    # seen: 1.3e-5). A wrong shared-prefix gradient moves many weights by ~lr.
    for a, b in zip(params_a, params_b):
        torch.testing.assert_close(a, b, rtol=0, atol=5e-5)
    for ra, rb in zip(records_a, records_b):
        assert ra["actual_updates"] == rb["actual_updates"] > 0
        for key in ("reward_mean", "kl_ref", "entropy", "ratio_mean", "approx_kl_old_new", "grad_norm"):
            assert ra[key] == pytest.approx(rb[key], rel=1e-3, abs=1e-6), key


def test_a_model_that_cannot_share_says_so_once_and_trains_row_by_row(warm_model_dir, tmp_path):
    from rich.console import Console

    console = Console(record=True, width=200)
    cfg = quick_config(warm_model_dir, tmp_path / "run", **{"model.gradient_checkpointing": True, "steps": 1})
    trainer = Trainer(cfg, console)
    try:
        assert not trainer.parts.learner.share_prompts
        record = trainer.train_step(0)
    finally:
        trainer.close()
    assert console.export_text().count("shared prompts off: gradient checkpointing") == 1
    assert record["actual_updates"] == 1
