"""Matrix -> servers -> cells, with stable ids, and the dry-run listing.

A server is one engine entry with every sweep value resolved (one `ServerSpec`, one launch).
A cell is server x workload x prompt class x concurrency x repeat. Ids are the first 12 hex
digits of the sha256 of the canonical JSON of the resolved spec, so the same matrix always plans
the same ids (that is what makes a rerun resume) and any change to a spec gives a new id.

An engine entry whose options ask for a search (llama.cpp `n_cpu_moe`, builtin `resident_experts`:
`search` or `{search: {...}}`) does
not become a server here: it becomes a `SearchTask` that the runner hands to benchsuite.run.search,
which returns the resolved options; `resolve_search` then plans that server and its cells.
"""

from __future__ import annotations

import hashlib
import json
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from benchsuite.config.matrix import ValidatedMatrix
from benchsuite.config.schema import Workload
from benchsuite.engines import ADAPTERS
from benchsuite.engines.base import EngineOptions, Fairness, ServerSpec, search_knob
from benchsuite.engines.search_settings import SearchSettingsAny
from benchsuite.errors import UserError

ID_HEX_DIGITS = 12
DRY_RUN_PORT = 8000  # stands in for the free port chosen at launch


@dataclass(frozen=True)
class CellSpec:
    cell_id: str
    server_id: str
    engine: str
    params: Mapping[str, Any]  # swept option values of its server, for labels
    workload: str
    workload_spec: Workload
    prompt_class: str  # "short" or a token count as text
    concurrency: int
    repeat: int  # 0-based


@dataclass(frozen=True)
class SearchTask:
    """An engine option set with one option left to a search (e.g. llama.cpp n_cpu_moe)."""

    spec: ServerSpec  # options.<option> still holds the search request ("search" or {search: ...})
    option: str
    params: Mapping[str, Any]
    settings: SearchSettingsAny  # the request, parsed once here (benchsuite.engines.search_settings)

    @property
    def request(self) -> Any:
        """The search request as the matrix wrote it (the manifest's `search.request`)."""
        return self.spec.options.model_dump(mode="json")[self.option]


@dataclass(frozen=True)
class Plan:
    run_id: str
    matrix: ValidatedMatrix
    servers: tuple[ServerSpec, ...]
    cells: tuple[CellSpec, ...]
    searches: tuple[SearchTask, ...]
    params: Mapping[str, Mapping[str, Any]]  # server_id -> swept option values

    def cells_of(self, server_id: str) -> tuple[CellSpec, ...]:
        return tuple(c for c in self.cells if c.server_id == server_id)


