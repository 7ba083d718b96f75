"""Loss values and gradients against the float64 reference, plus the invariants of each objective."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import reference_loss

from grpolab.objectives.algorithms import AlgorithmSpec
from grpolab.objectives.losses import (
    NonFiniteError,
    PolicyLossInput,
    aggregate,
    policy_loss,
    raise_if_nonfinite,
    sequence_ratio,
    step_denominators,
)
from grpolab.objectives.presets import PRESETS

WEIGHTS = ["none", "noclip", "clip", "gspo", "cispo", "sapo", "vespo", "gmpo", "dppo"]
AGGREGATIONS = ["sequence", "token", "constant", "sequence_sum"]
MAX_NEW = 12


def make_batch(seed: int, n: int = 6, t: int = 16, spread: float = 0.4, with_ref: bool = True):
    """Random batch: a prompt prefix, a response of random length, then padding (all float64)."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(n, t, dtype=torch.float64)
    for i in range(n):
        start = int(torch.randint(0, min(4, t - 1) + 1, (1,), generator=g))
        length = int(torch.randint(1, t - start + 1, (1,), generator=g))
        mask[i, start : start + length] = 1
    old = -torch.rand(n, t, generator=g, dtype=torch.float64) * 3
    logp = old + torch.randn(n, t, generator=g, dtype=torch.float64) * spread
    ref = old + torch.randn(n, t, generator=g, dtype=torch.float64) * 0.3 if with_ref else None
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    adv[0] = 0.0
    return logp, old, adv, mask, ref


def impl_loss_and_grad(spec, logp, old, adv, mask, ref=None):
    leaf = logp.clone().requires_grad_(True)
    denominators = step_denominators(spec, mask, MAX_NEW, advantages=adv)
    loss, metrics = policy_loss(PolicyLossInput(leaf, old, adv, mask, ref), spec, denominators)
    loss.backward()
    raise_if_nonfinite(metrics.on_host())
    return loss.detach(), leaf.grad, metrics


def ref_loss_and_grad(spec, logp, old, adv, mask, ref=None):
    leaf = logp.clone().requires_grad_(True)
    loss = reference_loss(
        leaf,
        old,
        adv,
        mask,
        weight=spec.weight,
        aggregation=spec.aggregation,
        eps_low=spec.eps_low,
        eps_high=spec.eps_high,
        z=spec.loss_denominator,
        max_new_tokens=MAX_NEW,
        ref=ref,
        beta=spec.beta,
        kl_ratio=spec.use_bias_correction_kl,
        delta=spec.clip_delta,
        tau_pos=spec.sapo_temperature_pos,
        tau_neg=spec.sapo_temperature_neg,
        vespo=(spec.vespo_k_pos, spec.vespo_lambda_pos, spec.vespo_k_neg, spec.vespo_lambda_neg),
        ratio_cap=spec.ratio_cap,
        kl_tau=spec.kl_tau,
        filter_zero_advantages=spec.filter_zero_advantages,
    )
    loss.backward()
    return loss.detach(), leaf.grad


