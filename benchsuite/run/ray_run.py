"""`benchsuite run matrix.yaml --ray [ADDRESS]`: the plan's servers spread over a Ray cluster, one store.

Each server round of the plan (benchsuite.run.runner.server_rounds: a server with its unfinished cells, or
one per repeat with `repeat_order: interleaved`) and each search becomes one Ray task
(benchsuite.run.ray_task.measure_work) asking for one GPU where its engine runs on one
(`EngineAdapter.needs_gpu`), else `cpus_per_server` CPUs (default: every CPU of the smallest node, so
CPU engines never share a node's cores while they are measured). Ray places each task on a node with
that free; a search stays one task, on one node. The driver holds the run's lock and is the store's
only writer: it writes each message of a task as it arrives (`ray.wait` over the tasks' streaming
generators), so a cell is stored the moment its node finished it; each node's machine facts go to the
manifest's `nodes` (the driver's stay its `machine`), each server and cell names its node.

Faults: a task that ends in an error (its node died, its worker crashed) fails the cells it had not
sent, the reason naming the node and the error; a rerun of the same command measures them again
(`store.finished`). Ctrl-C cancels every task (Ray raises KeyboardInterrupt in each: their servers stop
as on a local Ctrl-C), writes what they still send while they stop, then re-raises. Nothing already
stored is rewritten by a fault.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from benchsuite.config.plan import Plan
from benchsuite.engines import ADAPTERS
from benchsuite.engines.base import ServerSpec
from benchsuite.errors import UserError
from benchsuite.results.store import FINISHED_STATUSES, RunStore
from benchsuite.results.stored_files import read_cells, read_manifest
from benchsuite.run.cell import cell_identity
from benchsuite.run.context import DEFAULT_CELL_TIMEOUT_S, DEFAULT_REQUEST_TIMEOUT_S, RunEvents, SilentEvents
from benchsuite.run.ray_task import (
    CellStored,
    CellUpdated,
    EngineMetrics,
    Message,
    NodeFacts,
    PlannedMore,
    SearchFailed,
    ServerFacts,
    ServerFiles,
    Timeouts,
    Work,
    measure_work,
)
from benchsuite.run.runner import server_rounds

INSTALL_HINT = "`benchsuite run --ray` needs Ray on this machine and every node: pip install 'benchsuite[ray]'"
_WAIT_S = 0.5  # ray.wait's timeout: how soon the driver's loop notices Ctrl-C
UNPLACEABLE_S = 60.0  # a task no alive node can hold fails after this long (see Driver.fail_unplaceable)
_PLACE_CHECK_S = 5.0  # how often the driver asks Ray which nodes are alive
_RAY_NAMES = {"num_gpus": "GPU", "num_cpus": "CPU"}  # task options -> node resource names
_LONG_LINE = 160
STOP_GRACE_S = 60.0  # after Ctrl-C: how long cancelled tasks get to stop their servers and send what they have


@dataclass
class Submitted:
    """One submitted task as the driver tracks it."""

    work: Work
    resources: dict[str, float] = field(default_factory=dict)  # Ray's names: {"GPU": 1, "CPU": 1}
    node: str | None = None  # from its NodeFacts
    host: str = ""
    sent: set[str] = field(default_factory=set)  # cell ids it stored
    unplaceable_since: float | None = None  # when no alive node could hold it (monotonic s)


def run_on_ray(
    plan: Plan,
    store: RunStore,
    events: RunEvents | None = None,
    *,
    address: str | None = None,
    cell_timeout_s: float = DEFAULT_CELL_TIMEOUT_S,
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
    cpus_per_server: float | None = None,
    notify: Callable[[str], None] | None = None,
) -> list[str]:
    """Run every unfinished cell of the plan on the Ray cluster at `address` (None: RAY_ADDRESS, the
    cluster last started here, else a new local one) into `store`; returns the problems that produced
    no cell (a search that found no value), as runner.run_plan does."""
    ray = import_ray()
    say = notify or (lambda line: print(line, file=sys.stderr))
    connected_here = not ray.is_initialized()
    if connected_here:
        ray.init(address=address or None, log_to_driver=False, include_dashboard=False)
    try:
        if plan.matrix.matrix.linkbw:
            say("benchsuite: linkbw: not measured under --ray (a link is one machine's); run `benchsuite linkbw` there")
        driver = Driver(plan, store, events or SilentEvents(), say)
        timeouts = Timeouts(cell_timeout_s, request_timeout_s)
        return driver.run(ray, timeouts, cpus_per_server or smallest_node_cpus(ray))
    finally:
        store.rebuild_tables()
        if connected_here:
            ray.shutdown()


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise UserError(INSTALL_HINT) from None
    return ray


def smallest_node_cpus(ray: Any) -> float:
    """The CPUs of the smallest alive node that has any (the head of a test cluster may have none)."""
    cpus = [n["Resources"].get("CPU", 0.0) for n in ray.nodes() if n.get("Alive")]
    return min((c for c in cpus if c > 0), default=1.0)


def task_resources(spec: ServerSpec, cpus_per_server: float) -> dict[str, float]:
    """One GPU for a server whose engine runs on one (and a CPU for its load generator), else CPUs."""
    if ADAPTERS[spec.kind].needs_gpu(spec):
        return {"num_gpus": 1, "num_cpus": 1}
    return {"num_cpus": cpus_per_server}


class Driver:
    """The driver's side of the tasks: what they are, and each message they send written into the store."""

    def __init__(self, plan: Plan, store: RunStore, events: RunEvents, say: Callable[[str], None]) -> None:
        self.plan, self.store, self.events, self.say = plan, store, events, say
        self.cells = {c.cell_id: c for c in plan.cells}
        self.problems: list[str] = []
        self.source = read_manifest(store.run_dir).git

    def works(self) -> list[Work]:
        out = []
        for spec, cells in server_rounds(self.plan):
            todo = tuple(c for c in cells if not self.store.finished(c.cell_id))
            if todo:
                out.append(Work(spec, todo))
        stored = [r for r in read_cells(self.store.run_dir) if r.status in FINISHED_STATUSES]
        for task in self.plan.searches:
            mine = tuple(r for r in stored if r.engine == task.spec.name)
            out.append(Work(task.spec, search=task, stored=mine))
        return out

    def run(self, ray: Any, timeouts: Timeouts, cpus_per_server: float) -> list[str]:
        remote = ray.remote(measure_work)
        plan_ref = ray.put(self.plan)
        manifest_ref = ray.put(read_manifest(self.store.run_dir))
        tasks: dict[Any, Submitted] = {}
        for work in self.works():
            options = task_resources(work.spec, cpus_per_server)
            # max_retries=0: a lost node fails its cells here, with a reason; a rerun measures them
            gen = remote.options(**options, max_retries=0, name=f"benchsuite {work.spec.name}").remote(
                plan_ref, manifest_ref, work, timeouts
            )
            tasks[gen] = Submitted(work, {_RAY_NAMES[k]: v for k, v in options.items()})
            self.events.server_starting(work.spec, len(work.cells))
        try:
            self._drain(ray, tasks, deadline=None)
        except KeyboardInterrupt:
            for gen in tasks:
                ray.cancel(gen)
            self.say(f"benchsuite: interrupted; stopping {len(tasks)} Ray tasks and their servers")
            self._drain(ray, tasks, deadline=time.monotonic() + STOP_GRACE_S, cancelled=True)
            raise
        return self.problems

    def _drain(self, ray: Any, tasks: dict[Any, Submitted], deadline: float | None, cancelled: bool = False) -> None:
        """Write every message as it arrives until every task has ended (or the deadline passed)."""
        checked = time.monotonic()
        while tasks and (deadline is None or time.monotonic() < deadline):
            if not cancelled and time.monotonic() - checked >= _PLACE_CHECK_S:
                checked = time.monotonic()
                self.fail_unplaceable(ray, tasks, checked)
            ready, _ = ray.wait(list(tasks), num_returns=1, timeout=_WAIT_S)
            for gen in ready:
                task = tasks[gen]
                try:
                    message = ray.get(next(gen))
                except StopIteration:
                    del tasks[gen]
                    continue
                except ray.exceptions.RayError as exc:
                    del tasks[gen]
                    if not cancelled:
                        self._lost(task, exc)
                    continue
                self.write(task, message)

    def write(self, task: Submitted, message: Message) -> None:
        """One message of a task into the store (the only writer of the run)."""
        store = self.store
        if isinstance(message, NodeFacts):
            task.node, task.host = message.node, f"{message.hostname} ({message.address})"
            self._record_node(message)
        elif isinstance(message, ServerFacts):
            store.record_server(message.server_id, **message.facts, node=task.node)
        elif isinstance(message, PlannedMore):
            store.record_planned(message.planned)
        elif isinstance(message, EngineMetrics):
            store.write_engine_metrics(message.cell_id, message.scrapes)
        elif isinstance(message, CellStored):
            store.write_cell(message.result, message.records)
            task.sent.add(message.result.cell_id)
            cell = self.cells.get(message.result.cell_id)
            if cell is not None:  # a search's cells are not in the plan; the progress counts planned ones
                self.events.cell_started(cell)
                self.events.cell_finished(cell, message.result)
        elif isinstance(message, CellUpdated):
            store.update_cell(message.result)
        elif isinstance(message, SearchFailed):
            store.record_server(message.server_id, search_error=message.message)
            self.problems.append(message.message)
        elif isinstance(message, ServerFiles):
            for relative, data in message.files.items():
                store.write_server_file(relative, data)

    def _record_node(self, message: NodeFacts) -> None:
        manifest = read_manifest(self.store.run_dir)
        if message.node in manifest.nodes:
            return
        facts = {"hostname": message.hostname, "address": message.address, **message.facts}
        self.store.record_run(nodes={**manifest.nodes, message.node: facts})
        theirs, mine = (message.facts.get("git") or {}).get("tree"), self.source.tree
        if theirs and mine and theirs != mine:
            self.say(
                f"benchsuite: node {message.hostname} ({message.address}) runs other benchsuite source than this "
                f"driver (tree {theirs[:12]} vs {mine[:12]}); its cells are measured by that code"
            )

    def fail_unplaceable(self, ray: Any, tasks: dict[Any, Submitted], now: float) -> None:
        """Tasks not started that no alive node can hold (a GPU server on a cluster without GPUs, the only
        node with GPUs gone) fail after UNPLACEABLE_S: Ray would keep them pending for ever, in case an
        autoscaler adds a node, which that wait leaves time for."""
        alive = [n.get("Resources") or {} for n in ray.nodes() if n.get("Alive")]
        for gen, task in list(tasks.items()):
            if task.node is not None or any(all(r.get(k, 0.0) >= v for k, v in task.resources.items()) for r in alive):
                task.unplaceable_since = None
                continue
            task.unplaceable_since = task.unplaceable_since or now
            if now - task.unplaceable_since < UNPLACEABLE_S:
                continue
            ray.cancel(gen)
            del tasks[gen]
            want = ", ".join(f"{v:g} {k}" for k, v in task.resources.items())
            self._fail(task, f"no alive node of the Ray cluster has {want} (waited {UNPLACEABLE_S:g} s)")

    def _lost(self, task: Submitted, exc: Exception) -> None:
        """A task that ended in an error: its unsent cells fail with the reason (a rerun measures them).
        An exception raised by our code on the node (RayTaskError) is named by its cause; anything else
        (the node died, its worker crashed, the object was lost) means the task was lost with its node."""
        where = f"node {task.host} [{task.node[:12]}]" if task.node else "a node that never reported"
        cause = getattr(exc, "cause", None)
        if isinstance(cause, BaseException):
            self._fail(task, f"Ray task failed on {where}: {_one_line(cause)}")
        else:
            self._fail(task, f"Ray task lost on {where}: {_one_line(exc)}")

    def _fail(self, task: Submitted, reason: str) -> None:
        self.say(f"benchsuite: {reason}")
        work = task.work
        if work.search is not None:
            self.store.record_server(work.spec.server_id, search_error=reason)
            self.problems.append(f"engine {work.spec.name}: {reason}")
            return
        for cell in work.cells:
            if cell.cell_id in task.sent or self.store.finished(cell.cell_id):
                continue
            result = cell_identity(self.plan.run_id, work.spec, cell, task.node)
            failed = dataclasses.replace(result, status="failed", reason=reason)
            self.store.write_cell(failed, [])
            self.events.cell_started(cell)
            self.events.cell_finished(cell, failed)


def _one_line(exc: BaseException) -> str:
    """The exception's type and first line, cut at its first sentence when long (Ray's node errors go
    on with advice on finding the node's logs)."""
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    first = lines[0]
    if len(first) > _LONG_LINE and ". " in first:
        first = first.split(". ", 1)[0]
    return f"{type(exc).__name__}: {first}"
