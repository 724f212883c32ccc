"""manifest.json as one typed, versioned model: what a run is (the resolved matrix, machine, git,
the plan) and, per server, exactly how it was started (argv, env, engine version, options).

One producer: `build_manifest` makes it when a run starts, and the store (`RunStore.open`,
`RunStore.record_server`) is the only writer; the report reads the same model back through
`benchsuite.results.stored_files.read_manifest`. Layout version: `benchsuite.records.SCHEMA_VERSION`.
A version-1 manifest (an untyped dict, before this model) is read into it by
benchsuite.results.schema_v1; any other version is refused by the store with a message naming it.

Blocks whose shape the suite fixes are typed (`benchsuite.records.StoredFacts`: each writes back
exactly the keys it was given, so older files read and write back unchanged): machine and git
(benchsuite.tools.machine), the link probe (benchsuite.tools.linkbw), the input fingerprint, a
server's fairness, search and canary (benchsuite.results.server_facts). What an engine, a matrix or
another producer defines stays a mapping, said so at its field.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from benchsuite.config.plan import Plan
from benchsuite.records import SCHEMA_VERSION, StoredFacts
from benchsuite.results.fingerprint import Fingerprint, plan_fingerprint
from benchsuite.results.server_facts import CanaryResult, SearchRecord
from benchsuite.tools.linkbw import LinkBandwidth
from benchsuite.tools.machine import GitFacts, MachineFacts, git_facts, machine_facts
from paged_experts.shape import ModelShape


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FairnessRecord(StoredFacts):
    """A server's fairness settings as recorded (engines.base.Fairness.as_dict)."""

    kv_capacity_tokens: int | None = None
    prefix_caching: bool | None = None


class ServerRecord(_Record):
    """manifest.servers[<server-id>]: one server as launched, plus what was learned while it ran."""

    engine: str = ""  # engine entry name in the matrix
    kind: str = ""
    # the engine's options object in JSON form: its keys are the engine's own (its `options_model`)
    options: dict[str, Any] = Field(default_factory=dict)
    resolved_options: dict[str, Any] = Field(default_factory=dict)  # in force: defaults resolved by the adapter
    fairness: FairnessRecord = Field(default_factory=FairnessRecord)
    max_concurrency: int | None = None
    argv: list[str] = Field(default_factory=list)  # exactly as launched
    env: dict[str, str] = Field(default_factory=dict)  # the engine's whole environment, secrets masked
    # EngineAdapter.version: free-form, each engine names its own facts (binary and build for
    # llama.cpp, torch for the built-in engine); `expert_format` / `expert_bytes` where it knows them
    version: dict[str, Any] = Field(default_factory=dict)
    # the served model's shape as the adapter read it at launch (EngineAdapter.model_shape); None in
    # runs stored before it was recorded, or where the adapter cannot read it
    model: ModelShape | None = None
    started_utc: str | None = None
    startup_s: float | None = None  # launch -> first 200 from the health path
    # the adapter's startup_facts hook: free-form, each engine its own breakdown (the built-in
    # server's `engine_startup_s` phases and captured graphs; nothing from the others today)
    startup_facts: dict[str, Any] = Field(default_factory=dict)
    log: str | None = None  # relative to the run directory
    search: SearchRecord | None = None  # a budget search of this server's option, or the value it chose
    search_error: str | None = None
    canary: CanaryResult | None = None  # the leak canary after the server's cells
    # the adapter's after_cells hook, free-form per engine (SGLang: routing_trace); in a version-1
    # run also every server key the model does not name
    facts: dict[str, Any] = Field(default_factory=dict)
    # `run --ray`: the Ray node of its last launch (a key of Manifest.nodes; with interleaved repeats its
    # launches may run on several nodes: each cell names its own); None: the manifest's `machine`
    node: str | None = None


class PlannedServer(_Record):
    engine: str
    kind: str
    params: dict[str, Any]  # the swept option values of this server: the engine's option names


class PlannedSearch(_Record):
    engine: str
    option: str


class Planned(_Record):
    servers: dict[str, PlannedServer] = Field(default_factory=dict)
    cells: list[str] = Field(default_factory=list)
    searches: list[PlannedSearch] = Field(default_factory=list)


class Invocation(_Record):
    started_utc: str
    git: GitFacts | None = None
    host: str | None = None


class Manifest(_Record):
    schema_version: int = SCHEMA_VERSION
    run_id: str
    created_utc: str
    matrix_source: str
    matrix_hash: str  # sha256 of the canonical matrix: a resume must match it
    # benchsuite.config.schema.Matrix in JSON form (sweeps unexpanded), kept as a mapping: it is the
    # matrix of its run's time, and an older run's matrix need not validate against today's schema
    matrix: dict[str, Any]
    machine: MachineFacts = Field(default_factory=MachineFacts)  # benchsuite.tools.machine.machine_facts()
    git: GitFacts = Field(default_factory=GitFacts)  # benchsuite.tools.machine.git_facts()
    # what the cells depend on beyond the matrix text (benchsuite.results.fingerprint); a resume compares it
    fingerprint: Fingerprint | None = None
    link_bandwidth: LinkBandwidth | None = None  # the run's host->device probe (matrix `linkbw: true`)
    # `run --ray`: node id -> that node's machine_facts() plus its hostname, address and source (`git`), as
    # its first task found them; `machine` stays the driver's. Empty in a run without --ray.
    nodes: dict[str, dict[str, Any]] = Field(default_factory=dict)
    planned: Planned = Field(default_factory=Planned)
    servers: dict[str, ServerRecord] = Field(default_factory=dict)
    invocations: list[Invocation] = Field(default_factory=list)
    # Facts of a producer other than `benchsuite run`, free-form (and a version-1 manifest's keys the
    # model does not name)
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
        created_utc=datetime.now(UTC).isoformat(timespec="seconds"),
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
