"""The training forward is each family's own forward, or the family is refused / its prompts not shared.

Tiny random models (float32, sdpa as grpolab loads them) of the families below, with sliding windows of
WINDOW tokens, longrope and dynamic rope changing past ORIGINAL positions, and logit transforms far from
their identity so that a missed one is obvious. Sequences are longer than both, except where
``grpolab.models.fidelity`` refuses them (then the refusal is checked, and shorter ones are):

- ``forward_fidelity`` of each family is the one in STATUS (the table in docs/real-models.md);
- the training log-probs (``unit_logprobs`` on ``layout_units``, as ``grpolab.learning.learner.BatchForward`` lays
  them out: shared where the model allows it, and unshared) of two prompts x two right-padded
  completions equal ``log_softmax(model(row).logits / temperature)`` of each row alone, unpadded, within
  1e-5, and so do their gradients;
- the hf engine's sampled-token log-probs (shared prefill included) equal the same, within 1e-5 + 1e-5
  relative (its incremental decode sums in another order);
- each fault of the previous forward, on the families that showed it.
"""

from __future__ import annotations

import pytest
import torch
from tiny_configs import TINY_SIZES, tiny_fields
from transformers import (
    AutoModelForCausalLM,
    CohereConfig,
    Gemma2Config,
    Gemma3TextConfig,
    GPT2Config,
    GPTNeoXConfig,
    GraniteConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Olmo2Config,
    OlmoeConfig,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
    SmolLM3Config,
    Starcoder2Config,
)

from grpolab.learning.packing import MicroBatchPlanner, prompt_keys
from grpolab.learning.shared_prefix import layout_units, unit_logprobs
from grpolab.learning.update import Trainee, UpdateData, UpdateSchedule, run_update
from grpolab.models.fidelity import attention_implementation, check_trainable, forward_fidelity
from grpolab.models.loading import load_policy
from grpolab.objectives.presets import PRESETS
from grpolab.rollout import HFEngine, SamplingParams

VOCAB, WINDOW, ORIGINAL, TEMPERATURE = 128, 8, 16, 0.7
LONG = ((12, (20, 6)), (9, (15, 1)))  # (prompt length, completion lengths): up to 32 tokens
SHORT = ((6, (10, 3)), (4, (12, 1)))  # within ORIGINAL
COMMON = tiny_fields(VOCAB, 0, None, max_position_embeddings=64)
NEOX_SIZES = {k: v for k, v in TINY_SIZES.items() if k != "num_key_value_heads"}  # no grouped key/value heads
NO_LLAMA_FIELDS = dict(vocab_size=VOCAB, initializer_range=0.3, pad_token_id=0, bos_token_id=None, eos_token_id=None)
MOE = dict(num_experts=4, num_experts_per_tok=2)
LONGROPE = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    "short_factor": [1.0, 1.1, 1.2, 1.3],
    "long_factor": [2.0, 4.0, 8.0, 16.0],
    "factor": 4.0,
}  # head_dim 8: 4 factors each