def stable_id(payload: Any) -> str:
    canonical = json.dumps(payload, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()[:ID_HEX_DIGITS]


def default_run_id(matrix: ValidatedMatrix) -> str:
    return f"{matrix.matrix.name}-{matrix.matrix_hash[:8]}"


def make_server_spec(
    name: str,
    kind: str,
    options: EngineOptions,
    fairness: Fairness,
    max_concurrency: int,
    env: Mapping[str, str] | None = None,
) -> ServerSpec:
    # The id hashes the options' JSON form: the same matrix always gives the same ids (resume).
    body: dict[str, Any] = {
        "name": name,
        "kind": kind,
        "options": options.model_dump(mode="json"),
        "fairness": fairness.as_dict(),
        "max_concurrency": max_concurrency,
    }
    if env:  # only when declared, so the ids of matrices without `env:` stay as they were
        body["env"] = dict(sorted(env.items()))
    return ServerSpec(
        name=name,
        kind=kind,
        options=options,
        fairness=fairness,
        max_concurrency=max_concurrency,
        server_id=stable_id(body),
        env=dict(env or {}),
    )


def search_option(options: EngineOptions) -> str | None:
    """The option left to a search: value `search` or a mapping with a `search` key."""
    for key, value in options:
        if value == "search" or (isinstance(value, Mapping) and "search" in value):
            return key
    return None


def cell_id_of(server_id: str, workload: Mapping[str, Any], prompt_class: str, concurrency: int, repeat: int) -> str:
    """A cell's id from its server's id and the workload's JSON form (as the manifest records the matrix:
    the report names a planned cell no run measured by deriving the ids again, benchsuite.report.planned)."""
    body = {
        "server_id": server_id,
        "workload": workload,
        "prompt_class": prompt_class,
        "concurrency": concurrency,
        "repeat": repeat,
    }
    return stable_id(body)


def plan_cells(matrix: ValidatedMatrix, server: ServerSpec, params: Mapping[str, Any]) -> tuple[CellSpec, ...]:
    m = matrix.matrix
    cells = []
    for wname, workload in m.workloads.items():
        workload_json = workload.model_dump(mode="json")
        for prompt_class in workload.prompt_classes:
            for concurrency in workload.concurrency:
                for repeat in range(m.repeats):
                    cells.append(
                        CellSpec(
                            cell_id=cell_id_of(server.server_id, workload_json, prompt_class, concurrency, repeat),
                            server_id=server.server_id,
                            engine=server.name,
                            params=dict(params),
                            workload=wname,
                            workload_spec=workload,
                            prompt_class=prompt_class,
                            concurrency=concurrency,
                            repeat=repeat,
                        )
                    )
    return tuple(cells)


def build_plan(matrix: ValidatedMatrix, run_id: str | None = None) -> Plan:
    m = matrix.matrix
    fairness = Fairness(**m.fairness.model_dump(mode="json"))
    max_concurrency = max(c for w in m.workloads.values() for c in w.concurrency)
    servers: list[ServerSpec] = []
    cells: list[CellSpec] = []
    searches: list[SearchTask] = []
    params: dict[str, Mapping[str, Any]] = {}
    for name, entry in m.engines.items():
        for option_set in matrix.option_sets[name]:
            env = {**m.env, **entry.env}
            spec = make_server_spec(name, entry.kind, option_set.options, fairness, max_concurrency, env)
            option = search_option(option_set.options)
            if option is not None:
                request = option_set.options.model_dump(mode="json")[option]
                searches.append(SearchTask(spec, option, dict(option_set.params), search_knob(option).parse(request)))
                continue
            if any(s.server_id == spec.server_id for s in servers):
                continue  # two sweep values that validate to the same options
            servers.append(spec)
            params[spec.server_id] = dict(option_set.params)
            cells.extend(plan_cells(matrix, spec, option_set.params))
    return Plan(
        run_id=run_id or default_run_id(matrix),
        matrix=matrix,
        servers=tuple(servers),
        cells=tuple(cells),
        searches=tuple(searches),
        params=params,
    )


def resolve_search(plan: Plan, task: SearchTask, options: EngineOptions) -> tuple[ServerSpec, tuple[CellSpec, ...]]:
    """The server and cells of a finished search, given its resolved options."""
    spec = make_server_spec(
        task.spec.name, task.spec.kind, options, task.spec.fairness, task.spec.max_concurrency, task.spec.env
    )
    return spec, plan_cells(plan.matrix, spec, resolved_params(task, options))


def resolved_params(task: SearchTask, options: EngineOptions) -> dict[str, Any]:
    """The swept values of a search's chosen server: the task's, and the searched option's chosen value."""
    return {**task.params, task.option: options.model_dump(mode="json")[task.option]}


def select(plan: Plan, selectors: list[str]) -> Plan:
    """The part of a plan that `--only` selectors name: `ENGINE` (every server and search of that
    engine entry) or `ENGINE:OPTION=VALUE` (its servers whose swept option has that value). The run
    id is the whole matrix's, so a later run of the rest resumes the same results directory.
    Raises UserError naming a selector that matches nothing."""
    wanted: list[tuple[str, str | None, str | None]] = []
    for sel in selectors:
        name, _, cond = sel.partition(":")
        option, _, value = cond.partition("=")
        if not name or (cond and (not option or not value)):
            raise UserError(f"--only {sel!r}: use ENGINE or ENGINE:OPTION=VALUE (an engine entry name of the matrix)")
        wanted.append((name, option or None, value or None))

    def match(engine: str, params: Mapping[str, Any], sel: tuple[str, str | None, str | None]) -> bool:
        name, option, value = sel
        return engine == name and (option is None or str(params.get(option)) == value)

    servers = tuple(s for s in plan.servers if any(match(s.name, plan.params.get(s.server_id, {}), w) for w in wanted))
    searches = tuple(t for t in plan.searches if any(match(t.spec.name, t.params, w) for w in wanted))
    for w in wanted:
        if not any(match(s.name, plan.params.get(s.server_id, {}), w) for s in plan.servers) and not any(
            match(t.spec.name, t.params, w) for t in plan.searches
        ):
            names = sorted({s.name for s in plan.servers} | {t.spec.name for t in plan.searches})
            raise UserError(f"--only {':'.join(x for x in w[:1] if x)}{'' if w[1] is None else f':{w[1]}={w[2]}'}: "
                            f"no server of the matrix matches (engines: {', '.join(names)})")  # fmt: skip
    ids = {s.server_id for s in servers}
    return Plan(
        run_id=plan.run_id,
        matrix=plan.matrix,
        servers=servers,
        cells=tuple(c for c in plan.cells if c.server_id in ids),
        searches=searches,
        params={k: v for k, v in plan.params.items() if k in ids},
    )


def format_plan(plan: Plan) -> str:
    """The dry-run listing: every server with its exact command line, then its cells."""
    m = plan.matrix.matrix
    lines = [
        f"run {plan.run_id}: {len(plan.servers)} servers, {len(plan.cells)} cells, "
        f"{len(plan.searches)} searches -> {m.output_root}/{plan.run_id}",
        f"(port {DRY_RUN_PORT} below stands in for the free port chosen at launch)",
    ]
    if m.linkbw:
        lines.append(
            "link bandwidth: `benchsuite linkbw --json` runs once before the first server (manifest link_bandwidth)"
        )
    for server in plan.servers:
        adapter = ADAPTERS[server.kind]
        launch = adapter.launch_plan(server, DRY_RUN_PORT)
        label = _label(plan.params.get(server.server_id, {}))
        lines.append("")
        lines.append(f"server {server.server_id}  {server.name}{label}  mode={server.options.placement().mode}")
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted({**launch.env, **server.env}.items()))
        lines.append(f"  $ {env + ' ' if env else ''}{shlex.join(launch.argv)}")
        for cell in plan.cells_of(server.server_id):
            lines.append(
                f"  cell {cell.cell_id}  workload={cell.workload} class={cell.prompt_class} "
                f"concurrency={cell.concurrency} repeat={cell.repeat}"
            )
    for task in plan.searches:
        lines.append("")
        lines.append(
            f"search {task.spec.name}{_label(task.params)}: {task.option} is searched after the servers "
            f"above (benchsuite.run.search); its best value then runs every workload"
        )
        lines.extend(_search_template(plan, task))
    return "\n".join(lines)


