"""Mixture-of-Experts policies (tiny random Qwen3-MoE, OLMoE and Mixtral, 8 experts, top 2): grpolab's
training forward is the model's own, and the router metrics are a hand computation from the logits."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import cli_pairs, float64_norms, quick_config
from tiny_configs import tiny_fields
from transformers import AutoModelForCausalLM, MixtralConfig, OlmoeConfig, Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from grpolab.learning.batching import collate
from grpolab.learning.shared_prefix import layout_units, unit_logprobs
from grpolab.models.routing import (
    RouterRecorder,
    RouterTally,
    RoutingTable,
    load_balancing_loss,
    router_metrics,
    router_sums,
    routers,
)
from grpolab.run.trainer import Trainer

VOCAB = 64
COMMON = tiny_fields(VOCAB, 0, 1, max_position_embeddings=128, num_experts_per_tok=2)
FAMILIES = {
    "qwen3_moe": lambda: Qwen3MoeConfig(**COMMON, head_dim=8, num_experts=8, moe_intermediate_size=16),
    "olmoe": lambda: OlmoeConfig(**COMMON, num_experts=8),
    "mixtral": lambda: MixtralConfig(**COMMON, num_local_experts=8),
}


def tiny_moe(family: str, dtype=torch.float64) -> torch.nn.Module:
    torch.manual_seed(0)
    config = FAMILIES[family]()
    config._experts_implementation = "eager"  # torch._grouped_mm (the default) has no float64
    return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


def _ids(rows: int = 3, length: int = 10) -> torch.Tensor:
    return torch.randint(2, VOCAB, (rows, length), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_training_forward_of_an_moe_model_is_its_own_forward_in_float64(family):
    model = tiny_moe(family)
    ids, prompt = _ids(), 4
    n, length = ids.shape
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, :-1]
        own = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)[:, prompt - 1 :]
        for shared in (False, True):
            units = [[0, 1, 2]] if shared else [[r] for r in range(n)]
            same = ids.clone()
            same[:, :prompt] = ids[0, :prompt]  # shared prompts need one prompt
            want = (
                own
                if not shared
                else torch.log_softmax(model(input_ids=same).logits[:, :-1], -1)
                .gather(-1, same[:, 1:, None])
                .squeeze(-1)[:, prompt - 1 :]
            )
            layout = layout_units(same if shared else ids, [prompt] * n, [length] * n, units, shared=shared)
            got = unit_logprobs(model, layout, n, length).logprobs[:, prompt:]
            torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-6)  # returned in float32


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_recorded_router_outputs_are_the_models_own(family):
    model = tiny_moe(family)
    assert len(routers(model)) == 2
    ids = _ids()
    recorder = RouterRecorder()
    with torch.no_grad(), recorder.record(model):
        out = model(input_ids=ids, output_router_logits=True)
    for layer, own in enumerate(out.router_logits):
        (logits,), (selected,) = recorder.logits[layer], recorder.selected[layer]
        torch.testing.assert_close(logits, own, rtol=0, atol=0)
        assert torch.equal(selected.sort(-1).values, torch.topk(own, 2, dim=-1).indices.sort(-1).values)


def test_router_metrics_are_a_hand_computation():
    logits = torch.tensor([[2.0, 0.0, 0.0, -1.0], [0.0, 1.0, 0.0, 0.0], [0.5, 0.5, 3.0, 0.0], [9.0, 9.0, 9.0, 9.0]])
    selected = torch.tensor([[0, 1], [1, 0], [2, 0], [3, 2]])
    mask = torch.tensor([True, True, True, False])  # the last row is padding
    got = router_metrics(router_sums(logits, selected, mask, num_experts=4))
    rows = [[math.exp(v) for v in row] for row in logits[:3].tolist()]
    probs = [[v / sum(row) for v in row] for row in rows]
    load = [3 / 6, 2 / 6, 1 / 6, 0.0]  # expert 0 chosen 3 times, 1 twice, 2 once, 3 never (padding row dropped)
    confidence = sum(p[a] + p[b] for p, (a, b) in zip(probs, [(0, 1), (1, 0), (2, 0)])) / 3
    entropy = sum(-sum(v * math.log(v) for v in p) for p in probs) / 3
    mean_prob = [sum(p[e] for p in probs) / 3 for e in range(4)]
    assert got["load"] == pytest.approx(load, abs=1e-15)
    assert got["load_max_violation"] == pytest.approx(0.5 * 4 - 1, abs=1e-15)
    assert got["confidence"] == pytest.approx(confidence, abs=1e-15)
    assert got["entropy"] == pytest.approx(entropy, abs=1e-15)
    counts = [3, 2, 1, 0]  # transformers' loss: selections per token (k at balance), not the load shares
    assert got["aux_loss"] == pytest.approx(4 * sum(c / 3 * p for c, p in zip(counts, mean_prob)), abs=1e-15)
    assert router_metrics(router_sums(logits, selected, torch.zeros(4, dtype=torch.bool), 4)) == {}
    halves = [router_sums(logits[i : i + 2], selected[i : i + 2], mask[i : i + 2], 4) for i in (0, 2)]
    assert router_metrics(halves[0] + halves[1]) == got, "the sums of two forwards give the metrics of both"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_load_balancing_loss_is_the_models_own_over_the_counted_tokens(family):
    """``load_balancing_loss`` (the objective's term) and the tally's ``router/aux_loss`` (the metric) equal
    transformers' ``load_balancing_loss_func`` of the model's own router logits, padding and prompts masked."""
    model = tiny_moe(family, torch.float32)
    ids = _ids(3, 10)
    counted = torch.zeros(3, 10, dtype=torch.bool)
    counted[:, 4:] = True
    counted[2, 8:] = False  # a shorter completion
    recorder, tally = RouterRecorder(with_grad=True), RouterTally(model)
    with recorder.record(model), tally.forward([counted.flatten()]):
        out = model(input_ids=ids, output_router_logits=True)
    want = load_balancing_loss_func(out.router_logits, 8, 2, attention_mask=counted)
    flat = lambda per_layer: [t for calls in per_layer for t in calls]  # noqa: E731
    got = load_balancing_loss(flat(recorder.logits), flat(recorder.selected), [counted.flatten()] * 2, 8)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert tally.metrics()["router/aux_loss"] == pytest.approx(float(want.detach()), rel=1e-6)
    weight = routers(model)[1].weight
    (mine,), (own,) = (torch.autograd.grad(loss, weight, retain_graph=True) for loss in (got, want))
    assert own.abs().max() > 0
    torch.testing.assert_close(mine, own)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory, tokenizer):
    """A tiny random Qwen3-MoE with the tests' character tokenizer."""
    config = FAMILIES["qwen3_moe"]()
    config.vocab_size, config.pad_token_id = len(tokenizer), tokenizer.pad_token_id
    config.eos_token_id = tokenizer.eos_token_id
    config.max_position_embeddings = 1024  # a character-level r1_zero prompt
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny_qwen3_moe")
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_an_moe_run_logs_its_router_metrics_every_step(moe_dir, tmp_path):
    """Over the step's training forwards (micro-batches, shared prompts, two epochs), from the routers' sums."""
    cfg = quick_config(moe_dir, tmp_path / "run", **{"algorithm.epochs": 2, "optim.micro_batch_size": 8})
    trainer = Trainer(cfg)
    try:
        assert trainer.parts.learner.share_prompts
        record = trainer.train_step(1)
    finally:
        trainer.close()
    assert record["sync/logprob_diff_max"] < 1e-3, "the hf engine samples the MoE policy"
    layers = [record[f"router/layer{i}/load_max_violation"] for i in range(2)]
    assert record["router/load_max_violation"] == max(layers) and min(layers) >= 0
    assert 2 / 8 < record["router/confidence"] <= 1, "the top 2 of 8 hold more than 2/8 of the mass"
    assert 0 < record["router/entropy"] < math.log(8)
    assert record["router/aux_loss"] > 0


def test_router_sums_count_the_completion_tokens_alike_shared_or_not():
    """Shared, the prompt is routed once per unit; the counted tokens (completions) and their routing are the
    same either way, so are the metrics."""
    model = tiny_moe("olmoe")
    ids, prompt_lens, seq_lens = _ids(4, 12), [5, 5, 5, 5], [12, 10, 12, 9]
    ids[:, :5] = ids[0, :5]
    tallies = []
    for shared in (False, True):
        tally = RouterTally(model)
        layout = layout_units(
            ids, prompt_lens, seq_lens, [[0, 1, 2, 3]] if shared else [[r] for r in range(4)], shared=shared
        )
        with torch.no_grad(), tally.forward(layout.completion_masks()):
            unit_logprobs(model, layout, 4, 12)
        tallies.append(tally.sums)
    assert tallies[0][:, -1].tolist() == [sum(seq_lens) - sum(prompt_lens)] * 2, "completion tokens, per layer"
    torch.testing.assert_close(tallies[1], tallies[0], rtol=0, atol=1e-9)


def _flip_second_choice(layer_calls: list[int]):
    """A router hook that, as differing numerics might, swaps each token's second expert for its third (the
    logits untouched): live routing that disagrees with the recorded one."""

    def hook(module, args, output):
        logits, scores, selected = output
        layer_calls.append(1)
        third = torch.topk(logits, 3, dim=-1).indices[:, 2:]
        flipped = torch.cat([selected[:, :1], third], dim=1)
        weights = torch.softmax(logits.float(), -1).gather(1, flipped)
        return logits, (weights / weights.sum(-1, keepdim=True)).to(scores.dtype), flipped

    return hook


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_replay_forces_the_recorded_choice_and_keeps_the_routers_gradient(family):
    """In float32 (the routers' own softmax dtype) the replayed forward is the recorded one bit for bit, where
    live routing flipped; in float64 the router's gradient through the replayed choice is the finite
    difference of the loss."""
    for dtype in (torch.float32, torch.float64):
        check_replay(tiny_moe(family, dtype))


def check_replay(model):
    float64 = next(model.parameters()).dtype == torch.float64
    # no padding: a padding token has no recorded choice, routes live, and can change how an expert batches
    ids, prompt_lens, seq_lens = _ids(3, 10), [4, 4, 4], [10, 10, 10]
    layout = layout_units(ids, prompt_lens, seq_lens, [[0], [1], [2]], shared=False)
    table = RoutingTable(model, tuple(ids.shape))
    with torch.no_grad(), table.record(layout.token_places()):
        old = unit_logprobs(model, layout, 3, 10).logprobs
    calls: list[int] = []
    handles = [r.register_forward_hook(_flip_second_choice(calls)) for r in routers(model)]  # before replay's
    try:

        def replayed_forward(replay: bool):
            used = RouterRecorder()
            with table.attach(replay), used.record(model):
                table.at(layout.token_places(), layout.completion_masks())
                out = unit_logprobs(model, layout, 3, 10).logprobs
            return out, used

        with torch.no_grad():
            live, _ = replayed_forward(replay=False)
        assert (live - old).abs().max() > 1e-3, "live routing flipped: the log-probs moved"
        assert 0 < table.differing <= table.compared, "live choices differed from the record"
        new, used = replayed_forward(replay=True)
        if not float64:
            assert torch.equal(new.detach(), old), "the ratio is exactly 1"
        for layer, (selected,) in enumerate(used.selected):
            rows, cols, real = layout.token_places()[0]
            assert torch.equal(selected[real], table.choices[rows[real], cols[real], layer])

        if not float64:
            return
        float64_norms(model)  # transformers' RMSNorm rounds through float32
        # the gradient of a float64 loss through the replayed forward: its finite difference
        weight = routers(model)[0].weight
        attention = (torch.arange(10) < torch.tensor(seq_lens)[:, None]).long()

        def loss() -> torch.Tensor:
            with table.attach(replay=True):
                table.at(layout.token_places(), layout.completion_masks())
                logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1]
            lp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
            return (lp * (attention[:, 1:] * (torch.arange(1, 10) >= 4))).sum()

        (grad,) = torch.autograd.grad(loss(), weight)
        assert grad.abs().max() > 0, "the router learns through the replayed choice's weights"
        direction = torch.randn(weight.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
        eps, losses = 1e-6, []
        with torch.no_grad():
            for sign in (1, -1):
                weight.add_(sign * eps * direction)
                losses.append(float(loss()))
                weight.sub_(sign * eps * direction)
        assert float((grad * direction).sum()) == pytest.approx((losses[0] - losses[1]) / (2 * eps), rel=1e-6)
    finally:
        for h in handles:
            h.remove()


@pytest.mark.parametrize("replay", [False, True])
@pytest.mark.parametrize("recorded_by", ["engine", "old forward"])
def test_an_moe_run_with_two_epochs_measures_the_routing_mismatch(moe_dir, tmp_path, replay, recorded_by):
    """With more than one optimizer step per batch the record is the hf engine's (the old-log-prob forward then
    follows it too), or, from an engine that records nothing (vLLM, a multi-turn rollout), the old-log-prob
    forward's; the training forwards (the second after an update) are compared with it, and with replay routed
    by it, under gradient checkpointing too (its recomputed layers replay the same choice), with the
    load-balancing loss's graph."""
    overrides = {
        "algorithm.epochs": 2,
        "algorithm.routing_replay": replay,
        "optim.micro_batch_size": 8,
        "model.gradient_checkpointing": replay,
        "task.name": "custom_task:DigitShare",
        "model.router_aux_loss_coef": 0.01 if replay else 0.0,
    }
    trainer = Trainer(quick_config(moe_dir, tmp_path / "run", **overrides))
    learner, learn = trainer.parts.learner, trainer.parts.learner.learn

    def learn_unrecorded(rollout):
        for group in rollout.completions:
            for completion in group:
                completion.routed_experts = None
        return learn(rollout)

    if recorded_by == "old forward":
        learner.learn = learn_unrecorded
    try:
        record = trainer.train_step(1)
    finally:
        trainer.close()
    assert record["actual_updates"] == 2 and 0 <= record["router/mismatch"] < 1
    assert record["ratio_max"] > 1 or record["ratio_min"] < 1, "the second epoch's ratio moved"


def test_replay_with_one_step_needs_the_hf_engines_record():
    from grpolab.config import load_config
    from grpolab.rollout.engines import check_settings

    with pytest.raises(ValueError, match="replays the engine's record, which only the hf engine makes"):
        check_settings(load_config(None, {"algorithm.routing_replay": True, "rollout.engine": "vllm"}))
    check_settings(cfg := load_config(None, {"algorithm.routing_replay": True}))
    assert cfg.algorithm.routing_replay
    check_settings(load_config(None, {"algo": "gspo", "algorithm.routing_replay": True, "rollout.engine": "vllm"}))


@pytest.mark.parametrize("shared_prefill,rows", [(True, 6), (False, 6), (True, 2), (False, 2)])
def test_the_hf_engine_records_the_routing_of_every_token_it_computes(moe_dir, tokenizer, shared_prefill, rows):
    """The shared prefix, each distinct prompt, the prompts' last tokens and every fed-back sampled token: in
    float64 each recorded choice is the one the model's own forward over prompt + completion makes; a row's
    last token (never fed back) has no record. ``rows`` 2: rows join the running batch as others end (refill),
    their prompts prefilled then and their cache left-padded to the batch's."""
    from grpolab.rollout.base import SamplingParams
    from grpolab.rollout.hf.engine import HFEngine
    from grpolab.rollout.hf.prefill import MIN_SAVED_TOKENS

    model = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float64)
    model.config._experts_implementation = "eager"
    float64_norms(model)
    head = tokenizer("What is 1 + 2? Think, then answer: ", add_special_tokens=False)["input_ids"]
    assert len(head) * 2 >= MIN_SAVED_TOKENS, "three distinct prompts share a prefix worth computing once"
    prompts = [head + tokenizer(tail, add_special_tokens=False)["input_ids"] for tail in ("a", "bc", "def")]
    engine = HFEngine(
        model, tokenizer, max_batch_size=rows, shared_prefill=shared_prefill, pack_weights=False, refill_fraction=0
    )
    # "f" ends rows at different steps: rows join a batch whose other rows are mid-completion
    params = SamplingParams(max_new_tokens=12, temperature=1.0, seed=3, stop_strings=("f",))
    groups = engine.generate(prompts, 2, params)
    assert max(engine.step_rows) == rows and len({len(c.completion_ids) for group in groups for c in group}) > 2
    for completion in [c for group in groups for c in group]:
        ids = completion.prompt_ids + completion.completion_ids
        recorder = RouterRecorder()
        with torch.no_grad(), recorder.record(model):
            model(input_ids=torch.tensor([ids]))
        routed = completion.routed_experts
        assert routed.shape == (len(ids), 2, 2) and routed.dtype == torch.int16
        assert (routed[-1] == -1).all() and (routed[:-1] >= 0).all()
        for layer, (own,) in enumerate(recorder.selected):
            assert torch.equal(routed[:-1, layer].long().sort(-1).values, own[:-1].sort(-1).values)


