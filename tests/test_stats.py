"""benchsuite.report.stats (ratio intervals over repeats, Benjamini-Hochberg) and the machine-noise record
(benchsuite.tools.machine.cell_noise), with exact expected numbers."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time

import pytest
from scipy import stats as scipy_stats

from benchsuite.report import stats
from benchsuite.report.noise import load_text
from benchsuite.tools.machine import cell_noise, noise_snapshot


def test_ratio_estimate_is_welch_t_on_logs() -> None:
    a, b = [40.0, 44.0, 42.0], [20.0, 22.0]
    est = stats.ratio_estimate(a, b)
    assert est is not None and (est.n_a, est.n_b) == (3, 2)
    want = scipy_stats.ttest_ind([math.log(x) for x in a], [math.log(x) for x in b], equal_var=False)
    assert est.p_value == pytest.approx(want.pvalue)
    assert est.ratio == pytest.approx(math.exp(sum(map(math.log, a)) / 3 - sum(map(math.log, b)) / 2))
    assert est.low < est.ratio < est.high and est.significant
    # the interval is symmetric in log space: B / A is the reciprocal of A / B
    back = stats.ratio_estimate(b, a)
    assert back is not None and (back.low, back.high) == (pytest.approx(1 / est.high), pytest.approx(1 / est.low))


def test_ratio_estimate_against_a_case_worked_by_hand() -> None:
    # logs 1, 3 against 0, 2: d = 1, var = 2 a side, se^2 = 2/2 + 2/2 = 2, Welch-Satterthwaite df = 2^2 / (1 + 1) = 2.
    # With 2 df the t distribution has closed forms: sf(t) = 1/2 - t / (2 sqrt(2 + t^2)) and
    # ppf(q) = (2q - 1) / sqrt(2q(1 - q)); t = 1/sqrt(2) gives p = 1 - 1/sqrt(5).
    est = stats.ratio_estimate([math.e, math.e**3], [1.0, math.e**2])
    assert est is not None and (est.n_a, est.n_b) == (2, 2)
    t_975 = 0.95 / math.sqrt(2 * 0.975 * 0.025)  # 4.3027
    assert est.ratio == pytest.approx(math.e, rel=1e-12)
    assert est.p_value == pytest.approx(1 - 1 / math.sqrt(5), rel=1e-12)
    assert est.low == pytest.approx(math.exp(1 - t_975 * math.sqrt(2)), rel=1e-12)
    assert est.high == pytest.approx(math.exp(1 + t_975 * math.sqrt(2)), rel=1e-12)
    assert est.interval_text() == "[0.01–1193.77]" and not est.significant


def test_ratio_estimate_drops_values_that_are_not_positive_and_finite() -> None:
    plain = stats.ratio_estimate([2.0, 4.0], [1.0, 2.0])
    noisy = stats.ratio_estimate([2.0, float("inf"), 4.0, -1.0, None], [1.0, 2.0, float("nan"), 0.0])
    assert plain is not None and noisy == plain


def test_not_enough_repeats_and_degenerate_cases() -> None:
    assert stats.ratio_estimate([1.0], [1.0, 2.0]) is None
    assert stats.ratio_estimate([1.0, None, float("nan"), 0.0], [1.0, 2.0]) is None  # only one usable value
    same = stats.ratio_estimate([5.0, 5.0], [5.0, 5.0])
    assert same is not None and same.ratio == 1.0 and same.p_value == 1.0
    exact = stats.ratio_estimate([10.0, 10.0], [5.0, 5.0])
    assert exact is not None and exact.ratio == pytest.approx(2.0) and exact.significant
    assert stats.not_enough_text(1, 3) == "not enough repeats (1 and 3; 2 a side needed)"


def test_benjamini_hochberg() -> None:
    # m = 4: thresholds 0.0125, 0.025, 0.0375, 0.05 by rank; 0.01 and 0.02 pass, 0.04 > 0.0375 does not
    assert stats.benjamini_hochberg([0.01, 0.04, 0.02, 0.9]) == [True, False, True, False]
    assert stats.benjamini_hochberg([0.01, 0.04, 0.9]) == [True, False, False]  # 0.04 > 2 x 0.05 / 3
    assert stats.benjamini_hochberg([0.04] + [0.5] * 19) == [False] * 20  # one p = 0.04 among 20 rows is chance
    assert stats.benjamini_hochberg([None, 0.001]) == [False, True]
    assert stats.benjamini_hochberg([]) == [] and stats.benjamini_hochberg([None]) == [False]


def test_benjamini_hochberg_steps_up_and_counts_nan_as_a_test() -> None:
    # m = 3: thresholds 0.0167, 0.0333, 0.05. 0.04 and 0.045 miss their own thresholds, but 0.05 meets rank 3's,
    # so every p at or below it is a discovery (the step-up rule)
    assert stats.benjamini_hochberg([0.05, 0.04, 0.045]) == [True, True, True]
    assert stats.benjamini_hochberg([0.051, 0.04, 0.045]) == [False, False, False]
    # NaN is a test that found nothing: m = 2 and 0.03 > 0.05 / 2; None is no test: m = 1
    assert stats.benjamini_hochberg([0.03, float("nan")]) == [False, False]
    assert stats.benjamini_hochberg([0.03, None]) == [True, False]


def test_cell_noise_counts_only_other_processes() -> None:
    before = {"t_s": 0.0, "load_1m": 0.5, "cpu_busy_s": 100.0, "own_cpu_s": 10.0, "cpus": 2, "cpu_mhz": 2600.0}
    quiet = cell_noise(before, {**before, "t_s": 10.0, "cpu_busy_s": 110.0, "own_cpu_s": 19.0})
    assert quiet["other_cores"] == pytest.approx(0.1) and not quiet["busy"] and quiet["busy_reason"] is None
    assert quiet["own_cores"] == pytest.approx(0.9)  # our processes: 9 CPU s in 10 s
    busy = cell_noise(before, {**before, "t_s": 10.0, "load_1m": 2.5, "cpu_busy_s": 120.0, "own_cpu_s": 11.0})
    assert busy["other_cores"] == pytest.approx(1.9) and busy["busy"]
    assert busy["busy_reason"].startswith("other processes kept 1.90 of 2 cores busy")
    assert "cpu_busy_s" not in busy["before"] and busy["after"]["load_1m"] == 2.5
    # the report's per-cell machine column says both
    assert load_text({"machine": quiet}) == "load 0.50 -> 0.50, 2600 MHz, others 0.10 cores, ours 0.90 cores"


def test_noise_snapshot_tells_a_busy_process_that_is_not_ours_from_ours() -> None:
    # A spinner re-parented away from this process (the shell that started it exits): not ours unless named.
    out = subprocess.run(
        [
            "sh",
            "-c",
            f"{sys.executable} -c 'import time\nt = time.time()\nwhile time.time() - t < 4: pass' "
            ">/dev/null 2>&1 & echo $!",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    pid = int(out.stdout.strip())
    try:
        time.sleep(0.3)
        unnamed, named = noise_snapshot(), noise_snapshot([pid])
        time.sleep(2.0)
        others = cell_noise(unnamed, noise_snapshot())["other_cores"]
        others_without_spinner = cell_noise(named, noise_snapshot([pid]))["other_cores"]
    finally:
        os.kill(pid, signal.SIGKILL)
    assert others - others_without_spinner > 0.2  # the spinner's CPU is "other" only when it is not named ours
    assert unnamed["load_1m"] is not None and unnamed["cpus"] >= 1
