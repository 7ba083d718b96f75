"""TRL's loss types (SAPO, BNPO, LUSPO, VESPO, INTELLECT-2's two-sided clip): their papers' properties, the float64
references beyond the every-preset tests of test_losses.py, micro-batch exactness and the refused combinations.

The cross-check against TRL's own ``_compute_loss`` is tests/test_objectives_trl.py.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from pydantic import ValidationError
from reference import reference_beta_advantages
from test_losses import assert_matches_reference, impl_loss_and_grad, make_batch, ref_loss_and_grad
from test_update import ToyPolicy, make_data, step_grad

from grpolab.common.validation import describe_validation_error
from grpolab.config import ConfigError, validate_config
from grpolab.objectives.advantages import group_advantages
from grpolab.objectives.algorithms import AlgorithmSpec
from grpolab.objectives.beta_norm import beta_parameters
from grpolab.objectives.losses import PolicyLossInput, policy_loss, step_denominators
from grpolab.objectives.presets import PRESETS, get_algorithm
from grpolab.objectives.surrogates.soft_weights import vespo_phi

NEW = ["sapo", "bnpo", "luspo", "vespo", "intellect2"]


# ---- BNPO: the paper's Beta normalization of the advantage ----------------------------------------------------
@pytest.mark.parametrize("binary", [True, False])
def test_bnpo_advantages_match_the_reference(binary):
    g = torch.Generator().manual_seed(3)
    rewards = torch.rand(6, 8, generator=g, dtype=torch.float64).round(decimals=1)
    rewards = (rewards >= 0.5).double() if binary else rewards
    rewards[2] = 1.0  # an all-correct group: advantage 0
    got = group_advantages(rewards, "mean", "beta_density")
    want = torch.tensor(reference_beta_advantages(rewards.tolist()), dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert (got[2] == 0).all()
    alpha, beta = beta_parameters(rewards.mean(1))
    assert (alpha, beta) != (1.0, 1.0), "the batch's fit is not the uniform fallback"
    centered = rewards - rewards.mean(1, keepdim=True)
    assert not torch.allclose(got, centered), "the density rescales the groups"


def test_bnpo_is_reinforce_with_baseline_when_the_fit_is_uniform():
    """alpha = beta = 1 (one group, or every group with the same success rate): density 1, A = r - p."""
    one = torch.tensor([[1.0, 0.0, 0.0, 1.0, 1.0]], dtype=torch.float64)
    torch.testing.assert_close(group_advantages(one, "mean", "beta_density"), one - one.mean(1, keepdim=True))
    same_rate = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.0, 1.0, 1.0, 0.0]], dtype=torch.float64)
    assert beta_parameters(same_rate.mean(1)) == (1.0, 1.0)
    torch.testing.assert_close(
        group_advantages(same_rate, "mean", "beta_density"), same_rate - same_rate.mean(1, keepdim=True)
    )


def test_bnpo_weighs_hard_and_easy_prompts_by_the_batch_fit():
    """Most prompts near p = 1/2: alpha = beta > 3/2, the density peaks there, so a prompt at p = 1/2 gets a
    smaller advantage than GRPO's std would give it relative to one at p = 3/8."""
    rewards = torch.tensor(
        [[1, 1, 1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 0, 0, 0], [0, 1, 0, 1, 0, 1, 0, 1]],
        dtype=torch.float64,
    )
    alpha, beta = beta_parameters(rewards.mean(1))
    assert alpha == pytest.approx(beta) and alpha > 1.5
    adv = group_advantages(rewards, "mean", "beta_density")
    grpo = group_advantages(rewards, "mean", "std")
    assert adv[0, 0] / adv[1, 0] < grpo[0, 0] / grpo[1, 0]


def test_bnpo_refuses_rewards_outside_zero_one_and_a_missing_baseline():
    with pytest.raises(ValueError, match=r"needs rewards in \[0, 1\]"):
        group_advantages(torch.tensor([[1.5, 0.0], [0.0, 1.0]], dtype=torch.float64), "mean", "beta_density")
    with pytest.raises(ValidationError, match="needs baseline 'mean'"):
        get_algorithm("bnpo", baseline="none")
    with pytest.raises(ConfigError, match=r"normalizer 'beta_density'\) needs RL rewards in \{0, 1\}"):
        validate_config({"algorithm": {"name": "bnpo"}, "reward": {"truncation_penalty": 0.5}})


# ---- INTELLECT-2's two-sided clip ------------------------------------------------------------------------------
@pytest.mark.parametrize("weight", ["clip", "gspo"])
def test_two_sided_clip_matches_the_reference_where_it_binds(weight):
    spec = AlgorithmSpec(name="t", weight=weight, eps_low=0.2, eps_high=0.2, clip_delta=1.5)
    for seed in range(3):
        assert_matches_reference(spec, seed=seed, spread=0.8)
    logp, old, adv, mask, _ = make_batch(0, spread=0.3)
    i = int(torch.nonzero(adv < 0)[0])
    logp[i] = logp[i] + mask[i]  # a negative-advantage sequence far above its old policy: w, s = e > delta
    loss, grad, _ = impl_loss_and_grad(spec, logp, old, adv, mask)
    want, want_grad = ref_loss_and_grad(spec, logp, old, adv, mask)
    torch.testing.assert_close(loss, want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, want_grad, rtol=1e-10, atol=1e-12)
    with_delta = loss
    without, _, _ = impl_loss_and_grad(spec.override(clip_delta=None), logp, old, adv, mask)
    assert not torch.allclose(with_delta, without), "the cap binds on some negative-advantage tokens"