def test_one_step_grpo_replays_the_hf_engines_routing(moe_dir, tmp_path):
    """With one optimizer step per batch the training forward is compared with the engine's record (the
    mismatch, every step) and, with replay, routed by it: where the trainer's live routing is made to differ
    from the engine's, the replayed forward still scores the engine's log-probs (the sync check's difference)."""
    records = {}
    for replay in (False, True):
        overrides = {
            "algorithm.routing_replay": replay,
            "task.name": "custom_task:DigitShare",
            "rollout.sync_max_diff": 100.0,
            "rollout.sync_mean_diff": 100.0,
            "rollout.sync_noise_multiple": None,
        }
        trainer = Trainer(quick_config(moe_dir, tmp_path / f"run{replay}", **overrides))
        learner, learn = trainer.parts.learner, trainer.parts.learner.learn

        def learn_flipped(rollout, learn=learn, learner=learner):  # the engine generated unflipped
            handles = [r.register_forward_hook(_flip_second_choice([])) for r in routers(learner.model)]
            try:
                return learn(rollout)
            finally:
                for h in handles:
                    h.remove()

        learner.learn = learn_flipped
        try:
            records[replay] = trainer.train_step(1)
        finally:
            trainer.close()
    for record in records.values():
        assert record["actual_updates"] == 1 and record["router/mismatch"] > 0.5, "second choices flipped"
    assert records[True]["sync/logprob_diff_max"] < 1e-4 < records[False]["sync/logprob_diff_max"]


