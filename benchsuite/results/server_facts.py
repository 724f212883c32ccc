"""The typed blocks of a server's manifest entry (`manifest.servers.<id>`) whose shape the suite fixes:
the budget search's record (`search`, written by benchsuite.run.search and the runner) and the leak
canary's verdict (`canary`, benchsuite.checks.canary through the runner).

Each is a `benchsuite.records.StoredFacts`: it writes back exactly the keys it was given, so a record
written before a key existed (`fit_by`, `guess_margin_bytes`, a candidate's peak) reads and writes
back unchanged. What differs per engine stays a mapping, said so at its field.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from benchsuite.records import StoredFacts

CandidateOutcome = Literal["ruled out", "measured", "over budget", "failed", "not launched"]


class SearchCandidate(StoredFacts):
    """One candidate value of a search (`search.candidates[]`)."""

    n: int = 0  # the value (N or K)
    # ruled out: the projection exceeds the budget, never launched (no cell); measured / over budget /
    # failed: launched (one cell; over budget: its measured peak device memory exceeds the budget);
    # not launched: fits, but the search found its best point without it
    outcome: CandidateOutcome = "failed"
    projected_bytes: int = 0  # the projection + its margin: what is compared with the budget to rule out
    # the adapter's projection dataclass as a dict; its keys are the engine's (llama.cpp fit.Projection,
    # builtin memory.KProjection), `source` common to both
    projection: dict[str, Any] = Field(default_factory=dict)
    value: float | None = None  # the objective of a measured value
    cell_id: str | None = None  # the stored cell of a launched value
    peak_device_memory_bytes: int | None = None  # measured over the launched cell (None: no GPU)


class SearchMeasurement(StoredFacts):
    """One launch of a search in launch order (`search.measured[]`, run.search_propose.Measurement)."""

    n: int = 0
    value: float | None = None  # None: the launch or the cell failed; never counted as 0
    peak_bytes: int | None = None


class ObjectiveCell(StoredFacts):
    """The workload point each launch of a search measured."""

    workload: str | None = None
    prompt_class: str | None = None
    concurrency: int | None = None


class SearchRecord(StoredFacts):
    """`servers.<id>.search`. On the search's own server: the whole search (every key below but
    `request`). On the server of the value it chose: `option` and `request` only, pointing back."""

    option: str | None = None  # the searched engine option (n_cpu_moe, resident_experts)
    request: str | dict[str, Any] | None = None  # the matrix's `search` or `{search: {...}}`, as written
    # the knob's settings of its time (engines.search_settings; each knob has its own keys)
    settings: dict[str, Any] = Field(default_factory=dict)
    budget_bytes: int | None = None
    margin_bytes: int | None = None  # added to a projection to rule a value out
    guess_margin_bytes: int | None = None  # added to a projection to guess a launch's peak (no GPU)
    objective_cell: ObjectiveCell | None = None
    fitting: list[int] = Field(default_factory=list)  # the values whose projection fits
    measured: list[SearchMeasurement] = Field(default_factory=list)
    best_n: int | None = None
    launches: int | None = None
    linear_scan_launches: int | None = None  # what one launch per fitting value would have cost
    candidates: list[SearchCandidate] = Field(default_factory=list)
    fit_by: str | None = None  # "peak device memory", or "projection (no device memory measured)"


class CanaryResult(StoredFacts):
    """`servers.<id>.canary`: checks.canary.CanaryReport with its verdict, or only `error` when the
    canary did not run to the end."""

    marker: str | None = None
    requests_checked: int | None = None
    leaks: list[str] = Field(default_factory=list)  # responses that contained another request's marker
    interference: list[str] = Field(default_factory=list)  # prompts whose concurrent output differed
    passed: bool | None = None
    error: str | None = None
