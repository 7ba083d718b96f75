"""The report's statistics against independent recomputations written from the formulas."""

from __future__ import annotations

from itertools import combinations
from math import comb

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats as scipy_stats

from grpolab.objectives.stats import (
    contrast_bootstrap,
    holm,
    interaction,
    mcnemar_exact,
    mean_interval,
    paired_difference,
    pass_at_k_curve,
    seed_summary,
)

MC_TOLERANCE = 0.012  # Monte-Carlo error of a 95% percentile endpoint at 10,000 resamples, with room


def bootstrap_reference(per_item: np.ndarray, resamples: int = 10_000, seed: int = 123) -> tuple[float, float]:
    """Percentile bootstrap of a mean, from the definition: resample items with replacement, take the
    2.5th and 97.5th percentiles of the resampled means."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(per_item), size=(resamples, len(per_item)))
    means = per_item[idx].mean(axis=1)
    return float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def correlated_pair(n: int = 300, flips: int = 30, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    a = (rng.random(n) < 0.6).astype(float)
    b = a.copy()
    flipped = rng.choice(n, flips, replace=False)
    b[flipped] = 1 - b[flipped]
    return a, b


def test_paired_bootstrap_matches_the_definition_and_is_paired():
    a, b = correlated_pair()
    got = paired_difference(a, b)
    assert got.estimate == pytest.approx(np.mean(a - b), abs=1e-15)
    low, high = bootstrap_reference(a - b)
    assert got.low == pytest.approx(low, abs=MC_TOLERANCE) and got.high == pytest.approx(high, abs=MC_TOLERANCE)
    # resampling the two runs independently (unpaired) would give a far wider interval for correlated runs
    rng = np.random.default_rng(1)
    unpaired = a[rng.integers(0, len(a), (10_000, len(a)))].mean(1) - b[rng.integers(0, len(b), (10_000, len(b)))].mean(
        1
    )
    assert got.high - got.low < 0.6 * (np.percentile(unpaired, 97.5) - np.percentile(unpaired, 2.5))
    assert paired_difference(a, b) == got  # a fixed seed: the same interval every time


def test_mean_interval_and_seed_summary_match_the_definition():
    rng = np.random.default_rng(5)
    x = (rng.random(500) < 0.3).astype(float)
    got = mean_interval(x)
    low, high = bootstrap_reference(x)
    assert got.estimate == pytest.approx(x.mean()) and got.low == pytest.approx(low, abs=MC_TOLERANCE)
    assert got.high == pytest.approx(high, abs=MC_TOLERANCE)
    values = [0.91, 0.95, 0.97, 0.89]
    s = seed_summary(values)
    assert s.n == 4 and s.mean == pytest.approx(sum(values) / 4)
    assert s.std == pytest.approx((sum((v - s.mean) ** 2 for v in values) / 3) ** 0.5)
    low, high = bootstrap_reference(np.array(values))
    assert s.interval.low == pytest.approx(low, abs=MC_TOLERANCE) and s.interval.high == pytest.approx(
        high, abs=MC_TOLERANCE
    )
    half = scipy_stats.t.ppf(0.975, df=3) * s.std / 4**0.5  # mean +- t_{0.975, n-1} * s / sqrt(n)
    assert (s.t_low, s.t_high) == pytest.approx((s.mean - half, s.mean + half), abs=1e-12)
    assert s.t_low < s.interval.low and s.t_high > s.interval.high  # with 4 seeds the bootstrap is the narrower


def test_interaction_is_the_per_item_double_difference_with_its_bootstrap():
    rng = np.random.default_rng(2)
    cells = [(rng.random(400) < p).astype(float) for p in (0.5, 0.55, 0.6, 0.9)]
    y00, y01, y10, y11 = cells
    got = interaction(y00, y01, y10, y11)
    contrast = (y11 - y01) - (y10 - y00)
    assert got.estimate == pytest.approx(contrast.mean(), abs=1e-15)
    low, high = bootstrap_reference(contrast)
    assert got.low == pytest.approx(low, abs=MC_TOLERANCE) and got.high == pytest.approx(high, abs=MC_TOLERANCE)


def test_no_spread_gives_a_zero_width_interval():
    a = np.ones(50)
    assert paired_difference(a, a).low == paired_difference(a, a).high == 0.0
    assert mean_interval(np.array([1.0])).low == 1.0


def mcnemar_reference(only_a: int, only_b: int) -> float:
    """Exact two-sided McNemar: p = min(1, 2 * P(X <= min(b, c))), X ~ Binomial(b + c, 1/2)."""
    n = only_a + only_b
    if n == 0:
        return 1.0
    return min(1.0, 2 * sum(comb(n, i) for i in range(min(only_a, only_b) + 1)) / 2**n)


@pytest.mark.parametrize("only_a,only_b", [(10, 2), (0, 7), (5, 5), (1, 0), (0, 0), (40, 25), (3, 12)])
def test_mcnemar_exact_p_values_match_the_binomial_formula(only_a, only_b):
    both, neither = 17, 9
    a = np.array([1] * only_a + [0] * only_b + [1] * both + [0] * neither)
    b = np.array([0] * only_a + [1] * only_b + [1] * both + [0] * neither)
    got = mcnemar_exact(a, b)
    assert (got.only_a, got.only_b) == (only_a, only_b)
    assert got.p_value == pytest.approx(mcnemar_reference(only_a, only_b), rel=1e-12)


def test_mcnemar_known_value():
    a = np.array([1] * 10 + [0] * 2)
    assert mcnemar_exact(a, 1 - a).p_value == pytest.approx(0.03857421875)  # 2 * 79 / 4096


def pass_at_k_brute(n: int, c: int, k: int) -> float:
    """Fraction of the k-subsets of n samples (c of them correct) that hold a correct one."""
    samples = [1] * c + [0] * (n - c)
    subsets = list(combinations(range(n), k))
    return sum(any(samples[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", [1, 4, 6, 8])
def test_pass_at_k_curve_matches_brute_force_and_stops_at_n(n):
    correct = [0, 1, n // 2, n, max(0, n - 1)]
    curve = pass_at_k_curve(n, correct)
    assert max(curve) == n and all(k == n or k & (k - 1) == 0 for k in curve)
    for k, value in curve.items():
        assert value == pytest.approx(np.mean([pass_at_k_brute(n, c, k) for c in correct]), abs=1e-12)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.booleans()), min_size=2, max_size=60), st.integers(0, 2**16))
def test_intervals_hold_their_estimate_and_p_values_are_probabilities(pairs, seed):
    a = np.array([p[0] for p in pairs], dtype=float)
    b = np.array([p[1] for p in pairs], dtype=float)
    got = contrast_bootstrap([a, b], (1.0, -1.0), resamples=10_000, seed=seed)
    assert -1.0 <= got.low <= got.estimate + 1e-12 and got.estimate - 1e-12 <= got.high <= 1.0
    assert 0.0 <= mcnemar_exact(a, b).p_value <= 1.0


def holm_rejects(p_values: list[float], alpha: float) -> set[int]:
    """Holm's step-down procedure: walk the p-values from the smallest; reject while (m - i) * p_(i) <= alpha."""
    rejected = set()
    for i, k in enumerate(sorted(range(len(p_values)), key=lambda k: p_values[k])):
        if p_values[k] * (len(p_values) - i) > alpha:
            break
        rejected.add(k)
    return rejected


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(0.0, 1.0), min_size=1, max_size=12))
def test_holm_adjusted_p_values_reject_exactly_as_the_step_down_procedure(p_values):
    adjusted = holm(p_values)
    assert all(a >= p for a, p in zip(adjusted, p_values)) and max(adjusted) <= 1.0
    for alpha in (0.01, 0.05, 0.1, 0.3):
        assert {k for k, a in enumerate(adjusted) if a <= alpha} == holm_rejects(p_values, alpha)