def test_router_aux_loss_coef_adds_the_models_own_load_balancing_loss_to_the_gradient(moe_dir, tmp_path):
    """One step, one micro-batch, no clipping: the routers' gradient with the coefficient minus without it is
    the coefficient times the gradient of transformers' loss over the step's completion tokens (the model's
    own forward with ``output_router_logits``), and rows with a zero advantage are backpropagated too."""
    coef, grads, reference = 0.5, {}, {}
    for c in (0.0, coef):
        overrides = {
            "model.router_aux_loss_coef": c,
            "optim.micro_batch_size": 32,
            "optim.max_grad_norm": 1e9,
            "task.name": "custom_task:DigitShare",
        }
        trainer = Trainer(quick_config(moe_dir, tmp_path / f"run{c}", **overrides))
        learner, weights = trainer.parts.learner, [r.weight for r in routers(trainer.parts.learner.model)]
        learn = learner.learn

        def learn_and_reference(rollout, learn=learn, learner=learner, weights=weights):
            batch = collate([x for group in rollout.completions for x in group], learner.pad_token_id)
            out = learner.model(
                input_ids=batch.input_ids, attention_mask=batch.attention_mask, output_router_logits=True
            )
            aux = load_balancing_loss_func(out.router_logits, 8, 2, attention_mask=batch.response_mask.bool())
            reference["grad"] = torch.autograd.grad(aux, weights)
            return learn(rollout)

        learner.learn = learn_and_reference
        learner.optimizer.register_step_pre_hook(
            lambda *_, c=c, weights=weights: grads.setdefault(c, [w.grad.clone() for w in weights]) and None
        )
        try:
            record = trainer.train_step(1)
        finally:
            trainer.close()
        assert record["actual_updates"] == 1
    for without, with_aux, ref in zip(grads[0.0], grads[coef], reference["grad"]):
        assert ref.abs().max() > 0
        torch.testing.assert_close(with_aux - without, coef * ref, rtol=1e-3, atol=1e-6)