def search_cell(cells: tuple[CellSpec, ...], option: str) -> CellSpec:
    """The one cell a search measures per launch (repeat 0, at the highest concurrency: the objective
    is measured where the server will be loaded most): the first workload and prompt class; for a
    search decided by the peak device memory (SearchKnob.by_peak_memory), the longest prompt class of
    any workload (prefill activations are the part of the peak that grows with the prompt)."""
    first = cells[0]
    if search_knob(option).by_peak_memory:
        return max((c for c in cells if c.repeat == 0), key=lambda c: (_prompt_tokens(c.prompt_class), c.concurrency))
    same_class = [c for c in cells if (c.workload, c.prompt_class, c.repeat) == (first.workload, first.prompt_class, 0)]
    return max(same_class, key=lambda c: c.concurrency)


def _prompt_tokens(prompt_class: str) -> int:
    """An exact-length class's tokens ("2048"); other classes ("short", a dataset's) count as 0."""
    return int(prompt_class) if prompt_class.isdigit() else 0


_SENTINEL = 987_654_321  # an option value no matrix uses, replaced by the placeholder in the listing


def _search_template(plan: Plan, task: SearchTask) -> list[str]:
    """The command line of the search's servers, the searched value as {N} (K: {K}), and the cell measured
    per value."""
    placeholder = f"{{{search_knob(task.option).letter}}}"  # the searched value's name in the listing
    options = task.spec.options.replaced(**{task.option: _SENTINEL})
    spec = make_server_spec(task.spec.name, task.spec.kind, options, task.spec.fairness, task.spec.max_concurrency,
                            task.spec.env)  # fmt: skip
    launch = ADAPTERS[spec.kind].launch_plan(spec, DRY_RUN_PORT)
    argv = [a.replace(str(_SENTINEL), placeholder) for a in launch.argv]
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted({**launch.env, **spec.env}.items()))
    objective = search_cell(plan_cells(plan.matrix, spec, task.params), task.option)
    command = shlex.join(argv).replace(shlex.quote(placeholder), placeholder)
    cell = f"workload={objective.workload} class={objective.prompt_class} concurrency={objective.concurrency}"
    return [
        f"  $ {env + ' ' if env else ''}{command}",
        f"  ({placeholder}: each candidate the memory projection lets through; one cell per launch: {cell})",
    ]


def _label(params: Mapping[str, Any]) -> str:
    return "".join(f" {k}={v}" for k, v in params.items())
