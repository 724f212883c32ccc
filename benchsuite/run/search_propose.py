"""The searches' proposal generators, pure: which value to launch next against a memory budget.

Each is a generator (guidellm's adaptive-sweep shape): it yields the next value to launch, is sent
that launch's `Observation` (the objective, None for a failed launch, and the measured peak device
memory, benchsuite.tools.device_memory) and returns a `SearchOutcome`. benchsuite.run.search drives them
against real launches; `drive` against a synchronous objective (tests, simulations).

llama.cpp `--n-cpu-moe` N (`propose`). The published baseline launched the server once per N:
1. values that cannot fit are ruled out without a launch (by the caller, from the projection);
2. the fitting range is searched with its usual shape in mind: fewer CPU layers is faster, so
   throughput drops as N grows past the smallest fitting N. `propose` starts there and steps right
   with doubling strides only while the objective improves by more than `rel_tol`;
3. the best point's neighbours are verified (measured); a better neighbour moves the best point
   and its neighbours are verified in turn (hill climbing to a measured local maximum).
A launched N whose measured peak device memory exceeds the budget counts as not fitting (the
generator sees no value there), whatever the projection said.

The built-in engine's paged K (`propose_largest`, `propose_fastest`). Device memory is linear in K
(one slot per K: `slot_bytes`, benchsuite.tools.preflight), so the search is a bracket, not a scan:
1. K whose projection (a lower bound) exceeds the budget are ruled out by the caller;
2. the first launch is the largest K whose projection plus an overhead guess fits; its measured
   peak replaces the guess (measured minus guessed, taken at the nearest measured K), and the next
   launch is the largest K that the corrected guess lets through;
3. it stops when a K that fits has its next larger candidate measured over the budget (or has
   none): the neighbour is always verified by a launch. Two or three launches on a linear curve.
`propose_fastest` then climbs from that K towards smaller K (`propose`, descending) to the fastest
measured K, reusing the launches already made. Without a GPU the peak is None and a K fits by its
guess (projection plus overhead).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Observation:
    """What one launch tells a search."""

    value: float | None  # the objective; None: the launch or the cell failed, never counted as 0
    peak_bytes: int | None = None  # measured peak device memory; None: no GPU (or not measured)
    fits: bool | None = None  # peak_bytes <= budget; None when peak_bytes is None


Objective = Callable[[int], Observation]
SearchGen = Generator[int, Observation, "SearchOutcome"]


@dataclass(frozen=True)
class Measurement:
    n: int  # the searched value (N or K)
    value: float | None  # None: the launch or the cell failed; never counted as 0
    peak_bytes: int | None = None


@dataclass(frozen=True)
class SearchOutcome:
    best_n: int | None
    best_value: float | None
    measurements: tuple[Measurement, ...]  # launch order
    linear_scan_launches: int  # what one launch per candidate value would have cost

    @property
    def launches(self) -> int:
        return len(self.measurements)


def _usable(obs: Observation) -> float | None:
    """The objective of a launch that counts: measured, and not over the budget."""
    return None if obs.fits is False else obs.value


def propose(candidates: Sequence[int], rel_tol: float = 0.02, *, descending: bool = False) -> SearchGen:
    """Yield values to measure over the fitting `candidates` (ascending, or descending), hill
    climbing on the objective; send back each launch's Observation."""
    values = sorted(set(candidates), reverse=descending)
    measured: dict[int, Observation] = {}  # index into values -> observation

    def value(i: int) -> float | None:
        return _usable(measured[i])

    def best_index() -> int | None:
        ok = [i for i in measured if value(i) is not None]
        return max(ok, key=lambda i: (value(i), -i)) if ok else None

    # 1. First fitting value that runs (a failed launch moves one further).
    start = None
    for i in range(len(values)):
        measured[i] = yield values[i]
        if value(i) is not None:
            start = i
            break
    if start is None:
        return _outcome(values, measured, None, len(values))

    # 2. Step on with doubling strides while the objective improves by more than rel_tol.
    best, stride = start, 1
    while best + stride < len(values):
        j = best + stride
        if j not in measured:
            measured[j] = yield values[j]
        if _improves(value(j), value(best), rel_tol):
            best, stride = j, stride * 2
        else:
            break

    # 3. Verify neighbours of the best measured point until it is a measured local maximum.
    while True:
        b = best_index()
        assert b is not None
        todo = [i for i in (b - 1, b + 1) if 0 <= i < len(values) and i not in measured]
        if not todo:
            break
        for i in todo:
            measured[i] = yield values[i]
    return _outcome(values, measured, best_index(), len(values))


