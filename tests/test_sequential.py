"""Anytime-valid confidence sequences by betting (``grpolab.studies.sequential``): the hedged capital process
against a direct transcription of Waudby-Smith and Ramdas (2024)'s formulas in float64, coverage at every time at
once under peeking, and the paired-difference form."""

from __future__ import annotations

import math

import numpy as np
import pytest

from grpolab.studies.decision import OPEN, WITHIN, WORSE, Question, answered, compare, going_on, judge, spread_warnings
from grpolab.studies.sequential import (
    betting_cs,
    normal_mixture_cs,
    paired_difference_cs,
    paired_normal_cs,
    predictable_bets,
)


def transcribed_capital(x: list[float], m: float, alpha: float, theta: float = 0.5, c: float = 0.5) -> list[float]:
    """K_t(m) for t = 1..T, written out term by term from the paper's section 4 (eq. 26 bets, Theorem 3)."""
    capital, plus, minus, total, squares = [], 1.0, 1.0, 0.0, 0.0
    sigma2_previous = 0.25  # sigma2_0
    for t, xt in enumerate(x, start=1):
        bet = min(math.sqrt(2 * math.log(2 / alpha) / (sigma2_previous * t * math.log(1 + t))), c)
        bet_plus = bet if m == 0 else min(bet, c / m)
        bet_minus = bet if m == 1 else min(bet, c / (1 - m))
        plus *= 1 + bet_plus * (xt - m)
        minus *= 1 - bet_minus * (xt - m)
        capital.append(max(theta * plus, (1 - theta) * minus))
        total += xt
        mu_t = (0.5 + total) / (t + 1)
        squares += (xt - mu_t) ** 2
        sigma2_previous = (0.25 + squares) / (t + 1)
    return capital


def transcribed_bounds(x: list[float], alpha: float, grid: int) -> tuple[list[float], list[float]]:
    ms = [i / (grid - 1) for i in range(grid)]
    capitals = [transcribed_capital(x, m, alpha) for m in ms]
    lows, highs, low, high = [], [], 0.0, 1.0
    for t in range(len(x)):
        inside = [i for i, k in enumerate(capitals) if k[t] < 1 / alpha]
        low = max(low, max(ms[inside[0]] - 1 / (grid - 1), 0.0))
        high = min(high, min(ms[inside[-1]] + 1 / (grid - 1), 1.0))
        lows.append(low)
        highs.append(high)
    return lows, highs


def test_the_bounds_are_the_papers_formula_in_float64():
    x = np.random.default_rng(0).beta(2, 5, size=60)
    lower, upper = betting_cs(x, alpha=0.05, grid=101)
    want_lower, want_upper = transcribed_bounds(x.tolist(), 0.05, 101)
    np.testing.assert_allclose(lower, want_lower, rtol=0, atol=1e-12)
    np.testing.assert_allclose(upper, want_upper, rtol=0, atol=1e-12)
    assert lower.dtype == np.float64 and (lower <= x.mean()).all() and (upper >= x.mean()).all()
    # the bets: predictable (lambda_t reads X_1 .. X_{t-1} only), capped at c = 1/2
    bets = predictable_bets(x, 0.05)
    assert bets[0] == min(math.sqrt(2 * math.log(40) / (0.25 * 1 * math.log(2))), 0.5)
    changed = x.copy()
    changed[10] = 1 - changed[10]
    assert np.array_equal(predictable_bets(changed, 0.05)[:11], bets[:11]) and (bets <= 0.5).all()


