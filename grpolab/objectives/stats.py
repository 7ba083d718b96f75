"""Statistics as pure functions over per-item or per-seed arrays (numpy; scipy imported where used, so
that training, which needs only ``pass_at_k``, does not load it).

Item-level intervals resample the frozen evaluation items (paired: the same resampled items for every
run compared), so they measure how much the difference could move with another draw of items from
the same distribution. They do not cover training-seed variance: that needs several seeds
(``seed_summary``).
"""

from __future__ import annotations

from dataclasses import dataclass
from math import comb

import numpy as np

RESAMPLES = 10_000
CONFIDENCE = 0.95


@dataclass(frozen=True)
class Interval:
    """A point estimate with its percentile-bootstrap interval."""

    estimate: float
    low: float
    high: float


def _mean_of_contrast(weights: tuple[float, ...]):
    """statistic(*samples, axis) = mean over items of sum_j weights[j] * samples[j]."""

    def statistic(*samples: np.ndarray, axis: int = -1) -> np.ndarray:
        return np.mean(sum(w * s for w, s in zip(weights, samples)), axis=axis)

    return statistic


def contrast_bootstrap(
    samples: list[np.ndarray],
    weights: tuple[float, ...],
    resamples: int = RESAMPLES,
    seed: int = 0,
    confidence: float = CONFIDENCE,
) -> Interval:
    """Mean over items of ``sum_j weights[j] * samples[j][i]`` with a paired percentile-bootstrap CI.

    samples: J arrays of shape [items], aligned item by item; the items are resampled together
    (``scipy.stats.bootstrap(paired=True)``) with a fixed seed. One array and weights (1,) is a
    plain mean; two and (1, -1) a paired difference; four and (1, -1, -1, 1) a 2x2 interaction.
    """
    from scipy import stats

    arrays = [np.asarray(s, dtype=np.float64) for s in samples]
    statistic = _mean_of_contrast(weights)
    estimate = float(statistic(*arrays))
    if len(arrays[0]) < 2 or np.all(sum(w * s for w, s in zip(weights, arrays)) == estimate):
        return Interval(estimate, estimate, estimate)  # no spread: every resample gives the estimate
    result = stats.bootstrap(
        tuple(arrays),
        statistic,
        n_resamples=resamples,
        paired=True,
        vectorized=True,
        confidence_level=confidence,
        method="percentile",
        rng=np.random.default_rng(seed),
    )
    return Interval(estimate, float(result.confidence_interval.low), float(result.confidence_interval.high))


def paired_difference(a: np.ndarray, b: np.ndarray, resamples: int = RESAMPLES, seed: int = 0) -> Interval:
    """mean(a - b) over paired items [items] with its bootstrap CI."""
    return contrast_bootstrap([a, b], (1.0, -1.0), resamples, seed)


def mean_interval(x: np.ndarray, resamples: int = RESAMPLES, seed: int = 0) -> Interval:
    """mean(x) over items [items] with its bootstrap CI."""
    return contrast_bootstrap([x], (1.0,), resamples, seed)


def interaction(
    y00: np.ndarray, y01: np.ndarray, y10: np.ndarray, y11: np.ndarray, resamples: int = RESAMPLES, seed: int = 0
) -> Interval:
    """The 2x2 interaction (y11 - y01) - (y10 - y00) over paired items: how much more the second
    factor's change helps when the first factor is changed too (0 = the effects add up)."""
    return contrast_bootstrap([y00, y01, y10, y11], (1.0, -1.0, -1.0, 1.0), resamples, seed)


@dataclass(frozen=True)
class McNemar:
    """Discordant pairs (only_a: a right and b wrong; only_b: the reverse) and the exact two-sided p."""

    only_a: int
    only_b: int
    p_value: float


def mcnemar_exact(a: np.ndarray, b: np.ndarray) -> McNemar:
    """Exact McNemar test of paired binary outcomes a, b [items]: under H0 the discordant pairs split
    Binomial(only_a + only_b, 1/2); p is the two-sided exact binomial p-value (1 with no discordance)."""
    from scipy import stats

    a, b = np.asarray(a, dtype=bool), np.asarray(b, dtype=bool)
    only_a, only_b = int(np.sum(a & ~b)), int(np.sum(~a & b))
    n = only_a + only_b
    p = 1.0 if n == 0 else float(stats.binomtest(only_a, n, 0.5).pvalue)
    return McNemar(only_a, only_b, p)


@dataclass(frozen=True)
class SeedSummary:
    """Across training seeds: mean, sample std (ddof 1), a bootstrap CI over the seeds (never wider than
    their range, so it understates the uncertainty of a few seeds) and a Student-t CI (normal seeds)."""

    n: int
    mean: float
    std: float
    interval: Interval
    t_low: float
    t_high: float


def seed_summary(values: list[float], resamples: int = RESAMPLES, seed: int = 0) -> SeedSummary:
    """``values``: one final metric per training seed (>= 2)."""
    from scipy import stats

    x = np.asarray(values, dtype=np.float64)
    mean, std = float(x.mean()), float(x.std(ddof=1))
    if std == 0.0:
        t_low = t_high = mean
    else:
        t_low, t_high = stats.t.interval(CONFIDENCE, len(x) - 1, loc=mean, scale=std / np.sqrt(len(x)))
    return SeedSummary(len(x), mean, std, mean_interval(x, resamples, seed), float(t_low), float(t_high))


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct: 1 - C(n-c, k) / C(n, k) (Chen et al., 2021)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    return 1.0 - comb(n - c, k) / comb(n, k)


def pass_at_k_curve(n: int, correct: list[int], samples: list[int] | None = None) -> dict[int, float]:
    """Mean unbiased pass@k over items (``correct``: correct samples of n per item) for k = 1, 2, 4, ...
    up to n, n included. ``samples``: each item's own sample count where some failed (None: n each); pass@k is
    then over the items with at least k."""
    samples = samples if samples is not None else [n] * len(correct)
    if n < 1:  # no sample that did not fail: no curve
        return {}
    ks = sorted({2**i for i in range(n.bit_length()) if 2**i <= n} | {n})
    curve = {}
    for k in ks:
        estimates = [pass_at_k(m, c, k) for m, c in zip(samples, correct) if m >= k]
        curve[k] = float(np.mean(estimates)) if estimates else float("nan")
    return curve


def holm(p_values: list[float]) -> list[float]:
    """Holm-Bonferroni adjusted p-values, in the input order: the k-th smallest p becomes
    max over j <= k of min(1, (m - j + 1) * p_(j)), so adjusted p <= alpha exactly when Holm's step-down
    procedure rejects at family-wise error rate alpha."""
    m = len(p_values)
    order = np.argsort(p_values, kind="stable")
    adjusted = np.minimum(1.0, np.maximum.accumulate((m - np.arange(m)) * np.asarray(p_values, dtype=float)[order]))
    out = np.empty(m)
    out[order] = adjusted
    return [float(p) for p in out]
