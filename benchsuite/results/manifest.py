"""manifest.json as one typed, versioned model: what a run is (the resolved matrix, machine, git,
the plan) and, per server, exactly how it was started (argv, env, engine version, options).

One producer: `build_manifest` makes it when a run starts, and the store is the only writer
(`RunStore.open`, which merges a resumed invocation's plan into `planned`; `RunStore.record_server`;
`RunStore.record_planned`, which adds a search's chosen server and cells, `planned_by_search`); the report
reads the same model back through `benchsuite.results.stored_files.read_manifest`. Layout version:
`benchsuite.records.SCHEMA_VERSION`. A version-1 manifest (an untyped dict, before this model) is read into
it by benchsuite.results.schema_v1; any other version is refused by the store with a message naming it.

Blocks whose shape the suite fixes are typed (`benchsuite.records.StoredFacts`: each writes back
exactly the keys it was given, so older files read and write back unchanged): machine and git
(benchsuite.tools.machine), the link probe (benchsuite.tools.linkbw), the input fingerprint, a
server's fairness, search and canary (benchsuite.results.server_facts). What an engine, a matrix or
another producer defines stays a mapping, said so at its field.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from benchsuite.config.plan import CellSpec, Plan, SearchTask, resolved_params
from benchsuite.engines.base import ServerSpec
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


class PlannedServer(StoredFacts):
    """A planned server; like every StoredFacts block it writes back the keys it was given (a record older
    than `search_of` keeps its keys)."""

    engine: str
    kind: str
    params: dict[str, Any]  # the swept option values of this server: the engine's option names
    # a search's chosen value: the id of the search's own server (PlannedSearch.server_id); None for a
    # server the matrix names, and in a record older than it
    search_of: str | None = None


class PlannedSearch(StoredFacts):
    """A planned search (a record older than `server_id` and `params` keeps its keys)."""

    engine: str
    option: str
    # the search's own server, under which its outcome is stored (servers.<id>.search, search_error), and its
    # other swept values; None and empty in a record older than them (the report then judges no search)
    server_id: str | None = None
    params: dict[str, Any] = Field(default_factory=dict)


class Planned(_Record):
    """What the run's invocations planned, merged (`merged`): the store adds each resumed invocation's plan,
    and the runner a search's chosen server and cells once the search has chosen (their ids are known then)."""

    servers: dict[str, PlannedServer] = Field(default_factory=dict)
    cells: list[str] = Field(default_factory=list)
    searches: list[PlannedSearch] = Field(default_factory=list)

    def merged(self, other: Planned) -> Planned:
        """The union of both, in first-seen order (this record's first), without duplicates; an entry seen
        twice keeps its first form, but a search recorded before `server_id` takes the form that names it."""
        searches = list(self.searches)
        for search in other.searches:
            same = [i for i, s in enumerate(searches) if _same_search(s, search)]
            if not same:
                searches.append(search)
            elif searches[same[0]].server_id is None and search.server_id is not None:
                searches[same[0]] = search
        return Planned(
            servers={**self.servers, **{k: v for k, v in other.servers.items() if k not in self.servers}},
            cells=list(dict.fromkeys([*self.cells, *other.cells])),
            searches=searches,
        )


def _same_search(a: PlannedSearch, b: PlannedSearch) -> bool:
    """One search: by its server id, or by engine entry and option where one record is older than the id."""
    if a.server_id is not None and b.server_id is not None:
        return a.server_id == b.server_id
    return (a.engine, a.option) == (b.engine, b.option)


class Invocation(StoredFacts):  # writes back the keys it was read with: a record older than `machine` stays so
    started_utc: str
    git: GitFacts | None = None
    host: str | None = None
    # the machine this invocation ran on (the manifest's `machine` is the first invocation's, or the one that took the
    # run over before any cell had finished): a resume on another machine of the same kind is allowed and shows
    # here; on another kind it is refused (results.store). None in a record older than it.
    machine: MachineFacts | None = None


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
            searches=[PlannedSearch(engine=t.spec.name, option=t.option, server_id=t.spec.server_id,
                                    params=dict(t.params)) for t in plan.searches],
        ),
    )  # fmt: skip


def planned_by_search(task: SearchTask, spec: ServerSpec, cells: Sequence[CellSpec]) -> Planned:
    """What a search plans once it has chosen (plan.resolve_search's server and cells), to merge into the
    manifest's `planned` (RunStore.record_planned): recorded here rather than derived by the report, which
    would have to rebuild the engine's options from the recorded matrix to find the server's id."""
    params = resolved_params(task, spec.options)
    server = PlannedServer(engine=spec.name, kind=spec.kind, params=params, search_of=task.spec.server_id)
    return Planned(servers={spec.server_id: server}, cells=[c.cell_id for c in cells])