def test_the_sequence_covers_the_mean_at_every_time_at_once_under_peeking():
    """500 Bernoulli(0.3) streams of 300 observations, the sequence looked at after every one: the share of
    streams whose sequence ever excludes 0.3 stays below alpha (Ville's inequality); a fixed-time 95% interval
    looked at after every observation excludes it far more often."""
    rng = np.random.default_rng(1)
    alpha, mean, streams, n = 0.05, 0.3, 500, 300
    missed_cs = missed_peeking = 0
    for _ in range(streams):
        x = (rng.random(n) < mean).astype(np.float64)
        lower, upper = betting_cs(x, alpha, grid=201)
        missed_cs += bool(((lower > mean) | (upper < mean)).any())
        t = np.arange(1, n + 1)
        running = np.cumsum(x) / t
        half = 1.96 * np.sqrt(np.maximum(running * (1 - running), 1e-12) / t)  # Wald, peeked at every t >= 10
        missed_peeking += bool((np.abs(running - mean)[9:] > half[9:]).any())
    assert missed_cs / streams <= alpha
    assert missed_peeking / streams > 3 * alpha


def test_the_sequence_shrinks_and_a_clear_difference_excludes_zero():
    rng = np.random.default_rng(2)
    d = np.clip(rng.normal(0.2, 0.3, size=400), -1, 1)
    lower, upper = paired_difference_cs(d, alpha=0.05, arms=3)
    assert (np.diff(lower) >= 0).all() and (np.diff(upper) <= 0).all()  # a running intersection
    assert upper[-1] - lower[-1] < 0.5 * (upper[19] - lower[19])
    assert lower[-1] > 0 and lower[-1] <= d.mean() <= upper[-1]
    wide, _ = paired_difference_cs(d, alpha=0.05, arms=1)
    assert wide[-1] >= lower[-1]  # three arms at once: each at alpha / 3, so wider


@pytest.mark.parametrize(
    "x, alpha, message",
    [([], 0.05, "non-empty"), ([0.5, 1.5], 0.05, r"\[0, 1\]"), ([0.5], 1.0, "alpha must be in")],
)
def test_bad_input_is_refused(x, alpha, message):
    with pytest.raises(ValueError, match=message):
        betting_cs(np.array(x, dtype=np.float64), alpha)
    with pytest.raises(ValueError, match=r"\[-1, 1\]"):
        paired_difference_cs(np.array([2.0]), 0.05)


def test_the_peeking_benchmark_runs_and_prints_both_errors_and_the_table(capsys):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import sequential_peeking

    sequential_peeking.main(["--suites", "20", "--bootstrap-suites", "5", "--power-suites", "2", "--rounds", "8"])
    out = capsys.readouterr().out
    assert "betting confidence sequence: family-wise error" in out and "bootstrap interval, peeked from round 5" in out
    assert "normal confidence sequence: family-wise error" in out and "spread twice its stated sd" in out
    rows = [line for line in out.splitlines() if line.startswith(("| betting |", "| normal |"))]
    assert len(rows) == 8  # two sequences x two deltas x two alphas


def transcribed_mixture(x: list[float], m: float, sd: float, rho: float) -> list[float]:
    """M_t(m) for t = 1..T: the N(0, 1/rho) mixture of exp(l S_t - l^2 V_t / 2) over l, integrated numerically
    (Robbins 1970), not through its closed form."""
    lam = np.linspace(-60 / sd, 60 / sd, 40001)
    weight = np.sqrt(rho / (2 * math.pi)) * np.exp(-rho * lam**2 / 2)
    out, s = [], 0.0
    for t, xt in enumerate(x, start=1):
        s += xt - m
        y = np.exp(lam * s - lam**2 * t * sd**2 / 2) * weight
        out.append(float(((y[1:] + y[:-1]) / 2 * np.diff(lam)).sum()))  # the trapezoid rule
    return out


def test_the_normal_mixture_is_robbins_mixture_in_float64():
    """Each bound is where the numerically integrated mixture reaches 1 / alpha (found by bisection), then
    intersected over time."""
    x = [0.31, 0.27, 0.35, 0.30, 0.12]
    sd, alpha = 0.05, 0.05

    def edge(t: int, side: float) -> float:
        mean = float(np.mean(x[:t]))
        inside, outside = mean, mean + side
        for _ in range(40):
            mid = (inside + outside) / 2
            if transcribed_mixture(x[:t], mid, sd, sd**2)[-1] < 1 / alpha:
                inside = mid
            else:
                outside = mid
        return (inside + outside) / 2

    want_lower = np.fmax.accumulate([edge(t, -1.0) for t in range(1, len(x) + 1)])
    want_upper = np.fmin.accumulate([edge(t, 1.0) for t in range(1, len(x) + 1)])
    lower, upper = normal_mixture_cs(np.array(x), alpha, sd)
    np.testing.assert_allclose(lower, want_lower, rtol=0, atol=1e-6)
    np.testing.assert_allclose(upper, want_upper, rtol=0, atol=1e-6)
    assert lower.dtype == np.float64 and upper[-1] < upper[-2]  # the fifth observation moved the interval down


