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
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

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


def _clean(values: Sequence[float | None]) -> list[float]:
    return [float(v) for v in values if v is not None and not math.isnan(float(v)) and float(v) > 0]


def ratio_estimate(
    a: Sequence[float | None], b: Sequence[float | None], alpha: float = DEFAULT_ALPHA
) -> RatioEstimate | None:
    """A / B over positive values (None, NaN and <= 0 are dropped); None with fewer than MIN_REPEATS a side."""
    xs, ys = _clean(a), _clean(b)
    if len(xs) < MIN_REPEATS or len(ys) < MIN_REPEATS:
        return None
    la, lb = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mean_a, mean_b = sum(la) / len(la), sum(lb) / len(lb)
    var_a = sum((v - mean_a) ** 2 for v in la) / (len(la) - 1)
    var_b = sum((v - mean_b) ** 2 for v in lb) / (len(lb) - 1)
    d = mean_a - mean_b
    se2 = var_a / len(la) + var_b / len(lb)
    if se2 == 0.0:  # identical repeats on both sides: exact values, no spread to test against
        p = 1.0 if d == 0.0 else 0.0
        return RatioEstimate(math.exp(d), math.exp(d), math.exp(d), p, len(xs), len(ys), alpha)
    df = se2**2 / ((var_a / len(la)) ** 2 / (len(la) - 1) + (var_b / len(lb)) ** 2 / (len(lb) - 1))
    se = math.sqrt(se2)
    t_crit = float(_scipy_stats.t.ppf(1.0 - alpha / 2.0, df))
    p = float(2.0 * _scipy_stats.t.sf(abs(d) / se, df))
    return RatioEstimate(math.exp(d), math.exp(d - t_crit * se), math.exp(d + t_crit * se), p, len(xs), len(ys), alpha)


def not_enough_text(n_a: int, n_b: int) -> str:
    return f"{NOT_ENOUGH} ({n_a} and {n_b}; {MIN_REPEATS} a side needed)"


def benjamini_hochberg(p_values: Sequence[float | None], alpha: float = DEFAULT_ALPHA) -> list[bool]:
    """Which p-values are discoveries at false-discovery rate alpha (None: never)."""
    indexed = sorted((p, i) for i, p in enumerate(p_values) if p is not None)
    m = len(indexed)
    cutoff = -1
    for rank, (p, _) in enumerate(indexed, start=1):
        if p <= alpha * rank / m:
            cutoff = rank
    chosen = {i for rank, (_, i) in enumerate(indexed, start=1) if rank <= cutoff}
    return [i in chosen for i in range(len(p_values))]


def times_text(ratio: float) -> str:
    """A ratio written for "A is N x B": two decimals, three significant figures below 0.1."""
    return f"{ratio:.2f}" if ratio >= 0.1 else f"{ratio:.3g}"