def assert_matches_reference(spec, seed, spread=0.4):
    logp, old, adv, mask, ref = make_batch(seed, spread=spread)
    loss, grad, _ = impl_loss_and_grad(spec, logp, old, adv, mask, ref)
    ref_value, ref_grad = ref_loss_and_grad(spec, logp, old, adv, mask, ref)
    torch.testing.assert_close(loss, ref_value, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("weight,aggregation", list(itertools.product(WEIGHTS, AGGREGATIONS)))
@pytest.mark.parametrize("beta", [0.0, 0.05])
def test_every_weighting_and_aggregation_matches_reference(weight, aggregation, beta):
    spec = AlgorithmSpec(name="t", weight=weight, aggregation=aggregation, eps_low=0.1, eps_high=0.3, beta=beta)
    # a spread big enough that clipping is active on some tokens
    assert_matches_reference(spec, seed=hash((weight, aggregation)) % 1000, spread=0.4)


@pytest.mark.parametrize("weight, aggregation", [("clip", "sequence"), ("clip", "token"), ("gspo", "constant")])
def test_the_bias_corrected_kl_matches_its_reference_and_moves_the_gradient(weight, aggregation):
    """DeepSeek-V3.2's KL: each token's k3 times w = pi / pi_old, differentiated through w as well."""
    spec = AlgorithmSpec(name="t", weight=weight, aggregation=aggregation, beta=0.5, use_bias_correction_kl=True)
    assert_matches_reference(spec, seed=7)
    logp, old, adv, mask, ref = make_batch(7)
    corrected = impl_loss_and_grad(spec, logp, old, adv, mask, ref)[1]
    plain = impl_loss_and_grad(spec.override(use_bias_correction_kl=False), logp, old, adv, mask, ref)[1]
    assert not torch.allclose(corrected, plain, rtol=1e-3, atol=1e-8)
    on_policy = impl_loss_and_grad(spec, old.clone(), old, adv, mask, ref)  # w = 1: the value is the plain one's
    plain_on_policy = impl_loss_and_grad(spec.override(use_bias_correction_kl=False), old.clone(), old, adv, mask, ref)
    torch.testing.assert_close(on_policy[0], plain_on_policy[0], rtol=1e-12, atol=0)
    with pytest.raises(ValueError, match="use_bias_correction_kl corrects the KL penalty; it needs beta > 0"):
        spec.override(beta=0.0)


# on-policy distillation reads a teacher's log-probs: tests/test_distillation.py has its own float64 reference
@pytest.mark.parametrize("name", [n for n in PRESETS if not PRESETS[n].needs_teacher])
def test_every_preset_matches_reference(name):
    spec = PRESETS[name]
    spread = 3e-4 if spec.weight == "gspo" else 0.3  # put GSPO's tiny ratios near its clip edges
    for seed in range(3):
        assert_matches_reference(spec, seed=seed, spread=spread)


def test_clipping_really_happens_in_the_reference_batches():
    logp, old, adv, mask, _ = make_batch(0, spread=0.4)
    _, _, metrics = impl_loss_and_grad(PRESETS["grpo"], logp, old, adv, mask)
    assert metrics.means()["clip_frac"] > 0


@pytest.mark.parametrize("weight", WEIGHTS)
def test_ratio_is_one_and_nothing_clipped_when_policy_equals_old(weight):
    logp, _, adv, mask, _ = make_batch(1)
    spec = AlgorithmSpec(name="t", weight=weight, eps_high=0.2)
    _, _, metrics = impl_loss_and_grad(spec, logp, logp.clone(), adv, mask)
    m = metrics.means()
    assert m["ratio_mean"] == 1.0 and m["ratio_min"] == 1.0 and m["ratio_max"] == 1.0
    assert m["clip_frac"] == 0.0 and m["approx_kl_old_new"] == 0.0


@pytest.mark.parametrize("weight,aggregation", list(itertools.product(WEIGHTS, AGGREGATIONS)))
def test_masked_positions_never_change_loss_or_gradient(weight, aggregation):
    spec = AlgorithmSpec(name="t", weight=weight, aggregation=aggregation, beta=0.1)
    logp, old, adv, mask, ref = make_batch(2)
    loss_a, grad_a, _ = impl_loss_and_grad(spec, logp, old, adv, mask, ref)
    off = mask == 0
    garbage = lambda x, v: torch.where(off, torch.full_like(x, v), x)  # noqa: E731
    loss_b, grad_b, _ = impl_loss_and_grad(
        spec, garbage(logp, 80.0), garbage(old, -90.0), adv, mask, garbage(ref, 70.0)
    )
    assert torch.equal(loss_a, loss_b)
    assert torch.equal(grad_a, grad_b)
    assert (grad_b[off] == 0).all()


def test_gspo_ratio_is_exp_of_mean_token_log_ratio():
    logp, old, _, mask, _ = make_batch(3)
    s = sequence_ratio(logp, old, mask)
    for i in range(mask.shape[0]):
        toks = mask[i].bool()
        expected = torch.exp((logp[i, toks] - old[i, toks]).mean())
        torch.testing.assert_close(s[i], expected, rtol=1e-12, atol=0)


def test_cispo_gradient_is_detached_clipped_weight_times_advantage_times_grad_logp():
    spec = PRESETS["cispo"].override(eps_high=0.25)
    logp, old, adv, mask, _ = make_batch(4, spread=0.5)
    _, grad, metrics = impl_loss_and_grad(spec, logp, old, adv, mask)
    w = torch.exp(logp - old).clamp(max=1.25)
    expected = -w * adv[:, None] * mask / mask.sum()  # token aggregation
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-14)
    assert metrics.means()["clip_high_frac"] > 0


def test_constant_denominator_does_not_depend_on_response_lengths():
    spec = PRESETS["dr_grpo"]
    short = torch.zeros(4, 20)
    short[:, 2:4] = 1
    long = torch.zeros(4, 20)
    long[:, 2:19] = 1
    assert step_denominators(spec, short, 512).policy == step_denominators(spec, long, 512).policy == 4 * 512
    assert step_denominators(spec.override(loss_denominator=1000.0), long, 512).policy == 1000.0
    assert step_denominators(PRESETS["dapo"], long, 512).policy == long.sum().item()