def test_the_probe_update_is_the_learners_own_with_the_load_balancing_loss(moe_dir, tmp_path):
    """``grpolab probe`` steps through ``PolicyLearner.update``: an MoE policy's training forwards are watched as in
    a run, so the load-balancing loss is in the probe's gradient (its own copy of the step left it out)."""
    from grpolab.commands.probe import run_probe

    norms = {}
    for coef in (0.0, 0.5):
        cfg = quick_config(
            moe_dir, tmp_path / "unused", **{"model.router_aux_loss_coef": coef, "rollout.max_new_tokens": 8}
        )
        report = run_probe(cfg, tmp_path / f"probe{coef}.json")
        norms[coef] = [update["grad_norm"] for update in report["updates"]]
        assert all(u["parameter_tensors_with_nonzero_grad"] == u["parameter_tensors"] for u in report["updates"])
    assert norms[0.0][0] != norms[0.5][0]


def test_a_batchs_routing_part_follows_the_policy_and_the_schedule(make_tiny_model):
    """A dense policy's part watches nothing; an MoE policy's keeps a record when the engine made one or the
    schedule has an old-log-prob forward to make it, and adds the load-balancing loss only with a coefficient."""
    from grpolab.learning.moe_routing import DenseRouting, MoeRouting, batch_routing
    from grpolab.objectives.presets import PRESETS

    grpo, two_epochs = PRESETS["grpo"], PRESETS["grpo"].override(epochs=2)
    dense = batch_routing(make_tiny_model("llama"), grpo, 0.0, (2, 10), [None, None])
    assert type(dense) is DenseRouting and dense.metrics(lambda t: t) == {} and not dense.extra_loss

    def policy(indices):
        return indices, None

    assert dense.with_aux_loss(policy) is policy and dense.old_watch is dense.counted is None
    model = tiny_moe("qwen3_moe")
    engine = [torch.zeros(10, 2, 2, dtype=torch.int16)] * 2  # each row's tokens took experts 0, 0 in both layers
    unrecorded = batch_routing(model, grpo, 0.0, (2, 10), [None, None])
    assert isinstance(unrecorded, MoeRouting) and unrecorded.table is None and unrecorded.old_watch is None
    assert unrecorded.with_aux_loss(policy) is policy
    recorded = batch_routing(model, grpo, 0.01, (2, 10), engine)
    assert recorded.engine_routed and (recorded.table.choices == 0).all() and recorded.extra_loss
    assert recorded.old_watch is recorded.uncounted
    by_old_forward = batch_routing(model, two_epochs, 0.0, (2, 10), [engine[0], None])
    assert not by_old_forward.engine_routed and (by_old_forward.table.choices == -1).all()
    assert by_old_forward.old_watch is not None