def test_two_sided_clip_caps_the_loss_and_stops_the_gradient_of_huge_ratios():
    """A < 0, w > delta: the token's loss is -delta * A (bounded), its gradient 0; A > 0 is untouched."""
    spec = PRESETS["intellect2"]
    mask = torch.ones(2, 1, dtype=torch.float64)
    old = torch.zeros(2, 1, dtype=torch.float64)
    logp = torch.full((2, 1), math.log(10.0), dtype=torch.float64)  # w = 10 > delta = 4
    adv = torch.tensor([-1.0, 1.0], dtype=torch.float64)
    loss, grad, _ = impl_loss_and_grad(spec, logp, old, adv, mask)
    assert loss.item() == pytest.approx((4.0 - 1.2) / 2)  # sequence mean of -(4 * -1) and -(1.2 * 1)
    assert grad.abs().sum() == 0
    plain, plain_grad, _ = impl_loss_and_grad(PRESETS["grpo"], logp, old, adv, mask)
    assert plain.item() == pytest.approx((10.0 - 1.2) / 2) and plain_grad[0, 0] != 0  # unbounded without it


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            {"weight": "cispo", "clip_delta": 4.0},
            "clip_delta 4 is read by weight clip or gspo only; weight cispo does not",
        ),
        ({"sapo_temperature_pos": 2.0}, "sapo_temperature_pos 2 is read by weight sapo only; weight clip does not"),
        ({"weight": "sapo", "vespo_k_neg": 1.0}, "vespo_k_neg 1 is read by weight vespo only; weight sapo does not"),
        ({"clip_delta": 1.1}, r"must exceed 1 \+ eps_high \(1.2\)"),
        ({"weight": "vespo", "rollout_correction": "sequence_mask"}, "weight vespo folds"),
        ({"clip_delta": 0.5}, "clip_delta: Input should be greater than 1"),
        ({"sapo_temperature_neg": 0.0}, "sapo_temperature_neg: Input should be greater than 0"),
    ],
)
def test_bad_combinations_are_refused_in_one_line(overrides, message):
    with pytest.raises(ValidationError) as err:
        get_algorithm("grpo", **overrides)
    lines = describe_validation_error(err.value)
    assert len(lines) == 1 and re.search(message, lines[0]), lines


