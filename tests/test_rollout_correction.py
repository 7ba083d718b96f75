"""Rollout corrections (engine / trainer mismatch) against float64 references written from their formulas,
the old ``engine_correction`` spelling, micro-batch invariance, metrics and refused combinations."""

from __future__ import annotations

import json
import math

import pytest
import torch
from reference import reference_corrected_loss, reference_off_policy_mask, reference_rollout_correction

from grpolab.config import ConfigError, RunConfig, load_config, load_run_config, validate_config
from grpolab.objectives.algorithms import AlgorithmSpec
from grpolab.objectives.losses import PolicyLossInput, TokenMetrics, policy_loss, step_denominators
from grpolab.objectives.presets import PRESETS
from grpolab.objectives.rollout_correction import (
    ROLLOUT_CORRECTIONS,
    engine_kl_k3,
    off_policy_sequence_mask,
    resolve_rollout_correction,
    rollout_correction,
)

MAX_NEW = 12
MODES = [m for m in ROLLOUT_CORRECTIONS if m != "none"]
NONE = PRESETS["grpo"].override(rollout_correction="none")  # what auto resolves to in float32, in sync


def make_batch(seed: int, n: int = 8, t: int = 14):
    """float64 batch: prompt prefix, response of random length, padding; engine log-probs near old."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(n, t, dtype=torch.float64)
    for i in range(n):
        start = int(torch.randint(0, 3, (1,), generator=g))
        length = int(torch.randint(1, t - start + 1, (1,), generator=g))
        mask[i, start : start + length] = 1
    old = -torch.rand(n, t, generator=g, dtype=torch.float64) * 3
    logp = old + torch.randn(n, t, generator=g, dtype=torch.float64) * 0.2
    engine = old + torch.randn(n, t, generator=g, dtype=torch.float64) * 0.25
    engine = engine * mask  # the batch holds 0 outside the response, as collate writes it
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    return logp, old, engine, adv, mask


def run_loss(spec, logp, old, adv, mask, engine, rows=None, denominators=None):
    rows = torch.arange(mask.shape[0]) if rows is None else rows
    leaf = logp.clone().requires_grad_(True)
    denominators = denominators or step_denominators(spec, mask, MAX_NEW)
    pick = lambda x: None if x is None else x[rows]  # noqa: E731
    inp = PolicyLossInput(leaf[rows], old[rows], adv[rows], mask[rows], engine_logprobs=pick(engine))
    loss, metrics = policy_loss(inp, spec, denominators)
    loss.backward()
    return loss.detach(), leaf.grad, metrics


def band(mode):
    """(upper, lower) that make every mode cut on both sides of this batch's ratios."""
    if mode.startswith("sequence"):
        return 1.5, 0.6
    if mode.startswith("geometric"):
        return 1.05, 0.97
    return 1.2, 0.85