def test_router_aux_loss_coef_on_a_dense_model_is_refused(tiny_model_dirs, tmp_path):
    with pytest.raises(ValueError, match="router_aux_loss_coef needs a Mixture-of-Experts model"):
        Trainer(quick_config(tiny_model_dirs["llama"], tmp_path / "run", **{"model.router_aux_loss_coef": 0.01}))
    assert not (tmp_path / "run").exists()


TINY_MOE_WARM_START = {
    "arch": "qwen3_moe",
    "num_experts": 4,
    "experts_per_token": 2,
    "moe_intermediate_size": 32,
    "hidden_size": 32,
    "num_layers": 1,
    "num_heads": 2,
    "intermediate_size": 64,
    "steps": 20,
    "batch_size": 16,
}


def test_the_demo_model_warm_starts_as_an_moe_whose_routing_is_measured_at_evaluation(tmp_path, monkeypatch):
    """``model.warm_start`` makes the demo's tiny model a Qwen3-MoE; an evaluation reports the routing of its
    greedy completions (the policy's forward over them), the step line the training forwards'."""
    from grpolab.config import load_config
    from grpolab.run.step import vital_signs

    monkeypatch.setenv("GRPOLAB_CACHE", str(tmp_path / "cache"))
    cfg = load_config(
        None,
        {
            "model.warm_start": TINY_MOE_WARM_START,
            "output_dir": str(tmp_path / "run"),
            "steps": 1,
            "rollout.prompts_per_step": 4,
            "rollout.group_size": 4,
            "eval.n_examples": 16,
        },
    )
    trainer = Trainer(cfg)
    try:
        model = trainer.parts.learner.model
        assert model.config.model_type == "qwen3_moe" and model.config.num_experts == 4 and len(routers(model)) == 1
        record = trainer.train_step(1)
        evaluated = trainer.evaluate(1)
    finally:
        trainer.close()
    assert "router violation" in vital_signs(record, 1, 0.0)
    for metrics in (record, {k.removeprefix("val/"): v for k, v in evaluated.items()}):
        load = metrics["router/layer0/load"]
        assert len(load) == 4 and sum(load) == pytest.approx(1, abs=1e-5)
        assert metrics["router/load_max_violation"] == pytest.approx(max(load) * 4 - 1, abs=1e-4)
        assert 0.5 < metrics["router/confidence"] <= 1
    assert evaluated["val/router/load_max_violation"] != record["router/load_max_violation"], "other tokens"