def test_sequence_aggregation_is_mean_of_sequence_means():
    per_token = torch.tensor([[1.0, 3.0, 0.0], [4.0, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]], dtype=torch.float64)
    assert aggregate(per_token, mask, "sequence", 2.0).item() == pytest.approx((2.0 + 4.0) / 2)
    assert aggregate(per_token, mask, "token", 3.0).item() == pytest.approx(8.0 / 3)


def test_kl_metric_is_reported_at_beta_zero_and_not_in_the_loss():
    logp, old, adv, mask, ref = make_batch(5)
    spec = PRESETS["grpo"]
    loss_with_ref, grad_with_ref, metrics = impl_loss_and_grad(spec, logp, old, adv, mask, ref)
    loss_no_ref, grad_no_ref, _ = impl_loss_and_grad(spec, logp, old, adv, mask, None)
    assert metrics.means()["kl_ref"] > 0
    assert torch.equal(loss_with_ref, loss_no_ref) and torch.equal(grad_with_ref, grad_no_ref)


def test_non_finite_logprob_on_the_response_raises():
    logp, old, adv, mask, _ = make_batch(6)
    i, t = mask.nonzero()[0].tolist()
    logp[i, t] = float("nan")
    with pytest.raises(NonFiniteError):
        impl_loss_and_grad(PRESETS["grpo"], logp, old, adv, mask)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    n=st.integers(1, 7),
    t=st.integers(2, 12),
    weight=st.sampled_from(WEIGHTS),
    aggregation=st.sampled_from(AGGREGATIONS),
)
def test_property_matches_reference_on_random_shapes(seed, n, t, weight, aggregation):
    spec = AlgorithmSpec(name="t", weight=weight, aggregation=aggregation, eps_low=0.15, eps_high=0.25, beta=0.02)
    logp, old, adv, mask, ref = make_batch(seed, n=n, t=t)
    loss, grad, _ = impl_loss_and_grad(spec, logp, old, adv, mask, ref)
    ref_value, ref_grad = ref_loss_and_grad(spec, logp, old, adv, mask, ref)
    torch.testing.assert_close(loss, ref_value, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("name", ["grpo", "dapo", "gspo", "cispo", "rft"])
def test_engine_mismatch_correction_matches_reference(level, name):
    spec = PRESETS[name].override(engine_correction=level, engine_correction_cap=1.5)
    logp, old, adv, mask, _ = make_batch(11, spread=0.2)
    g = torch.Generator().manual_seed(12)
    engine = old + torch.randn(old.shape, generator=g, dtype=torch.float64) * 0.3
    leaf = logp.clone().requires_grad_(True)
    loss, metrics = policy_loss(
        PolicyLossInput(leaf, old, adv, mask, engine_logprobs=engine), spec, step_denominators(spec, mask, MAX_NEW)
    )
    loss.backward()
    ref_leaf = logp.clone().requires_grad_(True)
    want = reference_loss(
        ref_leaf,
        old,
        adv,
        mask,
        weight=spec.weight,
        aggregation=spec.aggregation,
        eps_low=spec.eps_low,
        eps_high=spec.eps_high,
        max_new_tokens=MAX_NEW,
        engine=engine,
        correction=level,
        cap=1.5,
    )
    want.backward()
    torch.testing.assert_close(loss.detach(), want.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(leaf.grad, ref_leaf.grad, rtol=1e-10, atol=1e-12)
    m = metrics.means()
    assert 0 < m["rollout_truncated_frac"] < 1 if level == "token" else m["rollout_truncated_frac"] >= 0
    assert m["engine_logprob_absdiff"] > 0


def test_engine_correction_is_off_by_default_and_inert_when_engine_matches():
    logp, old, adv, mask, _ = make_batch(13)
    base, base_grad, _ = impl_loss_and_grad(PRESETS["grpo"], logp, old, adv, mask)
    spec = PRESETS["grpo"].override(engine_correction="token")
    leaf = logp.clone().requires_grad_(True)
    loss, _ = policy_loss(
        PolicyLossInput(leaf, old, adv, mask, engine_logprobs=old.clone()), spec, step_denominators(spec, mask, MAX_NEW)
    )
    loss.backward()
    torch.testing.assert_close(loss.detach(), base, rtol=1e-12, atol=0)
    torch.testing.assert_close(leaf.grad, base_grad, rtol=1e-12, atol=0)
