"""The --n-cpu-moe propose/measure search on synthetic throughput curves (no server launched)."""

from __future__ import annotations

import random

import pytest

from benchsuite.errors import UserError
from benchsuite.run.search import Observation, SearchSettings, drive, parse_request, propose

FITTING = list(range(6, 49))  # e.g. a 48-layer model whose first fitting N is 6


def values(curve):
    """A throughput curve (N -> objective or None) as the search's objective (no memory measured)."""
    return lambda n: Observation(curve(n))


def test_monotone_curve_costs_two_launches():
    outcome = drive(propose(FITTING), values(lambda n: 100.0 - n))
    assert outcome.best_n == 6
    assert [m.n for m in outcome.measurements] == [6, 7]
    assert outcome.launches == 2
    assert outcome.linear_scan_launches == len(FITTING)


def test_noisy_monotone_curve_finds_a_point_within_noise_of_the_best():
    rng = random.Random(7)
    truth = {n: 100.0 * 0.97 ** (n - 6) for n in FITTING}
    noise = {n: truth[n] * (1 + rng.uniform(-0.01, 0.01)) for n in FITTING}
    outcome = drive(propose(FITTING, rel_tol=0.02), values(noise.__getitem__))
    assert truth[outcome.best_n] >= 0.97 * truth[6]
    assert outcome.launches <= 4
    assert outcome.best_value == max(m.value for m in outcome.measurements)


def test_bump_lower_than_the_start_does_not_move_the_choice():
    curve = {n: 100.0 - 2 * n + (15.0 if n == 12 else 0.0) for n in FITTING}  # bump at 12 stays below f(6)
    outcome = drive(propose(FITTING), values(curve.__getitem__))
    assert outcome.best_n == 6
    assert outcome.launches < 5


def test_peak_inside_the_range_is_found_with_fewer_launches_than_a_scan():
    curve = {n: 100.0 - 3 * abs(n - 15) for n in FITTING}  # rises until 15, then falls
    outcome = drive(propose(FITTING), values(curve.__getitem__))
    assert outcome.best_n == 15
    measured = {m.n for m in outcome.measurements}
    assert {14, 15, 16} <= measured  # the neighbours of the best point were verified
    assert outcome.launches < outcome.linear_scan_launches / 3


def test_failed_launches_are_skipped_never_counted_as_zero():
    curve = {n: (None if n in (6, 7) else 100.0 - n) for n in FITTING}
    outcome = drive(propose(FITTING), values(curve.__getitem__))
    assert outcome.best_n == 8
    assert [m.n for m in outcome.measurements][:3] == [6, 7, 8]
    assert all(m.value is None for m in outcome.measurements if m.n in (6, 7))


def test_no_fitting_values_or_all_failed_give_no_best():
    assert drive(propose([]), values(lambda n: 1.0)).best_n is None
    outcome = drive(propose([3, 4]), values(lambda n: None))
    assert outcome.best_n is None and outcome.launches == 2


def test_single_candidate():
    outcome = drive(propose([4]), values(lambda n: 5.0))
    assert (outcome.best_n, outcome.launches) == (4, 1)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("search", SearchSettings()),
        (
            {"search": {"min_n": 2, "rel_tol": 0.05}},
            SearchSettings(min_n=2, rel_tol=0.05),
        ),
    ],
)
def test_parse_request(value, expected):
    assert parse_request(value) == expected


@pytest.mark.parametrize("value", ["searhc", {"search": {"bogus": 1}}, {"search": 3}, 5])
def test_parse_request_rejects(value):
    with pytest.raises(UserError):
        parse_request(value)


def test_a_launch_measured_over_the_budget_counts_as_not_fitting():
    # N=6 and 7 pass the projection but measure over the budget: the search moves on as after a failure
    over = {6, 7}
    outcome = drive(propose(FITTING), lambda n: Observation(100.0 - n, 20 * 10**9, fits=n not in over))
    assert outcome.best_n == 8
    assert [m.n for m in outcome.measurements][:3] == [6, 7, 8]
    assert outcome.measurements[0].peak_bytes == 20 * 10**9