def _improves(new: float | None, old: float | None, rel_tol: float) -> bool:
    """`new` beats `old` by more than the relative tolerance (a failed measurement never does)."""
    if new is None:
        return False
    if old is None:
        return True
    return new - old > rel_tol * abs(old)


def _outcome(values: Sequence[int], measured: Mapping[int, Observation], best: int | None, scan: int) -> SearchOutcome:
    return SearchOutcome(
        best_n=values[best] if best is not None else None,
        best_value=_usable(measured[best]) if best is not None else None,
        measurements=tuple(Measurement(values[i], o.value, o.peak_bytes) for i, o in measured.items()),
        linear_scan_launches=scan,
    )


def propose_largest(candidates: Sequence[int], guess_bytes: Mapping[int, int], budget_bytes: int) -> SearchGen:
    """The largest candidate whose peak device memory fits `budget_bytes`, memory linear in the value.

    `guess_bytes`: each candidate's projection plus the overhead guess; a measured peak corrects it
    (measured - guessed at the nearest measured value), and a launch without a peak (no GPU) fits by
    its guess. A failed launch counts as not fitting (an out-of-memory start is the usual cause).
    """
    values = sorted(set(candidates))
    seen: dict[int, Observation] = {}  # value -> observation, launch order
    lo: int | None = None  # largest value measured to fit
    hi: int | None = None  # smallest value measured not to fit (or failed)

    def predicted(k: int) -> int:
        peaks = [(abs(m - k), m) for m, o in seen.items() if o.peak_bytes is not None]
        if not peaks:
            return guess_bytes[k]
        _, nearest = min(peaks)
        return guess_bytes[k] + (int(seen[nearest].peak_bytes or 0) - guess_bytes[nearest])

    def fits(k: int, obs: Observation) -> bool:
        if obs.value is None:
            return False
        return obs.fits if obs.fits is not None else guess_bytes[k] <= budget_bytes

    while True:
        open_range = [k for k in values if (lo is None or k > lo) and (hi is None or k < hi)]
        if not open_range:  # bracketed: lo fits and the next candidate above it does not (or none is left)
            break
        through = [k for k in open_range if predicted(k) <= budget_bytes]
        if lo is not None and not through:
            target = open_range[0]  # verify the neighbour the prediction says is over
        else:
            target = max(through) if through else open_range[0]
        obs = yield target
        seen[target] = obs
        if fits(target, obs):
            lo = target
        else:
            hi = target
    return SearchOutcome(
        best_n=lo,
        best_value=seen[lo].value if lo is not None else None,
        measurements=tuple(Measurement(k, o.value, o.peak_bytes) for k, o in seen.items()),
        linear_scan_launches=len(values),
    )


def propose_fastest(candidates: Sequence[int], guess_bytes: Mapping[int, int], budget_bytes: int,
                    rel_tol: float = 0.02) -> SearchGen:  # fmt: skip
    """The largest fitting value (`propose_largest`), then the fastest measured value at or below it
    (`propose` descending from it), launches already made reused."""
    known: dict[int, Observation] = {}
    largest = yield from _recording(propose_largest(candidates, guess_bytes, budget_bytes), known)
    if largest.best_n is None:
        return largest
    below = [k for k in candidates if k <= largest.best_n]
    fastest = yield from _recording(propose(below, rel_tol, descending=True), known)
    return SearchOutcome(
        best_n=fastest.best_n,
        best_value=fastest.best_value,
        measurements=tuple(Measurement(k, o.value, o.peak_bytes) for k, o in known.items()),
        linear_scan_launches=len(set(candidates)),
    )


def _recording(gen: SearchGen, known: dict[int, Observation]) -> SearchGen:
    """Forward `gen`'s proposals; a value already in `known` is answered from it without a launch."""
    try:
        n = next(gen)
        while True:
            if n in known:
                obs = known[n]
            else:
                obs = yield n
                known[n] = obs
            n = gen.send(obs)
    except StopIteration as stop:
        return stop.value


def drive(gen: SearchGen, objective: Objective) -> SearchOutcome:
    """Run a proposal generator against a synchronous objective (tests, simulations)."""
    try:
        n = next(gen)
        while True:
            n = gen.send(objective(n))
    except StopIteration as stop:
        return stop.value