def test_bad_warm_start_changes_are_refused_in_one_line():
    from grpolab.config import ConfigError, load_config

    with pytest.raises(
        ConfigError, match=r"model.warm_start.num_expertz: unknown field; did you mean model.warm_start.num_experts\?"
    ):
        load_config(None, {"model.warm_start": {"num_expertz": 8}})
    with pytest.raises(ConfigError, match="num_experts > 0 goes with a Mixture-of-Experts arch"):
        load_config(None, {"model.warm_start": {"arch": "llama", "num_experts": 8}})
    with pytest.raises(ConfigError, match="applies only without model.path"):
        load_config(None, {"model.path": "x", "model.warm_start": {"num_layers": 1}})


def test_the_report_draws_each_moe_runs_expert_load_per_layer(tmp_path):
    import json

    from grpolab.studies.report.routing import layer_loads, load_heatmaps
    from grpolab.studies.report.runs import Run

    loads = {step: [[0.25 * step / 3, 0.25, 0.25, 0.75 - 0.25 * step / 3], [0.1, 0.2, 0.3, 0.4]] for step in (1, 2, 3)}
    runs = []
    for name, moe in (("moe run", True), ("dense", False)):
        (tmp_path / name).mkdir()
        lines = [
            {
                "step": s,
                "reward_mean": 0.5,
                **({f"router/layer{i}/load": v for i, v in enumerate(loads[s])} if moe else {}),
            }
            for s in loads
        ] + [{"step": 3, "val/accuracy": 1}]
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
        runs.append(Run(name, tmp_path / name, "completed"))
    steps, grids = layer_loads(runs[0])
    assert steps == [1, 2, 3] and sorted(grids) == [0, 1] and grids[0].shape == (4, 3)
    assert grids[0][:, 2].tolist() == loads[3][0] and layer_loads(runs[1]) == ([], {})
    (tmp_path / "fig").mkdir()
    assert load_heatmaps(runs, tmp_path / "fig") == [
        ("moe run: expert load per layer over steps", "router_load_moe_run.png")
    ]
    assert (tmp_path / "fig" / "router_load_moe_run.png").stat().st_size > 1000


