"""Anytime-valid confidence sequences for bounded means, by betting (pure numpy functions).

Waudby-Smith and Ramdas (2024), "Estimating means of bounded random variables by betting", JRSS B 86(1),
section 4 (the hedged capital process, their Theorem 3) with the predictable plug-in bets of their eq. (26):
for observations X_1, X_2,  in [0, 1] with conditional mean m (the same m at every time),

    mu_t      = (1/2 + sum_{i<=t} X_i) / (t + 1)                    mu_0 = 1/2
    sigma2_t  = (1/4 + sum_{i<=t} (X_i - mu_i)^2) / (t + 1)         sigma2_0 = 1/4
    lambda_t  = min( sqrt(2 log(2 / alpha) / (sigma2_{t-1} t log(1 + t))), c )      (predictable: time t-1)
    K+_t(m)   = prod_{i<=t} (1 + min(lambda_i, c / m) (X_i - m))
    K-_t(m)   = prod_{i<=t} (1 - min(lambda_i, c / (1 - m)) (X_i - m))
    K_t(m)    = max( theta K+_t(m), (1 - theta) K-_t(m) )
    C_t       = { m in [0, 1] : K_t(m) < 1 / alpha }

K_t(m*) at the true mean m* is a nonnegative supermartingale with K_0 = 1 (a mixture of two test martingales),
so by Ville's inequality P(exists t: K_t(m*) >= 1 / alpha) <= alpha: C_t covers m* at every time at once, however
often one looks and whenever one stops (that is what "anytime-valid" means, and why peeking is allowed). The
bets need no variance assumption, only the bounds. C_t is an interval (K_t is quasiconvex in m); it is computed on
a grid of m and widened by one grid step on each side, so the discretisation only makes it wider. The running
intersection of C_1 .. C_t is valid too and is what ``betting_cs`` returns.

A paired accuracy difference D in [-1, 1] enters as X = (D + 1) / 2 (``paired_difference_cs``). For several arms at
once the error rate is split between them (``alpha / arms``, Bonferroni: the union bound holds for confidence
sequences as for intervals).

The bounds alone limit how fast a betting sequence can close: a bet must keep the capital nonnegative for any
value in the range (lambda <= c / m or c / (1 - m)). At m = 1/2 (a paired difference of 0) each observation
multiplies it by at most 1 + c, so with Bonferroni over five comparisons at alpha 0.05 (1 / alpha' = 100)
even differences of -1 every time need 14 observations to exclude 0 (c = 1/2), 8 with c = 1. When the unit of replication is a seed and seeds are few, ``normal_mixture_cs``
is the other construction: Robbins' (1970) normal mixture ("Statistical methods related to the law of the
iterated logarithm", Ann. Math. Statist. 41(5)), the conjugate mixture of Howard, Ramdas, McAuliffe and Sekhon
(2021), "Time-uniform, nonparametric, nonasymptotic confidence sequences", Ann. Statist. 49(2), for observations
whose deviations from the mean are sub-Gaussian with a STATED variance proxy sd^2 (given the past):

    S_t       = sum_{i<=t} (X_i - m),  V_t = t sd^2
    M_t(m)    = sqrt(rho / (V_t + rho)) exp(S_t^2 / (2 (V_t + rho)))      (the N(0, 1/rho) mixture of
                                                                        exp(l S_t - l^2 V_t / 2) over l)
    C_t       = { m : M_t(m) < 1 / alpha } = mean_t +- sqrt((V_t + rho) log((V_t + rho) / (rho alpha^2))) / t

M_t(m*) is a nonnegative supermartingale with M_0 = 1, so Ville's inequality gives the same guarantee at every
time at once; it is two-sided as written. Its validity rests on sd: a per-seed difference that spreads more
than stated breaks it (``benchmarks/sequential_peeking.py`` shows by how much), which is why the decision mode
checks the observed spread against the stated one.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["SEQUENCES", "betting_cs", "normal_mixture_cs", "paired_difference_cs", "predictable_bets"]

BET_CAP = 0.5  # c: the largest fraction of capital bet (the paper's default choice, c = 1/2 or 3/4)
GRID = 1001  # points of m in [0, 1]


def predictable_bets(x: np.ndarray, alpha: float, cap: float = BET_CAP) -> np.ndarray:
    """The predictable plug-in bets lambda_1 .. lambda_T [T] for observations ``x`` [T] in [0, 1] (module formula):
    lambda_t uses only X_1 .. X_{t-1}."""
    x = np.asarray(x, dtype=np.float64)
    t = np.arange(1, len(x) + 1, dtype=np.float64)
    mu = (0.5 + np.cumsum(x)) / (t + 1)  # mu_1 .. mu_T
    sigma2 = (0.25 + np.cumsum((x - mu) ** 2)) / (t + 1)  # sigma2_1 .. sigma2_T
    previous = np.concatenate([[0.25], sigma2[:-1]])  # sigma2_0 .. sigma2_{T-1}
    return np.minimum(np.sqrt(2 * math.log(2 / alpha) / (previous * t * np.log1p(t))), cap)


def betting_cs(
    x: np.ndarray, alpha: float, theta: float = 0.5, cap: float = BET_CAP, grid: int = GRID
) -> tuple[np.ndarray, np.ndarray]:
    """(lower [T], upper [T]): the running intersection of the hedged-capital confidence sequence for the mean of
    ``x`` [T] in [0, 1] at level 1 - ``alpha``, after each observation (module docstring). float64."""
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 1 or len(x) == 0:
        raise ValueError("x must be a non-empty 1-d sequence")
    if ((x < 0) | (x > 1)).any():
        raise ValueError("observations must lie in [0, 1]")
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    m = np.linspace(0.0, 1.0, grid)  # [G]
    bets = predictable_bets(x, alpha, cap)[:, None]  # [T, 1]
    with np.errstate(divide="ignore"):  # c / 0 = inf: at m = 0 (m = 1) the bet is lambda itself
        plus = np.minimum(bets, cap / m)  # [T, G]
        minus = np.minimum(bets, cap / (1 - m))
    moved = x[:, None] - m  # [T, G]
    log_plus = np.cumsum(np.log1p(plus * moved), axis=0)
    log_minus = np.cumsum(np.log1p(-minus * moved), axis=0)
    log_capital = np.maximum(math.log(theta) + log_plus, math.log(1 - theta) + log_minus)
    inside = log_capital < math.log(1 / alpha)  # [T, G]
    step = 1.0 / (grid - 1)
    any_inside = inside.any(axis=1)
    first = np.where(any_inside, inside.argmax(axis=1), grid)
    last = np.where(any_inside, grid - 1 - inside[:, ::-1].argmax(axis=1), -1)
    lower = np.clip(m[np.clip(first, 0, grid - 1)] - step, 0.0, 1.0)
    upper = np.clip(m[np.clip(last, 0, grid - 1)] + step, 0.0, 1.0)
    lower = np.where(any_inside, lower, np.nan)
    upper = np.where(any_inside, upper, np.nan)
    return np.fmax.accumulate(lower), np.fmin.accumulate(upper)


def paired_difference_cs(
    differences: np.ndarray, alpha: float, arms: int = 1, **options
) -> tuple[np.ndarray, np.ndarray]:
    """(lower [T], upper [T]) for the mean of paired differences ``differences`` [T] in [-1, 1] (e.g. an arm's
    accuracy minus the baseline's on the same items and seed), at level 1 - alpha / ``arms`` (Bonferroni over the
    arms compared at once). ``options``: those of ``betting_cs``."""
    d = np.asarray(differences, dtype=np.float64)
    if ((d < -1) | (d > 1)).any():
        raise ValueError("paired differences must lie in [-1, 1]")
    lower, upper = betting_cs((d + 1) / 2, alpha / arms, **options)
    return 2 * lower - 1, 2 * upper - 1


def normal_mixture_cs(
    x: np.ndarray, alpha: float, sd: float, rho: float | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(lower [T], upper [T]): the running intersection of the two-sided normal-mixture confidence sequence for the
    mean of ``x`` [T] whose deviations are sub-Gaussian with variance proxy ``sd`` ** 2 (module docstring), at level
    1 - ``alpha``. ``rho`` (default sd ** 2: the mixture is tightest near the first observation). float64."""
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 1 or len(x) == 0:
        raise ValueError("x must be a non-empty 1-d sequence")
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    if not sd > 0:
        raise ValueError(f"sd must be positive, got {sd}")
    rho = sd**2 if rho is None else rho
    t = np.arange(1, len(x) + 1, dtype=np.float64)
    v = t * sd**2 + rho
    radius = np.sqrt(v * np.log(v / (rho * alpha**2))) / t
    mean = np.cumsum(x) / t
    return np.fmax.accumulate(mean - radius), np.fmin.accumulate(mean + radius)


def paired_normal_cs(
    differences: np.ndarray, alpha: float, arms: int = 1, sd: float | None = None, **options
) -> tuple[np.ndarray, np.ndarray]:
    """``normal_mixture_cs`` of paired differences [T] in [-1, 1] at level 1 - alpha / ``arms``, clipped to
    [-1, 1]; ``sd``: the stated spread of one difference (required)."""
    if sd is None:
        raise ValueError("the normal sequence needs the stated sd of one paired difference")
    lower, upper = normal_mixture_cs(np.asarray(differences, dtype=np.float64), alpha / arms, sd, **options)
    return np.clip(lower, -1, 1), np.clip(upper, -1, 1)


SEQUENCES = {"betting": paired_difference_cs, "normal": paired_normal_cs}
"""Confidence sequences for a mean paired difference, by name: each ``(differences [T], alpha, arms, **options)
-> (lower [T], upper [T])``. betting: no assumption but the bounds; normal: a stated sd."""