CONFIGS = {
    "llama": lambda: LlamaConfig(**COMMON),
    "llama_dynamic_rope": lambda: LlamaConfig(
        **{**COMMON, "max_position_embeddings": ORIGINAL},
        rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0},
    ),
    "mistral": lambda: MistralConfig(**COMMON, sliding_window=WINDOW),
    "mixtral": lambda: MixtralConfig(**COMMON, sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2),
    "qwen2": lambda: Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
    "qwen3": lambda: Qwen3Config(**COMMON, head_dim=8),
    "qwen3_moe": lambda: Qwen3MoeConfig(**COMMON, head_dim=8, moe_intermediate_size=32, **MOE),
    "olmo2": lambda: Olmo2Config(**COMMON),
    "olmoe": lambda: OlmoeConfig(**COMMON, **MOE),
    "phi3": lambda: Phi3Config(**COMMON, sliding_window=WINDOW),
    "phi3_longrope": lambda: Phi3Config(
        **COMMON, original_max_position_embeddings=ORIGINAL, rope_parameters=dict(LONGROPE)
    ),
    "gemma2": lambda: Gemma2Config(
        **COMMON, head_dim=8, sliding_window=WINDOW, final_logit_softcapping=2.0, attn_logit_softcapping=1.0
    ),
    "gemma3_text": lambda: Gemma3TextConfig(
        **COMMON,
        head_dim=8,
        sliding_window=WINDOW,
        final_logit_softcapping=2.0,
        layer_types=["sliding_attention", "full_attention"],
    ),
    "granite": lambda: GraniteConfig(**COMMON, logits_scaling=4.0),
    "cohere": lambda: CohereConfig(**COMMON, logit_scale=4.0),
    "starcoder2": lambda: Starcoder2Config(**COMMON, sliding_window=WINDOW),
    "gpt_neox": lambda: GPTNeoXConfig(**NO_LLAMA_FIELDS, **NEOX_SIZES, max_position_embeddings=64, rotary_pct=0.5),
    "gpt2": lambda: GPT2Config(**NO_LLAMA_FIELDS, n_embd=32, n_layer=2, n_head=4, n_positions=64),
    "smollm3": lambda: SmolLM3Config(**COMMON, no_rope_layer_interval=2),  # layer 2 without rope
}
SLIDING = "sliding-window attention"
# family -> (why its prompts are not shared, what its refusal at 32 tokens says), None: exact
STATUS = {
    **dict.fromkeys(
        ("llama", "qwen3", "qwen3_moe", "olmo2", "olmoe", "granite", "cohere", "gpt_neox", "gpt2", "smollm3"),
        (None, None),
    ),
    **dict.fromkeys(("mistral", "mixtral", "qwen2", "phi3", "gemma2", "gemma3_text", "starcoder2"), (SLIDING, None)),
    "phi3_longrope": (None, "longrope rope, whose frequencies change past original_max_position_embeddings 16"),
    "llama_dynamic_rope": (None, "dynamic rope, whose frequencies change past max_position_embeddings 16"),
}


def build(family: str) -> torch.nn.Module:
    """The family's tiny model with the attention kernel grpolab loads it with (``load_policy``)."""
    torch.manual_seed(0)
    config = CONFIGS[family]()
    return AutoModelForCausalLM.from_config(
        config, dtype=torch.float32, attn_implementation=attention_implementation(config)
    ).eval()


def batch(groups, seed: int = 1):
    """Right-padded rows of ``groups`` -> (input_ids [N, T], prompt lengths, sequence lengths)."""
    gen = torch.Generator().manual_seed(seed)
    rows, plens = [], []
    for p, completions in groups:
        prompt = torch.randint(1, VOCAB, (p,), generator=gen)
        for c in completions:
            rows.append(torch.cat([prompt, torch.randint(1, VOCAB, (c,), generator=gen)]))
            plens.append(p)
    ids = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = row
    return ids, plens, [len(r) for r in rows]


def own_logprobs(model, ids: list[int] | torch.Tensor, temperature: float = TEMPERATURE) -> torch.Tensor:
    """[len - 1]: log p(ids[t] | ids[:t]) for t >= 1 by the model's own forward on the row alone, unpadded."""
    ids = torch.as_tensor(ids)
    logits = model(input_ids=ids[None]).logits[0].float() / temperature
    return torch.log_softmax(logits, -1)[:-1].gather(-1, ids[1:, None])[:, 0]


def training_logprobs(model, ids, plens, slens, shared: bool) -> torch.Tensor:
    """[N, T] log-probs by ``unit_logprobs``, micro-batch planned as ``BatchForward`` does; rows in batch order."""
    planner = MicroBatchPlanner(
        keys=prompt_keys(ids, torch.tensor(plens)) if shared else list(range(len(ids))),
        prompt_lens=plens,
        seq_lens=slens,
        share=shared,
        max_sequences=len(ids),
    )
    units = planner.runs(list(range(len(ids))))
    assert any(len(u) > 1 for u in units) == shared
    layout = layout_units(ids, plens, slens, units, shared=shared)
    stats = unit_logprobs(model, layout, len(ids), ids.shape[1], temperature=TEMPERATURE, chunk_tokens=5)
    order = torch.tensor([r for u in units for r in u])
    return stats.logprobs[torch.argsort(order)]


def weighted_sum(logprobs_by_row: list[torch.Tensor]) -> torch.Tensor:
    gen = torch.Generator().manual_seed(2)
    return sum((lp * torch.randn(lp.shape, generator=gen)).sum() for lp in logprobs_by_row)


