"""Group advantages against the float64 reference and their invariants."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import reference_advantages

from grpolab.objectives.advantages import advantage_metrics, group_advantages, informative_groups

COMBOS = [("mean", "std"), ("mean", "mean"), ("mean", "none"), ("none", "none"), ("none", "std")]


@pytest.mark.parametrize("baseline,normalizer", COMBOS)
def test_matches_reference(baseline, normalizer):
    g = torch.Generator().manual_seed(0)
    rewards = torch.rand(5, 8, generator=g, dtype=torch.float64).round(decimals=1)
    rewards[1] = 0.5  # an all-equal group
    rewards[2, :3] = 0.0  # MaxRL takes partial credit (rewards >= 0); a group of mean 0 gets 0
    rewards[3] = 0.0
    got = group_advantages(rewards, baseline, normalizer)
    want = torch.tensor(reference_advantages(rewards.tolist(), baseline, normalizer), dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("normalizer", ["std", "mean", "none"])
def test_all_equal_group_gets_exactly_zero(normalizer):
    level = 0.1
    rewards = torch.tensor([[level] * 7, [1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    adv = group_advantages(rewards, "mean", normalizer)
    assert (adv[0] == 0).all()
    assert (adv[1] != 0).all()
    assert informative_groups(rewards).tolist() == [False, True]


def test_maxrl_advantage_is_centered_over_mean_and_zero_when_mean_is_zero():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0]], dtype=torch.float64)
    adv = group_advantages(rewards, "mean", "mean", eps=1e-6)
    torch.testing.assert_close(adv[0], (rewards[0] - 0.25) / (0.25 + 1e-6))
    assert (adv[1] == 0).all()
    torch.testing.assert_close(adv[2], (rewards[2] - 0.75) / (0.75 + 1e-6))


def test_std_is_unbiased():
    rewards = torch.tensor([[1.0, 0.0]], dtype=torch.float64)
    adv = group_advantages(rewards, "mean", "std", eps=0.0)
    # unbiased std of {1, 0} is sqrt(0.5); (1 - 0.5) / sqrt(0.5) = sqrt(0.5)
    torch.testing.assert_close(adv, torch.tensor([[0.5**0.5, -(0.5**0.5)]], dtype=torch.float64))


def test_std_needs_two_samples_and_rewards_must_be_2d():
    with pytest.raises(ValueError, match="group size"):
        group_advantages(torch.ones(3, 1), "mean", "std")
    with pytest.raises(ValueError, match=r"\[B, G\]"):
        group_advantages(torch.ones(8), "mean", "std")


def test_metrics_count_zero_advantage_groups():
    rewards = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    m = advantage_metrics(rewards, group_advantages(rewards, "mean", "std"))
    assert m["zero_advantage_group_frac"] == 0.5 and m["reward_mean"] == 0.75


@settings(max_examples=60, deadline=None)
@given(
    b=st.integers(1, 5),
    g=st.integers(2, 9),
    seed=st.integers(0, 10_000),
    combo=st.sampled_from(COMBOS),
    levels=st.integers(1, 4),
)
def test_property_reference_and_finiteness(b, g, seed, combo, levels):
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.randint(0, levels + 1, (b, g), generator=gen).double() / levels
    adv = group_advantages(rewards, *combo)
    assert torch.isfinite(adv).all()
    want = torch.tensor(reference_advantages(rewards.tolist(), *combo), dtype=torch.float64)
    torch.testing.assert_close(adv, want, rtol=1e-9, atol=1e-9)