def test_lora_on_an_moe_adapts_attention_experts_and_routers(moe_dir, tmp_path):
    """transformers' MoE experts are fused 3-D parameters and its routers plain weights; with "all-linear" peft
    wraps them (beside the attention's linear layers), the routing is still recorded and replayed through the
    wrapped routers, and naming the experts as if they were linear layers is refused in one line."""
    overrides = {"model.lora": {"rank": 4}, "task.name": "custom_task:DigitShare", "algorithm.routing_replay": True}
    trainer = Trainer(quick_config(moe_dir, tmp_path / "run", **overrides))
    try:
        trained = {n for n, p in trainer.parts.learner.model.named_parameters() if p.requires_grad}
        assert all("lora_" in n for n in trained)
        assert {kind for kind in ("self_attn", ".experts.", ".gate.") if any(kind in n for n in trained)} == {
            "self_attn",
            ".experts.",
            ".gate.",
        }
        record = trainer.train_step(1)
    finally:
        trainer.close()
    assert record["actual_updates"] == 1 and record["router/mismatch"] < 0.05
    assert record["sync/logprob_diff_max"] < 1e-3
    with pytest.raises(ValueError, match="experts are fused 3-D parameters"):
        Trainer(quick_config(moe_dir, tmp_path / "run2", **{"model.lora": {"rank": 4, "target_modules": ["experts"]}}))