def gradients(model, loss: torch.Tensor) -> list[torch.Tensor]:
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        torch.zeros_like(p) if g is None else g
        for p, g in zip(params, torch.autograd.grad(loss, params, allow_unused=True))
    ]


def groups_for(model, family: str):
    """LONG, or SHORT where the fidelity refuses LONG's 32 tokens (checking that refusal)."""
    fidelity = forward_fidelity(model)
    if fidelity.refusal(32) is None:
        return LONG
    assert STATUS[family][1] in fidelity.refusal(32) and fidelity.refusal(ORIGINAL) is None
    return SHORT


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_fidelity_status(family):
    fidelity = forward_fidelity(build(family))
    blocker, refusal = STATUS[family]
    assert fidelity.share_blocker is None if blocker is None else blocker in fidelity.share_blocker
    assert fidelity.unsupported is None and (fidelity.refusal(32) is None) == (refusal is None)
    if refusal is not None:
        with pytest.raises(ValueError, match="shorten the prompts or max_new_tokens") as error:
            check_trainable(build(family), 32)
        assert refusal in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_training_forward_is_the_models_own(family):
    model = build(family)
    ids, plens, slens = batch(groups_for(model, family))
    layouts = [False] + ([True] if forward_fidelity(model).share_blocker is None else [])
    own = [own_logprobs(model, ids[i, : slens[i]])[plens[i] - 1 :] for i in range(len(ids))]
    own_grads = gradients(model, weighted_sum(own))
    for shared in layouts:
        lp = training_logprobs(model, ids, plens, slens, shared)
        rows = [lp[i, plens[i] : slens[i]] for i in range(len(ids))]
        assert all(lp[i, : plens[i]].eq(0).all() and lp[i, slens[i] :].eq(0).all() for i in range(len(ids)))
        # float32 log-probs of a random model reach -16: a few ulps of that is ~1e-6 relative
        torch.testing.assert_close(torch.cat(rows), torch.cat(own).detach(), rtol=2e-6, atol=1e-5)
        grads = gradients(model, weighted_sum(rows))
        scale = max(g.abs().max() for g in own_grads)
        assert all(g.isfinite().all() for g in grads) and scale > 0
        assert max((g - h).abs().max() for g, h in zip(grads, own_grads)) <= 1e-5 * scale


@pytest.mark.parametrize("rows", [64, 3])
@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_engine_logprobs_are_the_models_own(family, tokenizer, rows):
    """rows 3: the fourth row joins the running batch as soon as one ends (refill, where the family's cache
    allows it; sliding windows: a second batch), left-padded to the others' width; a seventh of the vocabulary
    ends rows, so that they end at different steps."""
    model = build(family)
    (p1, (c1, _)), (p2, _) = groups_for(model, family)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, VOCAB, (p,), generator=gen).tolist() for p in (p1, p2)]
    # an EOS id outside the vocabulary: every completion runs to max_new_tokens; 2 samples a prompt: shared prefill
    eos = [VOCAB + 1] if rows == 64 else list(range(1, VOCAB, 7))
    engine = HFEngine(model, tokenizer, max_batch_size=rows, eos_token_ids=eos)
    groups = engine.generate(prompts, 2, SamplingParams(max_new_tokens=c1, temperature=TEMPERATURE, seed=4))
    with torch.no_grad():
        for prompt, group in zip(prompts, groups):
            for c in group:
                assert len(c.completion_ids) == c1 if rows == 64 else len(c.completion_ids) <= c1
                own = own_logprobs(model, prompt + c.completion_ids)[len(prompt) - 1 :]
                # generate computes each token in an incremental decode step, the reference in one pass
                # over the sequence: float32 sums in another order, ~1e-6 relative through the layers
                torch.testing.assert_close(torch.tensor(c.logprobs), own, rtol=1e-5, atol=1e-5)


# ---- each fault of the previous training forward ----------------------------------------------------------