def test_the_normal_mixture_covers_under_peeking_when_its_sd_holds_and_not_when_it_is_too_small():
    rng = np.random.default_rng(3)
    alpha, streams, n = 0.05, 2000, 50
    x = rng.normal(0.1, 0.05, size=(streams, n))

    def missed(sd: float) -> float:
        count = 0
        for row in x:
            lower, upper = normal_mixture_cs(row, alpha, sd)
            count += bool(((lower > 0.1) | (upper < 0.1)).any())
        return count / streams

    assert missed(0.05) <= alpha
    assert missed(0.02) > 3 * alpha  # a stated sd below the true spread breaks the guarantee


def test_after_one_seed_the_normal_sequence_decides_a_collapse_the_betting_one_cannot():
    d = np.array([-0.6])
    lower, upper = paired_normal_cs(d, 0.05, arms=5, sd=0.05)
    assert upper[0] < -0.05 and lower[0] >= -1
    lower, upper = paired_difference_cs(np.full(4, -0.6), 0.05, arms=5)
    assert upper[-1] > -0.05  # four seeds: the bounds alone cannot exclude -0.05
    with pytest.raises(ValueError, match="stated sd"):
        paired_normal_cs(d, 0.05)


def test_decisions_against_a_baseline_are_final_and_say_their_evidence():
    q = Question(("base", "bad", "same", "close"), "base", delta=0.05, alpha=0.05, sequence="normal", sd=0.03)
    diffs = {("bad", "base"): [-0.5], ("same", "base"): [0.01], ("close", "base"): [-0.08]}
    comparisons = compare(q, diffs)
    verdicts = judge(q, comparisons, 0)
    assert verdicts["bad"].status == WORSE and verdicts["bad"].round == 0
    assert "bad - base <=" in verdicts["bad"].evidence and "< -0.05" in verdicts["bad"].evidence
    assert verdicts["same"].status == OPEN and verdicts["close"].status == OPEN
    assert going_on(q, verdicts) == ["base", "same", "close"]
    more = {k: v * 30 for k, v in diffs.items()}  # thirty seeds alike
    later = judge(q, compare(q, more), 29, verdicts)
    assert later["bad"] == verdicts["bad"]  # decided once, kept
    assert later["same"].status == WITHIN and later["close"].status == WORSE and answered(later)
    assert going_on(q, later) == []


def test_find_the_best_compares_every_pair_and_keeps_the_leaders_running():
    q = Question(("a", "b", "c"), None, delta=0.05, alpha=0.05, sequence="normal", sd=0.02)
    assert q.comparisons() == [("a", "b"), ("a", "c"), ("b", "c")]
    verdicts = judge(q, compare(q, {("a", "b"): [0.01], ("a", "c"): [0.5], ("b", "c"): [0.49]}), 0)
    assert verdicts["c"].status == WORSE and "c - a <=" in verdicts["c"].evidence
    assert verdicts["a"].status == OPEN and going_on(q, verdicts) == ["a", "b"]


def test_a_spread_beyond_the_stated_sd_is_said():
    q = Question(("base", "x"), "base", delta=0.05, alpha=0.05, sequence="normal", sd=0.01)
    lines = spread_warnings(q, compare(q, {("x", "base"): [0.1, -0.1, 0.05]}))
    assert len(lines) == 1 and "more than the stated seed_sd 0.01" in lines[0]
    assert not spread_warnings(Question(("base", "x"), "base", 0.05, 0.05), compare(q, {("x", "base"): [0.1, -0.1]}))
