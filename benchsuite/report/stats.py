"""Statistics over repeats: the interval of a ratio between two configurations, its verdict, and the
false-discovery control of a table of such verdicts. Used by the report (ratios within a run) and by
`benchsuite compare` (changes between runs).

The unit is a repeat (one cell's value, e.g. its decode tok/s p50) or a whole run, never a request:
requests of one cell share that cell's machine state, so a test over requests measures within-cell
noise and calls every between-cell difference significant (two runs of one matrix on a busy 2-core
box then "differed" on 26 of 45 rows).

Method (a Welch t interval on log values):
- the ratio A / B is exp(mean(log a) - mean(log b)): the ratio of geometric means, so "A is 2 x B"
  and "B is 0.5 x A" are the same statement;
- its interval is exp(d -+ t(1 - alpha/2, df) * se), se^2 = var(log a)/n_a + var(log b)/n_b, df by
  Welch-Satterthwaite; p is the two-sided Welch t-test of d = 0.
Why not the others: pyperf compares with a Student t-test over values that each come from a separate
process (the level its noise lives at), which is this test on the same unit, but pooled-variance and
on raw values (a ratio is multiplicative, so logs; two engines' variances differ, so Welch). asv runs
Mann-Whitney U on raw samples only when there are enough of them for the test to reach its threshold,
else it checks whether 99% intervals overlap; with 2-5 repeats a side Mann-Whitney cannot reach
p < 0.05 at all (3 vs 3: smallest two-sided p = 0.1), and a percentile bootstrap over 2-5 values gives
intervals far narrower than their nominal coverage. The t interval widens honestly with few repeats
(2 a side: df ~ 2, t ~ 4.3). Fewer than MIN_REPEATS values on a side: no interval, "not enough repeats".

A table of verdicts is corrected with Benjamini-Hochberg at the same alpha: when nothing differs (an
A/A comparison) the chance that ANY row is flagged stays <= alpha however many rows there are.

The choices above are ours; the arithmetic is the libraries': math.log, numpy's mean and variance (ddof=1),
scipy's t distribution (ppf, sf) and scipy.stats.false_discovery_control (BH-adjusted p-values; a row
is a discovery when its adjusted p <= alpha, the step-up rule). Only the Welch-Satterthwaite df is
written here. scipy.stats.ttest_ind(equal_var=False) is the same test, but its variance (second
moment x n / (n - 1)) and interval (the lower t quantile at (1 - level) / 2) differ from these in the
last bits, which the report prints (its data attributes and tables.csv hold full precision), and it
warns on a side of identical repeats.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats as _scipy_stats

MIN_REPEATS = 2
"""Values a side the interval needs (a variance per side); fewer is 'not enough repeats'."""
DEFAULT_ALPHA = 0.05
NOT_ENOUGH = "not enough repeats"
SIGNIFICANT = "significant"
NOT_SIGNIFICANT = "not significant"


@dataclass(frozen=True)
class RatioEstimate:
    """A / B with its (1 - alpha) interval over repeats (or runs)."""

    ratio: float
    low: float
    high: float
    p_value: float
    n_a: int
    n_b: int
    alpha: float

    @property
    def significant(self) -> bool:
        return self.p_value < self.alpha

    def verdict(self) -> str:
        return SIGNIFICANT if self.significant else NOT_SIGNIFICANT

    def interval_text(self) -> str:
        return f"[{self.low:.2f}–{self.high:.2f}]"


def _logs(values: Sequence[float | None]) -> np.ndarray:
    """The logs of the positive finite values (None, NaN, +-inf and <= 0 are dropped)."""
    kept = (float(v) for v in values if v is not None)
    # math.log (libm), not numpy's vectorized log, which differs from it in the last bit for some values
    return np.array([math.log(v) for v in kept if math.isfinite(v) and v > 0])  # [n]


def ratio_estimate(
    a: Sequence[float | None], b: Sequence[float | None], alpha: float = DEFAULT_ALPHA
) -> RatioEstimate | None:
    """A / B over positive finite values; None with fewer than MIN_REPEATS a side."""
    la, lb = _logs(a), _logs(b)
    if la.size < MIN_REPEATS or lb.size < MIN_REPEATS:
        return None
    d = float(np.mean(la) - np.mean(lb))
    se2_a, se2_b = float(np.var(la, ddof=1)) / la.size, float(np.var(lb, ddof=1)) / lb.size
    se2 = se2_a + se2_b
    if se2 == 0.0:  # identical repeats on both sides: exact values, no spread to test against
        p = 1.0 if d == 0.0 else 0.0
        return RatioEstimate(math.exp(d), math.exp(d), math.exp(d), p, la.size, lb.size, alpha)
    # Welch-Satterthwaite: the degrees of freedom of se2, a sum of two variances of different sizes
    t = _scipy_stats.t(se2**2 / (se2_a**2 / (la.size - 1) + se2_b**2 / (lb.size - 1)))
    se = math.sqrt(se2)
    half = float(t.ppf(1.0 - alpha / 2.0)) * se
    p = float(2.0 * t.sf(abs(d) / se))
    return RatioEstimate(math.exp(d), math.exp(d - half), math.exp(d + half), p, la.size, lb.size, alpha)


def not_enough_text(n_a: int, n_b: int) -> str:
    return f"{NOT_ENOUGH} ({n_a} and {n_b}; {MIN_REPEATS} a side needed)"


def benjamini_hochberg(p_values: Sequence[float | None], alpha: float = DEFAULT_ALPHA) -> list[bool]:
    """Which p-values are discoveries at false-discovery rate alpha: those whose BH-adjusted p-value is
    <= alpha. None: never, and not counted among the tests; NaN: a test that found nothing (p = 1)."""
    tested = [(i, 1.0 if math.isnan(p) else p) for i, p in enumerate(p_values) if p is not None]
    adjusted = np.atleast_1d(_scipy_stats.false_discovery_control([p for _, p in tested], method="bh"))
    discoveries = {i for (i, _), q in zip(tested, adjusted) if q <= alpha}
    return [i in discoveries for i in range(len(p_values))]


def times_text(ratio: float) -> str:
    """A ratio written for "A is N x B": two decimals, three significant figures below 0.1."""
    return f"{ratio:.2f}" if ratio >= 0.1 else f"{ratio:.3g}"