@pytest.mark.parametrize("family", ["mistral", "phi3", "starcoder2", "mixtral"])
def test_sliding_window_without_layer_types_turns_sharing_off(family):
    """Their config sets only ``sliding_window``: the prompts' cache would keep its last WINDOW columns."""
    model = build(family)
    assert SLIDING in forward_fidelity(model).share_blocker
    ids, plens, slens = batch(LONG)
    with torch.no_grad():
        shared = training_logprobs(model, ids, plens, slens, shared=True)
        errors = [
            (shared[i, plens[i] : slens[i]] - own_logprobs(model, ids[i, : slens[i]])[plens[i] - 1 :]).abs().max()
            for i in range(len(ids))
        ]
    assert max(errors) > 0.1  # what sharing would have given


@pytest.mark.parametrize("family", ["granite", "cohere", "gemma2", "gemma3_text"])
def test_output_layer_applies_the_models_logit_transform(family):
    model = build(family)
    ids, plens, slens = batch(LONG)
    with torch.no_grad():
        lp = training_logprobs(model, ids, plens, slens, shared=False)
        own = own_logprobs(model, ids[0, : slens[0]])[plens[0] - 1 :]
    torch.testing.assert_close(lp[0, plens[0] : slens[0]], own, rtol=0, atol=1e-5)


def test_longrope_past_its_original_context_is_refused():
    model = build("phi3_longrope")
    check_trainable(model, ORIGINAL)
    with pytest.raises(ValueError, match="longrope"):
        check_trainable(model, ORIGINAL + 1)


def test_an_empty_completion_alone_in_a_micro_batch_updates():
    """A micro-batch holding only an empty completion: its gradient is zero, so the update is the same as
    with that row in one micro-batch with the other (and alone, no update at all)."""
    ids, plens, slens = batch(((5, (0, 4)),))
    response = torch.zeros(ids.shape)
    response[1, plens[1] : slens[1]] = 1

    def updated(rows: list[int], micro_batch_size: int) -> list[torch.Tensor]:
        model = build("llama").train()
        rows_t = torch.tensor(rows)

        def policy(indices):
            layout = layout_units(ids, plens, slens, [[r] for r in rows_t[indices].tolist()], shared=False)
            return unit_logprobs(model, layout, len(indices), ids.shape[1]).logprobs, None

        data = UpdateData(advantages=torch.ones(len(rows)), response_mask=response[rows_t], old_logprobs=None)
        result = run_update(
            PRESETS["grpo"],
            data,
            Trainee(policy, torch.optim.SGD(model.parameters(), lr=0.1), list(model.parameters())),
            UpdateSchedule(micro_batch_size=micro_batch_size, max_new_tokens=4),
        )
        assert result.actual == 1
        return [p.detach() for p in model.parameters()]

    start = [p.detach() for p in build("llama").parameters()]
    for a, b, c in zip(updated([0, 1], 2), updated([0, 1], 1), start):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
        assert not torch.equal(a, c) or a.shape[0] == VOCAB  # the unused embeddings rows aside
    for a, c in zip(updated([0], 1), start):
        assert torch.equal(a, c)


def test_a_logit_attribute_of_a_family_not_known_to_use_it_is_refused():
    """MiniCPM3 divides by ``logits_scaling`` before the output layer, Granite after it, HyperCLOVA X
    multiplies: a family not in the table could do either, so it is refused rather than trained off."""
    model = build("llama")
    model.config.logits_scaling = 2.0
    with pytest.raises(ValueError, match="llama: config.logits_scaling changes the logits"):
        check_trainable(model, 8)


def test_soft_capped_attention_loads_with_the_kernel_that_computes_it(tmp_path, tokenizer):
    """transformers' sdpa kernel skips Gemma-2's ``attn_logit_softcapping``: grpolab loads such a model eager."""
    torch.manual_seed(0)
    path = tmp_path / "gemma2"
    AutoModelForCausalLM.from_config(CONFIGS["gemma2"]()).save_pretrained(path)
    tokenizer.save_pretrained(path)
    model, _ = load_policy(path)
    assert model.config._attn_implementation == "eager"
    ids = torch.randint(1, VOCAB, (1, 12), generator=torch.Generator().manual_seed(5))
    sdpa = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").eval()
    with torch.no_grad():
        assert (model(ids).logits - sdpa(ids).logits).abs().max() > 1e-2  # what sdpa would have computed
    assert attention_implementation(CONFIGS["llama"]()) == "sdpa"