def test_bad_combinations_are_refused_in_one_line_by_the_cli(capsys):
    from grpolab.commands.cli import main

    assert main(["demo", "--algo", "intellect2", "--algorithm.clip_delta", "1.1", "--steps", "1"]) != 0
    errors = [line for line in capsys.readouterr().out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "clip_delta 1.1 must exceed 1 + eps_high" in errors[0], errors


# ---- SAPO ------------------------------------------------------------------------------------------------------
def test_sapo_gate_is_the_policy_gradient_at_ratio_one_and_fades_smoothly():
    logp, _, adv, mask, _ = make_batch(1)
    spec = PRESETS["sapo"]
    _, on_policy, _ = impl_loss_and_grad(spec, logp, logp.clone(), adv, mask)
    _, grpo, _ = impl_loss_and_grad(PRESETS["grpo"], logp, logp.clone(), adv, mask)
    torch.testing.assert_close(on_policy, grpo, rtol=1e-12, atol=1e-15)
    # off-policy: each token's gradient is A * 4 s (1 - s) * w * dlogp / (|o| n), s = sigmoid(tau (w - 1))
    old = logp - torch.randn(logp.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64) * 0.7
    _, grad, metrics = impl_loss_and_grad(spec, logp, old, adv, mask)
    w = torch.exp(logp - old)
    tau = torch.where(adv[:, None] > 0, torch.tensor(1.0, dtype=torch.float64), torch.tensor(1.05, dtype=torch.float64))
    s = torch.sigmoid(tau * (w - 1))
    want = -adv[:, None] * 4 * s * (1 - s) * w * mask / mask.sum(1, keepdim=True) / mask.shape[0]
    torch.testing.assert_close(grad, want, rtol=1e-10, atol=1e-14)
    assert metrics.means()["clip_frac"] == 0.0  # a gate, not a clip


# ---- VESPO -----------------------------------------------------------------------------------------------------
def test_vespo_weight_is_one_at_ratio_one_and_peaks_at_k_over_lambda():
    mask = torch.ones(1, 4, dtype=torch.float64)
    adv = torch.tensor([[1.0]], dtype=torch.float64)
    at = lambda log_w: float(vespo_phi(torch.full((1, 4), log_w / 4, dtype=torch.float64), mask, adv, 2, 3, 3, 2))  # noqa: E731
    assert at(0.0) == pytest.approx(1.0, abs=1e-15)
    peak = math.log(2 / 3)  # argmax of W^k e^(-lam W) is W = k / lam
    assert at(peak) > at(peak + 0.05) and at(peak) > at(peak - 0.05)
    assert at(peak) == pytest.approx(math.exp(3) * (2 / 3) ** 2 * math.exp(-2))
    # the sequence's ratio is the product of its token ratios (not GSPO's geometric mean)
    assert at(math.log(2.0)) == pytest.approx(math.exp(3) * 4 * math.exp(-6))


def test_vespo_on_policy_is_reinforce_and_its_weight_carries_no_gradient():
    logp, _, adv, mask, _ = make_batch(4)
    spec = PRESETS["vespo"]
    _, grad, _ = impl_loss_and_grad(spec, logp, logp.clone(), adv, mask)
    torch.testing.assert_close(grad, -adv[:, None] * mask / mask.sum(), rtol=1e-12, atol=1e-15)


def test_vespo_folds_the_truncated_rollout_weight_into_its_sequence_ratio():
    """With token_truncate: W = prod_t (pi / pi_old) * min(pi_old / pi_engine, upper); the loss is not multiplied
    by the weight again (TRL's way; checked against TRL in test_objectives_trl.py)."""
    logp, old, adv, mask, _ = make_batch(5, spread=0.1)
    engine = old + torch.randn(old.shape, generator=torch.Generator().manual_seed(6), dtype=torch.float64) * 0.1
    spec = PRESETS["vespo"].override(rollout_correction="token_truncate", rollout_correction_upper=1.05)
    leaf = logp.clone().requires_grad_(True)
    loss, _ = policy_loss(
        PolicyLossInput(leaf, old, adv, mask, engine_logprobs=engine), spec, step_denominators(spec, mask, 12)
    )
    loss.backward()
    total = torch.zeros((), dtype=torch.float64)
    for i in range(mask.shape[0]):
        on = mask[i].bool()
        corr = torch.exp(old[i, on] - engine[i, on]).clamp(max=1.05)
        big_w = float(torch.exp((logp[i, on] - old[i, on]).sum()) * corr.prod())
        k, lam = (2.0, 3.0) if adv[i] >= 0 else (3.0, 2.0)
        phi = math.exp(lam) * big_w**k * math.exp(-lam * big_w)
        total = total - phi * adv[i] * logp[i, on].sum()
    torch.testing.assert_close(loss.detach(), total / mask.sum(), rtol=1e-10, atol=1e-14)


# ---- LUSPO -----------------------------------------------------------------------------------------------------
def test_luspo_is_gspo_with_each_sequence_loss_times_its_length():
    logp, old, adv, mask, _ = make_batch(7, spread=3e-4)
    luspo, luspo_grad, _ = impl_loss_and_grad(PRESETS["luspo"], logp, old, adv, mask)
    gspo = PRESETS["gspo"]
    lengths = mask.sum(1)
    scaled = adv * lengths  # GSPO's sequence loss is linear in A for a fixed clip decision: A -> A * |o|
    same_clip, same_grad, _ = impl_loss_and_grad(gspo, logp, old, scaled, mask)
    torch.testing.assert_close(luspo, same_clip, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(luspo_grad, same_grad, rtol=1e-12, atol=1e-15)
    plain, _, _ = impl_loss_and_grad(gspo, logp, old, adv, mask)
    assert not torch.allclose(luspo, plain)


# ---- every new preset: exact under any micro-batch split, listed with its formula -------------------------------
def test_vespo_with_a_rollout_correction_keeps_the_micro_batch_split_exact():
    spec = PRESETS["vespo"].override(rollout_correction="token_truncate", rollout_correction_upper=1.05, beta=0.03)
    policy = ToyPolicy(12, 9, seed=8)
    data = make_data(policy, 8, groups=3, group_size=4, spec=spec)
    g = torch.Generator().manual_seed(9)
    data.engine_logprobs = (
        data.old_logprobs + torch.randn(data.old_logprobs.shape, generator=g, dtype=torch.float64) * 0.1
    )
    whole, _ = step_grad(spec.override(prune_zero_advantage=False), data, policy, micro=12)
    for micro in (1, 5):
        split, _ = step_grad(spec, data, policy, micro)
        torch.testing.assert_close(split, whole, rtol=1e-10, atol=1e-13)


def test_the_formulas_say_the_new_terms(capsys):
    from grpolab.commands.cli import main

    assert "min(min(w, delta)*A" in PRESETS["intellect2"].formula()
    assert "Beta(p; a, b) density" in PRESETS["bnpo"].formula()
    assert "mean_i( sum_t l*m )" in PRESETS["luspo"].formula()
    assert "sigmoid(tau*(w-1))" in PRESETS["sapo"].formula()
    assert "W = prod_t w" in PRESETS["vespo"].formula()
    assert PRESETS["sapo"].formula() == PRESETS["sapo"].override(sapo_temperature_pos=2.0).formula()
    main(["algorithms"])
    text = capsys.readouterr().out
    for name in NEW:
        assert f"\n{name} " in text, name