def test_merged_weights_of_an_moe_adapter_add_the_experts_and_routers_deltas(moe_dir, tokenizer):
    """peft adapts an MoE's fused experts and routers (parameter wrappers) beside its linear layers; the merged
    weights an engine is synced with add each wrapper's delta as peft computes it, so a plain model holding them
    computes the adapted policy."""
    from grpolab.config import LoraSettings
    from grpolab.models.lora import MergedWeights, _lora_layers, add_adapter, lora_delta

    adapter = add_adapter(AutoModelForCausalLM.from_pretrained(moe_dir), LoraSettings(rank=4), 0, moe_dir)
    policy = adapter.model
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    wrappers = {n: m for n, m in _lora_layers(policy).items() if hasattr(m, "parameter_name")}
    assert any(".experts" in n for n in wrappers) and any(n.endswith(".gate") for n in wrappers)
    for layer in wrappers.values():
        mine = lora_delta(layer, layer.lora_A["default"].weight.float(), layer.lora_B["default"].weight.float())
        torch.testing.assert_close(mine, layer.get_delta_weight("default").float(), rtol=0, atol=1e-7)
    plain = AutoModelForCausalLM.from_pretrained(moe_dir)
    missing = plain.load_state_dict(dict(MergedWeights(policy).named_parameters()), strict=False)
    assert not missing.unexpected_keys and set(missing.missing_keys) <= {"lm_head.weight"}
    ids = torch.tensor([tokenizer("What is 12 + 30?", add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(plain(input_ids=ids).logits, policy(input_ids=ids).logits, rtol=0, atol=1e-5)


def test_the_engine_sync_writes_an_moes_experts_in_its_checkpoint_format(warm_moe_dir, tmp_path):
    """transformers 5 fuses the per-expert weights it loads; the weights a vLLM engine is synced from are the
    checkpoint's names and tensors again (transformers' own reverse conversion), for a dense model unchanged."""
    from safetensors.torch import load_file

    from grpolab.rollout.vllm.engine import save_weights

    model = AutoModelForCausalLM.from_pretrained(warm_moe_dir)
    assert any(p.dim() == 3 for p in model.parameters()), "fused experts in memory"
    written = load_file(save_weights(model, tmp_path))
    on_disk = load_file(warm_moe_dir / "model.safetensors")
    assert written.keys() == on_disk.keys() and any(".experts.0.gate_proj." in k for k in on_disk)
    assert all(torch.equal(written[k], on_disk[k]) for k in on_disk)


def _untested_family(family: str):
    from transformers import Ernie4_5_MoeConfig, GraniteMoeConfig, PhimoeConfig, Qwen2MoeConfig

    return {
        "granitemoe": lambda: GraniteMoeConfig(**COMMON, num_local_experts=8),
        "phimoe": lambda: PhimoeConfig(**COMMON, num_local_experts=8),
        "ernie4_5_moe": lambda: Ernie4_5_MoeConfig(**COMMON, moe_num_experts=8, moe_intermediate_size=16),
        "qwen2_moe": lambda: Qwen2MoeConfig(**COMMON, num_experts=8, moe_intermediate_size=16),
    }[family]()


@pytest.mark.parametrize("family", ["granitemoe", "phimoe", "ernie4_5_moe", "qwen2_moe"])
def test_an_moe_family_whose_router_layout_is_untested_is_refused(family):
    """GraniteMoe's router returns (experts, weights, logits), PhiMoE's weights are sparsemixer's, Ernie-4.5 picks
    its experts from bias-corrected probabilities: none is the layout the metrics and the replay compute, so a
    family is recognised by name from an allow-list and any other MoE refused, never read by a class-name suffix."""
    from grpolab.models.routing import check_router_layout

    model = AutoModelForCausalLM.from_config(_untested_family(family))
    assert routers(model) == []
    for args in ((model.config,), (model.config, model)):  # the config alone decides before a weight is read
        with pytest.raises(ValueError, match=f"{family}: a Mixture-of-Experts family whose router"):
            check_router_layout(*args)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_tested_moe_families_and_dense_models_are_accepted(family, make_tiny_model):
    from grpolab.models.routing import check_router_layout

    model = tiny_moe(family)
    check_router_layout(model.config, model)
    assert len(routers(model)) == 2
    dense = make_tiny_model("llama")
    check_router_layout(dense.config, dense)


def test_a_granite_moe_run_is_refused_in_one_line_before_its_run_dir(tmp_path, tokenizer, capsys):
    """It crashed at its first step ("bincount_cpu" not implemented for 'Float'), after the run folder was made."""
    from grpolab.commands.cli import main

    config = _untested_family("granitemoe")
    config.vocab_size, config.pad_token_id = len(tokenizer), tokenizer.pad_token_id
    config.eos_token_id, config.max_position_embeddings = tokenizer.eos_token_id, 1024
    path, out = tmp_path / "granite", tmp_path / "run"
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    rollout = {"rollout.prompts_per_step": 2, "rollout.group_size": 2, "rollout.max_new_tokens": 8}
    settings = {"steps": 1, "task.n_train": 60, "task.n_val": 16, **rollout}
    assert main(["train", "--model", str(path), "--output-dir", str(out), *cli_pairs(settings)]) == 2
    errors = [line for line in capsys.readouterr().out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "granitemoe: a Mixture-of-Experts family" in errors[0], errors
    assert not out.exists()


def test_every_moe_arch_a_warm_start_builds_is_a_tested_router_family():
    from grpolab.models.routing import ROUTED_FAMILIES
    from grpolab.models.settings import MOE_ARCHS

    assert set(MOE_ARCHS) <= set(ROUTED_FAMILIES)