@pytest.mark.parametrize(  # icepop always has a lower bound (refused without one: test_bad_combinations...)
    ("mode", "two_sided"), [(m, True) for m in MODES] + [(m, False) for m in MODES if m != "icepop"]
)
def test_each_mode_matches_its_reference(mode, two_sided):
    logp, old, engine, adv, mask = make_batch(1)
    upper, lower = band(mode)
    lower = lower if two_sided else None
    got = rollout_correction(old - engine, mask, mode, upper, lower)
    weights, kept = reference_rollout_correction(old, engine, mask, mode, upper, lower)
    for i in range(mask.shape[0]):
        on = mask[i].bool()
        torch.testing.assert_close(got.weight[i][on], torch.tensor(weights[i], dtype=torch.float64), rtol=1e-12, atol=0)
        assert got.kept[i][on].tolist() == kept[i]
        assert not got.kept[i][~on].any() and (got.weight[i][~on] == 0).all()
    cut = got.truncated if mode.endswith("_truncate") else ~got.kept
    assert 0 < float((cut & mask.bool()).sum()) < float(mask.sum()), "the band cuts some tokens, not all"

    for aggregation in ("sequence", "token", "constant"):
        spec = PRESETS["grpo"].override(
            rollout_correction=mode,
            rollout_correction_upper=upper,
            rollout_correction_lower=lower,
            aggregation=aggregation,
        )
        loss, grad, _ = run_loss(spec, logp, old, adv, mask, engine)
        ref_leaf = logp.clone().requires_grad_(True)
        want = reference_corrected_loss(
            ref_leaf, old, adv, mask, weight="clip", aggregation=aggregation, max_new_tokens=MAX_NEW,
            engine=engine, mode=mode, upper=upper, lower=lower,
        )  # fmt: skip
        want.backward()
        torch.testing.assert_close(loss, want.detach(), rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(grad, ref_leaf.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("mode", ["none", "token_truncate", "sequence_mask"])
def test_off_policy_sequence_mask_matches_its_reference(mode):
    logp, old, engine, adv, mask = make_batch(2)
    logp = logp - 0.3 * torch.rand(logp.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    delta = 0.15
    kept = off_policy_sequence_mask(engine, logp, adv, mask, delta)
    want = reference_off_policy_mask(engine, logp, adv, mask, delta)
    assert [bool(kept[i][mask[i].bool()].all()) for i in range(len(want))] == want
    assert not all(want) and any(want) and all(w for w, a in zip(want, adv) if a >= 0)
    spec = PRESETS["dapo"].override(rollout_correction=mode, rollout_correction_upper=2.5, off_policy_mask_delta=delta)
    loss, grad, metrics = run_loss(spec, logp, old, adv, mask, engine)
    ref_leaf = logp.clone().requires_grad_(True)
    ref = reference_corrected_loss(
        ref_leaf, old, adv, mask, weight="clip", aggregation="token", max_new_tokens=MAX_NEW, engine=engine,
        mode=mode, upper=2.5, delta=delta, eps_high=0.28,
    )  # fmt: skip
    ref.backward()
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, ref_leaf.grad, rtol=1e-10, atol=1e-12)
    dropped = sum(mask[i].sum() for i, w in enumerate(want) if not w) / mask.sum()
    assert metrics.means()["off_policy_masked_frac"] == pytest.approx(float(dropped), rel=1e-12)


def test_off_policy_mask_without_engine_logprobs_measures_old_logprobs():
    logp, old, _, adv, mask = make_batch(4)
    spec = PRESETS["grpo"].override(off_policy_mask_delta=0.05)
    far = old - 0.5  # pi_theta moved away from the sampling policy (a later epoch): negative-advantage rows go
    _, grad, metrics = run_loss(spec, far, old, adv, mask, None)
    rows_kept = [not (float(a) < 0) for a in adv]
    assert reference_off_policy_mask(old, far, adv, mask, 0.05) == rows_kept
    assert all((grad[i] == 0).all() != keep for i, keep in enumerate(rows_kept))
    assert metrics.means()["off_policy_masked_frac"] > 0


@pytest.mark.parametrize("mode", ["icepop", "token_mask", "sequence_truncate", "geometric_mask"])
def test_mask_modes_are_inert_without_engine_logprobs(mode):
    logp, old, _, adv, mask = make_batch(5)
    spec = PRESETS["grpo"].override(rollout_correction=mode, rollout_correction_lower=0.9, rollout_correction_upper=1.1)
    base, base_grad, _ = run_loss(PRESETS["grpo"], logp, old, adv, mask, None)
    loss, grad, metrics = run_loss(spec, logp, old, adv, mask, None)
    assert torch.equal(loss, base) and torch.equal(grad, base_grad)
    assert "rollout_masked_frac" not in metrics.means()


def test_without_a_correction_the_mismatch_is_measured_and_no_number_changes():
    """Engine log-probs (every training step has them) add the mismatch metrics, k3 and the ratio
    pi_old / pi_engine's mean and max, and change neither the loss nor the gradient."""
    logp, old, engine, adv, mask = make_batch(10)
    loss, grad, metrics = run_loss(NONE, logp, old, adv, mask, engine)
    base, base_grad, base_metrics = run_loss(NONE, logp, old, adv, mask, None)
    assert torch.equal(loss, base) and torch.equal(grad, base_grad)
    m = metrics.means()
    assert set(m) - set(base_metrics.means()) == {
        "engine_logprob_absdiff",
        "rollout_kl_k3",
        "rollout_is_ratio_mean",
        "rollout_is_ratio_max",
    }
    r = torch.exp(old - engine)[mask.bool()]
    assert m["rollout_is_ratio_mean"] == pytest.approx(float(r.mean()), rel=1e-12)
    assert m["rollout_is_ratio_max"] == pytest.approx(float(r.max()), rel=1e-12)
    assert m["rollout_kl_k3"] == pytest.approx(float((r - 1 - torch.log(r)).mean()), rel=1e-10)
    assert not base_metrics.maxima and not any(k.startswith("rollout_") for k in base_metrics.means())


def test_the_mismatch_metrics_survive_a_float32_overflow():
    """A token the engine found far less likely than the trainer: exp(log r) overflows float32, not float64."""
    logp, old, engine, adv, mask = (x.float() for x in make_batch(11))
    row, col = 0, int(mask[0].nonzero()[0])
    engine[row, col] = old[row, col] - 100.0
    _, _, metrics = run_loss(NONE, logp, old, adv, mask, engine)
    m = metrics.means()
    assert math.isfinite(m["rollout_is_ratio_max"]) and m["rollout_is_ratio_max"] == pytest.approx(
        math.exp(100), rel=1e-5
    )
    assert math.isfinite(m["rollout_kl_k3"]) and math.isfinite(m["rollout_is_ratio_mean"])


@pytest.mark.parametrize("mode", [*MODES, "none"])
def test_micro_batches_give_the_whole_batch_gradient(mode):
    logp, old, engine, adv, mask = make_batch(6)
    upper, lower = band(mode)
    spec = PRESETS["grpo"].override(
        rollout_correction=mode, rollout_correction_upper=upper, rollout_correction_lower=lower,
        off_policy_mask_delta=0.02,
    )  # fmt: skip
    whole, whole_grad, whole_metrics = run_loss(spec, logp, old, adv, mask, engine)
    denominators = step_denominators(spec, mask, MAX_NEW)
    parts = [
        run_loss(spec, logp, old, adv, mask, engine, rows, denominators)
        for rows in (torch.arange(3), torch.arange(3, 8))
    ]
    torch.testing.assert_close(sum(p[0] for p in parts), whole, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(sum(p[1] for p in parts), whole_grad, rtol=1e-12, atol=1e-14)
    merged = parts[0][2].merge(parts[1][2]).means()
    for name, value in whole_metrics.means().items():
        assert merged[name] == pytest.approx(value, rel=1e-12, abs=1e-15), name


def test_metrics_are_the_weight_mean_max_fractions_and_k3():
    logp, old, engine, adv, mask = make_batch(7)
    spec = PRESETS["grpo"].override(rollout_correction="token_truncate", rollout_correction_upper=1.2)
    _, _, metrics = run_loss(spec, logp, old, adv, mask, engine)
    m = metrics.means()
    on = mask.bool()
    r = torch.exp(old - engine)[on]
    assert m["rollout_is_weight_mean"] == pytest.approx(float(r.clamp(max=1.2).mean()), rel=1e-12)
    assert m["rollout_is_weight_max"] == pytest.approx(float(r.clamp(max=1.2).max()), rel=1e-12) == 1.2
    assert m["rollout_truncated_frac"] == pytest.approx(float((r > 1.2).double().mean()), rel=1e-12)
    assert m["rollout_masked_frac"] == 0.0
    assert m["rollout_kl_k3"] == pytest.approx(float((r - 1 - torch.log(r)).mean()), rel=1e-10)
    assert m["rollout_is_ratio_max"] == pytest.approx(float(r.max()), rel=1e-12)  # before the truncation
    assert m["rollout_is_ratio_max"] > 1.2
    assert torch.equal(engine_kl_k3(old - engine, mask)[~on], torch.zeros(int((~on).sum()), dtype=torch.float64))
    spec = spec.override(rollout_correction="token_mask")
    m = run_loss(spec, logp, old, adv, mask, engine)[2].means()
    assert m["rollout_masked_frac"] == pytest.approx(float((r > 1.2).double().mean()), rel=1e-12)
    assert m["rollout_truncated_frac"] == 0.0 and m["rollout_is_weight_max"] <= 1.2
    assert m["rollout_is_weight_mean"] == pytest.approx(float(torch.where(r > 1.2, 0, r).mean()), rel=1e-12)
    # the max survives a merge, also from the device form
    a = TokenMetrics(tokens=torch.tensor(1.0), maxima={"rollout_is_weight_max": torch.tensor(1.5, dtype=torch.float64)})
    b = TokenMetrics(tokens=1.0, maxima={"rollout_is_weight_max": 2.5})
    assert a.merge(b).means()["rollout_is_weight_max"] == 2.5 == b.merge(a).on_host().maxima["rollout_is_weight_max"]


def test_an_overflowing_sequence_ratio_is_dropped_without_nan():
    logp, old, engine, adv, mask = make_batch(8)
    engine[0] = torch.where(mask[0].bool(), old[0] - 800.0, engine[0])  # exp(sum) overflows to inf
    spec = PRESETS["grpo"].override(rollout_correction="sequence_mask", rollout_correction_upper=3.0)
    loss, grad, metrics = run_loss(spec, logp, old, adv, mask, engine)
    assert torch.isfinite(loss) and torch.isfinite(grad).all() and (grad[0] == 0).all()
    assert metrics.on_host().nonfinite == 0 and metrics.means()["rollout_masked_frac"] > 0


@pytest.mark.parametrize(
    ("old_level", "new_mode"), [("none", "none"), ("token", "token_truncate"), ("sequence", "sequence_truncate")]
)
def test_the_old_spelling_reads_as_the_new(old_level, new_mode, tmp_path):
    new = PRESETS["cispo"].override(rollout_correction=new_mode, rollout_correction_upper=1.5)
    assert PRESETS["cispo"].override(engine_correction=old_level, engine_correction_cap=1.5) == new
    dumped = new.model_dump()
    del dumped["rollout_correction"], dumped["rollout_correction_upper"]
    older = {**dumped, "engine_correction": old_level, "engine_correction_cap": 1.5}
    older = {k: v for k, v in older.items() if k not in ("rollout_correction_lower", "off_policy_mask_delta")}
    assert AlgorithmSpec.model_validate(older) == new
    # a run's config.json from an older commit (its algorithm written whole) resumes with the same spec
    run = RunConfig().model_dump(mode="json")
    run["algorithm"] = older
    assert validate_config(run).algorithm == new
    (tmp_path / "config.json").write_text(json.dumps(run))
    assert load_run_config(tmp_path).algorithm == new  # what --resume reads
    # and the command line's old spelling
    cfg = load_config(None, {"algorithm.name": "cispo", "algorithm.engine_correction": old_level})
    assert cfg.algorithm.rollout_correction == new_mode


def test_the_old_spelling_computes_what_it_computed():
    """engine_correction token/sequence: sg(min(r, cap)) per token / sg(min(prod r, cap)) per sequence."""
    logp, old, engine, adv, mask = make_batch(9)
    for level, mode in (("token", "token_truncate"), ("sequence", "sequence_truncate")):
        spec = PRESETS["grpo"].override(engine_correction=level, engine_correction_cap=1.3)
        weights, _ = reference_rollout_correction(old, engine, mask, mode, 1.3)
        for i in range(mask.shape[0]):
            log_r = [float(old[i, t] - engine[i, t]) for t in range(mask.shape[1]) if mask[i, t] > 0]
            want = (
                [min(math.exp(v), 1.3) for v in log_r]
                if level == "token"
                else [min(math.exp(sum(log_r)), 1.3)] * len(log_r)
            )
            assert weights[i] == pytest.approx(want, rel=1e-12)
        assert spec.rollout_correction == mode


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        (
            {"rollout_correction": "token_mask", "rollout_correction_lower": 2.0, "rollout_correction_upper": 2.0},
            "below",
        ),
        ({"rollout_correction_lower": 3.0}, "below rollout_correction_upper 2.0"),
        ({"rollout_correction": "icepop"}, "icepop needs rollout_correction_lower"),
        ({"engine_correction": "token", "rollout_correction": "sequence_mask"}, "old spelling"),
        ({"rollout_correction": "token_clip"}, "rollout_correction"),
        ({"off_policy_mask_delta": -0.1}, "off_policy_mask_delta"),
    ],
)
def test_bad_combinations_are_refused_in_one_line(fields, needle):
    with pytest.raises(ConfigError) as err:
        validate_config({"algorithm": {"name": "grpo", **fields}})
    message = str(err.value)
    assert "\n" not in message and needle in message and "algorithm" in message


@pytest.mark.parametrize(
    ("setting", "engine_differs", "stale", "want"),
    [
        ("auto", False, False, "none"),  # float32 engine in sync: weights 1 +- 1e-5
        ("auto", True, False, "token_truncate"),  # bf16 rollouts
        ("auto", False, True, "token_truncate"),  # stale weights (asynchronous rollouts)
        ("auto", True, True, "token_truncate"),
        ("none", True, True, "none"),  # an explicit setting is kept
        ("sequence_mask", False, False, "sequence_mask"),
    ],
)
def test_auto_resolves_by_precision_and_staleness(setting, engine_differs, stale, want):
    assert resolve_rollout_correction(setting, engine_differs, stale) == want


def test_auto_is_the_default_and_an_explicit_none_stays_none(tmp_path):
    assert RunConfig().algorithm.rollout_correction == "auto" == PRESETS["dapo"].rollout_correction
    assert RunConfig().algorithm.rollout_correction_upper == 2.0
    explicit = validate_config({"algorithm": {"name": "grpo", "rollout_correction": "none"}})
    assert explicit.algorithm.rollout_correction == "none"
    run = RunConfig().model_dump(mode="json")  # a config.json of a run before auto existed: "none" written out
    run["algorithm"]["rollout_correction"] = "none"
    (tmp_path / "config.json").write_text(json.dumps(run))
    assert load_run_config(tmp_path).algorithm.rollout_correction == "none"
    assert load_config(None, {"algorithm.engine_correction": "none"}).algorithm.rollout_correction == "none"


def test_a_run_resolves_auto_from_its_precision_and_records_why():
    from grpolab.models.precision import resolve_precision
    from grpolab.run.parts import resolve_auto

    fp32, bf16 = resolve_precision("fp32_master", torch.float32), resolve_precision("fp32_master", torch.bfloat16)
    cfg, why = resolve_auto(RunConfig(), fp32)
    assert cfg.algorithm.rollout_correction == "none" and why["algorithm.rollout_correction"].startswith("none (auto:")
    cfg, why = resolve_auto(RunConfig(), bf16)
    assert cfg.algorithm.rollout_correction == "token_truncate" and cfg.algorithm.rollout_correction_upper == 2.0
    assert "precision" in why["algorithm.rollout_correction"]
    assert resolve_auto(RunConfig(), fp32, stale=True)[0].algorithm.rollout_correction == "token_truncate"
    cfg = validate_config({"algorithm": {"name": "cispo", "rollout_correction": "none"}})
    assert resolve_auto(cfg, bf16) == (cfg, {})  # explicit: kept, nothing to say
    # the rest of the config is untouched, the algorithm's other fields too
    resolved = resolve_auto(validate_config({"algorithm": {"name": "cispo"}, "steps": 7}), bf16)[0]
    assert resolved.steps == 7 and resolved.algorithm == PRESETS["cispo"].override(rollout_correction="token_truncate")


def test_a_spec_used_on_its_own_reads_auto_as_none_and_a_run_never_leaves_it_unresolved():
    """A preset used directly (no run to know the engine's precision) computes what it computed before auto;
    the learner refuses an unresolved auto, and the pure function refuses it with the hint."""
    logp, old, engine, adv, mask = make_batch(12)
    auto, base = run_loss(PRESETS["grpo"], logp, old, adv, mask, engine), run_loss(NONE, logp, old, adv, mask, engine)
    assert torch.equal(auto[0], base[0]) and torch.equal(auto[1], base[1])
    assert auto[2].means() == base[2].means()
    with pytest.raises(ValueError, match="auto is resolved when the run starts"):
        rollout_correction(old - engine, mask, "auto", 2.0)
    from grpolab.learning.learner import LearnerState, PolicyLearner, TrainedModel

    with pytest.raises(ValueError, match="unresolved"):
        PolicyLearner(RunConfig(), TrainedModel(None, None, None, None, 0), LearnerState({}))
