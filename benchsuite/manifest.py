"""manifest.json as one typed, versioned model: what a run is (the resolved matrix, machine, git,
the plan) and, per server, exactly how it was started (argv, env, engine version, options).

One producer: `build_manifest` makes it when a run starts, and the store (`RunStore.open`,
`RunStore.record_server`) is the only writer; the report reads the same model back through
`benchsuite.stored_files.read_manifest`. Layout version: `benchsuite.records.SCHEMA_VERSION`.
A version-1 manifest (an untyped dict, before this model) is read into it by
benchsuite.schema_v1; any other version is refused by the store with a message naming it.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from benchsuite.fingerprint import plan_fingerprint
from benchsuite.machine import git_facts, machine_facts
from benchsuite.plan import Plan
from benchsuite.records import SCHEMA_VERSION
from paged_experts.shape import ModelShape


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ServerRecord(_Record):
    """manifest.servers[<server-id>]: one server as launched, plus what was learned while it ran."""

    engine: str = ""  # engine entry name in the matrix
    kind: str = ""
    options: dict[str, Any] = Field(default_factory=dict)  # the engine's options object, JSON form
    resolved_options: dict[str, Any] = Field(default_factory=dict)  # in force: defaults resolved by the adapter
    fairness: dict[str, Any] = Field(default_factory=dict)
    max_concurrency: int | None = None
    argv: list[str] = Field(default_factory=list)  # exactly as launched
    env: dict[str, str] = Field(default_factory=dict)  # the engine's whole environment, secrets masked
    version: dict[str, Any] = Field(default_factory=dict)  # EngineAdapter.version
    # the served model's shape as the adapter read it at launch (EngineAdapter.model_shape); None in
    # runs stored before it was recorded, or where the adapter cannot read it
    model: ModelShape | None = None
    started_utc: str | None = None
    startup_s: float | None = None  # launch -> first 200 from the health path
    startup_facts: dict[str, Any] = Field(default_factory=dict)  # the adapter's startup_facts hook (graphs, phases)
    log: str | None = None  # relative to the run directory
    search: dict[str, Any] | None = None  # an n_cpu_moe search: request, settings, measured, best_n
    search_error: str | None = None
    canary: dict[str, Any] | None = None  # canary.CanaryReport.to_dict(), or {error}
    facts: dict[str, Any] = Field(default_factory=dict)  # the adapter's after_cells hook (SGLang: routing_trace)
    # `run --ray`: the Ray node of its last launch (a key of Manifest.nodes; with interleaved repeats its
    # launches may run on several nodes: each cell names its own); None: the manifest's `machine`
    node: str | None = None


class PlannedServer(_Record):
    engine: str
    kind: str
    params: dict[str, Any]  # the swept option values of this server


class PlannedSearch(_Record):
    engine: str
    option: str


class Planned(_Record):
    servers: dict[str, PlannedServer] = Field(default_factory=dict)
    cells: list[str] = Field(default_factory=list)
    searches: list[PlannedSearch] = Field(default_factory=list)


class Invocation(_Record):
    started_utc: str
    git: dict[str, Any] | None = None
    host: str | None = None


class Manifest(_Record):
    schema_version: int = SCHEMA_VERSION
    run_id: str
    created_utc: str
    matrix_source: str
    matrix_hash: str  # sha256 of the canonical matrix: a resume must match it
    matrix: dict[str, Any]  # benchsuite.matrix_schema.Matrix in JSON form (sweeps unexpanded)
    machine: dict[str, Any] = Field(default_factory=dict)  # benchsuite.machine.machine_facts()
    git: dict[str, Any] = Field(default_factory=dict)  # benchsuite.machine.git_facts()
    # what the cells depend on beyond the matrix text (benchsuite.fingerprint); a resume compares it
    fingerprint: dict[str, Any] | None = None
    link_bandwidth: dict[str, Any] | None = None  # the run's host->device probe (matrix `linkbw: true`)
    # `run --ray`: node id -> that node's machine_facts() plus its hostname, address and source (`git`), as
    # its first task found them; `machine` stays the driver's. Empty in a run without --ray.
    nodes: dict[str, dict[str, Any]] = Field(default_factory=dict)
    planned: Planned = Field(default_factory=Planned)
    servers: dict[str, ServerRecord] = Field(default_factory=dict)
    invocations: list[Invocation] = Field(default_factory=list)
    # Facts of a producer other than `benchsuite run` (benchmarks/h200_report.py: `h200`, `model`).
    extra: dict[str, Any] = Field(default_factory=dict)

    def server(self, server_id: str) -> ServerRecord:
        return self.servers.get(server_id) or ServerRecord()

    def with_server(self, server_id: str, **facts: Any) -> Manifest:
        """A copy with `facts` merged into servers[server_id] (validated: a typo is an error)."""
        merged = ServerRecord.model_validate({**self.server(server_id).model_dump(), **facts})
        return self.model_copy(update={"servers": {**self.servers, server_id: merged}})

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


def build_manifest(plan: Plan) -> Manifest:
    """The manifest of a run as it starts: the plan, the machine and the source it runs from."""
    return Manifest(
        run_id=plan.run_id,
        created_utc=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        matrix_source=str(plan.matrix.source),
        matrix_hash=plan.matrix.matrix_hash,
        matrix=plan.matrix.as_json(),
        machine=machine_facts(),
        git=git_facts(),
        fingerprint=plan_fingerprint(plan),
        planned=Planned(
            servers={s.server_id: PlannedServer(engine=s.name, kind=s.kind, params=dict(plan.params[s.server_id]))
                     for s in plan.servers},
            cells=[c.cell_id for c in plan.cells],
            searches=[PlannedSearch(engine=t.spec.name, option=t.option) for t in plan.searches],
        ),
    )  # fmt: skip
