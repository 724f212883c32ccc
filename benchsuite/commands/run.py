"""`benchsuite run matrix.yaml`: validate, plan, run (resumable), summarize, report.

The library call is benchsuite.run.runner.run_plan (benchsuite.run.ray_run.run_on_ray with --ray);
this module only parses flags, checks what the plan needs from the machine
(benchsuite.config.checklist), draws the progress (benchsuite.commands.run_progress) and the
one-screen summary, and prints where the results and the HTML report are.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
from collections import defaultdict
from pathlib import Path

from rich.console import Console
from rich.table import Table

from benchsuite.commands.run_progress import ProgressEvents, params_text
from benchsuite.config import checklist
from benchsuite.config.matrix import MatrixError, load_matrix
from benchsuite.config.model_checks import missing_model
from benchsuite.config.plan import Plan, build_plan, format_plan, plan_cells, select
from benchsuite.errors import UserError, caused_by_interrupt
from benchsuite.interrupt import run_async
from benchsuite.load.dataset_check import dataset_problems
from benchsuite.records import CellResult
from benchsuite.results.manifest import Manifest
from benchsuite.results.store import FINISHED_STATUSES, RunStore
from benchsuite.results.stored_files import read_cells, read_manifest
from benchsuite.run import search
from benchsuite.run.search import describe

_RUN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("matrix", type=Path, help="matrix YAML file (see configs/quickstart.yaml)")
    parser.add_argument(
        "--dry-run", action="store_true", help="print the cells and engine command lines; start nothing"
    )
    parser.add_argument(
        "--run-id", help="results directory name (default: <matrix name>-<matrix hash>); reuse it to resume"
    )
    parser.add_argument(
        "--new-run",
        action="store_true",
        help="start a new run in the run directory: an earlier run there (of another matrix, "
        "other inputs, or a damaged manifest) is moved aside to <run-id>.replaced-<UTC time>",
    )
    parser.add_argument(
        "--output-root", type=Path, help="parent of the run directory (default: the matrix's output_root)"
    )
    parser.add_argument(
        "--cell-timeout-s",
        type=float,
        default=3600.0,
        help="last resort: fail a whole cell (its records lost) and stop using its server after this long",
    )
    parser.add_argument(
        "--request-timeout-s",
        type=float,
        default=600.0,
        help="fail one request after this long; the cell keeps its records (workloads' max_error_rate decides)",
    )
    parser.add_argument(
        "--ray",
        nargs="?",
        const="",
        metavar="ADDRESS",
        help="spread the servers over a Ray cluster (pip install 'benchsuite[ray]'): ADDRESS as ray.init takes it "
        "(host:port, ray://host:port, auto); without it RAY_ADDRESS, the cluster last started here, else a local "
        "one over this machine's GPUs; one task per server on one GPU (CPU engines: --ray-cpus), one store here",
    )
    parser.add_argument(
        "--ray-cpus",
        type=float,
        metavar="N",
        help="with --ray: the CPUs a server of a CPU engine asks for (default: every CPU of the smallest node)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress display (CI)")
    parser.add_argument("--no-report", action="store_true", help="do not write the HTML report at the end")
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="ENGINE[:OPTION=VALUE]",
        help="run only these servers of the matrix (repeatable), "
        "e.g. --only resident --only paged:resident_experts=32; "
        "the run id stays the matrix's, so a later run without --only measures the rest",
    )


def main(args: argparse.Namespace) -> int:
    if args.cell_timeout_s <= 0:
        raise UserError(f"--cell-timeout-s must be > 0, got {args.cell_timeout_s:g}")
    if args.request_timeout_s <= 0:
        raise UserError(f"--request-timeout-s must be > 0, got {args.request_timeout_s:g}")
    if args.ray_cpus is not None and args.ray_cpus <= 0:
        raise UserError(f"--ray-cpus must be > 0, got {args.ray_cpus:g}")
    if args.ray_cpus is not None and args.ray is None:
        raise UserError("--ray-cpus is for --ray runs")
    if args.run_id is not None and not _RUN_ID_RE.match(args.run_id):
        raise UserError(f"--run-id {args.run_id!r}: use letters, digits, '.', '_' and '-' only")
    # a dry run shows a matrix meant for another machine: unset variables stay ${NAME} placeholders
    plan = build_plan(load_matrix(args.matrix, placeholders=args.dry_run), run_id=args.run_id)
    if args.only:
        plan = select(plan, args.only)
    missing = missing_models(plan) + dataset_problems(plan)  # files here that cannot serve the plan
    env = checklist.environment(plan)
    if args.dry_run:
        print(format_plan(plan))
        print("\n".join(dry_run_sections(plan, missing, env)))
        return 0
    blocked = missing or any(line.check.missing for line in env)
    if blocked and args.ray is None:  # before the results directory exists
        raise MatrixError("\n".join(stop_lines(plan, missing, env)))
    if blocked:  # under --ray model paths, binaries and devices are the nodes': each node checks its own
        for problem in stop_lines(plan, missing, env):
            print(f"note: {problem} here; under --ray each node checks its own")
    from benchsuite.run.runner import open_store  # the load path; a dry run never needs it

    console = Console(quiet=args.quiet, highlight=False)
    if not console.is_terminal:
        console.width = max(console.width, 132)  # logs and CI: keep the summary table unwrapped
    store = open_store(plan, args.output_root, new_run=args.new_run)  # locked until closed
    try:
        return _run(args, plan, store, console)
    finally:
        store.close()


def searched_cells_left(plan: Plan, store: RunStore) -> int:
    """Cells the searches' chosen values still have to run (their ids are known only once a search
    has chosen): counted up front so the progress's time left does not read ~0s while searches wait.
    A search's one-cell probes of each value are not counted (how many it launches is its own). A
    stored final cell of a search: its engine's, finished (ok or invalid: a failed one runs again),
    with the searched option set and the search's other swept values, on no planned server."""
    planned = {s.server_id for s in plan.servers}
    stored = [
        c for c in read_cells(store.run_dir)
        if c.status in FINISHED_STATUSES and c.server_id not in planned
        and isinstance(c.params, dict) and "search_n" not in c.params
    ]  # fmt: skip
    left = 0
    for task in plan.searches:
        fixed = {k: v for k, v in task.params.items() if k != task.option}
        done = sum(
            1 for c in stored
            if c.engine == task.spec.name and task.option in c.params
            and all(c.params.get(k) == v for k, v in fixed.items())
        )  # fmt: skip
        left += max(0, len(plan_cells(plan.matrix, task.spec, task.params)) - done)
    return left


def _run(args: argparse.Namespace, plan: Plan, store: RunStore, console: Console) -> int:
    from benchsuite.run.runner import run_plan

    todo = sum(1 for c in plan.cells if not store.finished(c.cell_id))
    searched = searched_cells_left(plan, store)
    console.print(
        f"run {plan.run_id}: {len(plan.cells)} cells ({len(plan.cells) - todo} already done) -> {store.run_dir}"
        + (f", and {searched} after {len(plan.searches)} searches" if searched else "")
    )
    try:
        with ProgressEvents(console, todo + searched) as events:
            if args.ray is not None:
                from benchsuite.run.ray_run import run_on_ray

                problems = run_on_ray(
                    plan, store, events, address=args.ray or None, cell_timeout_s=args.cell_timeout_s,
                    request_timeout_s=args.request_timeout_s, cpus_per_server=args.ray_cpus,
                )  # fmt: skip
            else:
                problems = run_async(
                    run_plan(
                        plan,
                        store,
                        events,
                        cell_timeout_s=args.cell_timeout_s,
                        request_timeout_s=args.request_timeout_s,
                        search=search.run_search,
                    )
                )
    except BaseException as exc:  # Ctrl-C, or an error raised from it (errors.caused_by_interrupt)
        if not caused_by_interrupt(exc):
            raise
        print(f"benchsuite: interrupted; finished cells are kept in {store.run_dir} (rerun the same command to resume)")
        return 130
    results = read_cells(store.run_dir)  # search cells included
    console.print(summary_table(plan, results))
    for line in search_lines(read_manifest(store.run_dir)):
        console.print(line, markup=False, highlight=False, soft_wrap=True)
    print(f"results: {store.run_dir}")
    report_status = _write_report(args, store.run_dir)
    for problem in problems:
        print(f"benchsuite: {problem}")
    failed = sum(1 for r in results if r.status == "failed")
    if failed:
        print(f"benchsuite: {failed} cells failed (reasons in cells.csv); rerun the same command to retry them")
    return 1 if failed or problems else report_status


def stop_lines(plan: Plan, missing: list[str], env: list[checklist.EnvLine]) -> list[str]:
    """Why a run cannot start, one line each; a matrix some of whose engines could run is refused
    too (a partial run would look complete), with the `--only` that runs those."""
    lines = [*missing, *(line.text().removeprefix("missing: ") for line in env if line.check.missing)]
    runnable = checklist.runnable_without(plan, env)
    if runnable and any(line.check.missing for line in env):
        lines.append("the other engines can run alone: " + " ".join(f"--only {name}" for name in runnable))
    return lines


def dry_run_sections(plan: Plan, missing: list[str], env: list[checklist.EnvLine]) -> list[str]:
    """After the plan: what this machine lacks and has, the matrix's inputs, the run's size and
    duration, and the published figures it will be compared with."""
    unresolved = list(plan.matrix.unresolved)
    # a model option that is still a ${NAME} placeholder is listed once, as its unset variable
    models = [line for line in missing if "${" not in line]
    blocking = [*unresolved, *models, *(line.text().removeprefix("missing: ") for line in env if line.check.missing)]
    out = ["", "checklist (a run stops at every line marked missing):"]
    out += [f"  missing: {line}" for line in blocking]
    out += [f"  {line.text()}" for line in env if not line.check.missing]
    if not blocking and not env:
        out.append("  nothing beyond this package is needed")
    if unresolved:  # the run id hashes the resolved matrix: the placeholders give another one
        out.append(
            f"  note: run id {plan.run_id} is the placeholders'; the real run's follows from the variables' values"
        )
    inputs = plan.matrix.matrix.inputs
    if inputs:
        out.append("inputs (environment variables):")
        for name, what in inputs.items():
            value = os.environ.get(name)
            out.append(f"  {name}: {'set: ' + value if value else 'unset'}; {what}")
    size = checklist.estimate(plan)
    out.append(
        f"size: {size.cells} cells, {size.requests:,} requests (warmups included), "
        f"{size.output_tokens:,} output tokens"
        + (f"; about {checklist.duration_text(size.seconds)} {size.basis}" if size.seconds is not None else "")
    )
    published = checklist.published_lines(plan)
    if published:
        out.append("")
        out += published
    return out


def missing_models(plan: Plan) -> list[str]:
    """One line per server (or searched server) whose model path does not exist here."""
    lines = []
    for spec in [*plan.servers, *(task.spec for task in plan.searches)]:
        found = missing_model(spec.options)
        if found is not None:
            lines.append(f"{plan.matrix.source}: engines.{spec.name}.options.{found[0]}: {found[1]}")
    return list(dict.fromkeys(lines))


def _write_report(args: argparse.Namespace, run_dir: Path) -> int:
    if args.no_report:
        return 0
    try:
        from benchsuite.report import write_report
    except ImportError:
        return 0  # the report package is optional in this build
    try:
        index = write_report([run_dir])
    except Exception as exc:  # noqa: BLE001 - results are safe on disk; say why the report is missing
        print(f"benchsuite: the report failed ({type(exc).__name__}: {exc}); results are in {run_dir}")
        return 1
    print(f"report: {index}")
    return 0


def summary_table(plan: Plan, results: list[CellResult]) -> Table:
    """One row per server x workload x class x concurrency; medians over repeats. TTFT p50 in ms, decode tok/s
    as the report's verdict takes it (one stream's median at c=1, all streams' decode-phase aggregate at c>=2),
    output tok/s of the cell, expert miss rate; K = resident_experts, N = n_cpu_moe."""
    planned = {c.cell_id: i for i, c in enumerate(plan.cells)}  # server-major, as the matrix reads

    def order(r: CellResult) -> tuple[int, str, str, int, int]:
        search_n = r.params.get("search_n", -1) if isinstance(r.params, dict) else -1
        return (planned.get(r.cell_id, len(planned)), r.engine, r.prompt_class, int(search_n), r.concurrency)

    groups: dict[tuple[str, str, str, str, int], list[CellResult]] = defaultdict(list)
    for r in sorted(results, key=order):
        groups[(r.engine, params_text(r.params, short=True), r.workload, r.prompt_class, r.concurrency)].append(r)
    rows = []
    for (engine, params, workload, prompt_class, concurrency), cells in groups.items():
        ok = [r for r in cells if r.status == "ok"]
        rows.append((
            engine, params.strip(), workload, prompt_class, str(concurrency), f"{len(ok)}/{len(cells)}",
            _fmt(_median([r.ttft_p50_s for r in ok]), ".1f", scale=1000.0),
            _fmt(_median([r.decode_tok_s_p50 if r.concurrency <= 1 else r.decode_agg_tok_s for r in ok]), ".1f"),
            _fmt(_median([r.output_tok_s for r in ok]), ".1f"),
            _fmt(_median([r.miss_rate for r in ok]), ".3f"),
        ))  # fmt: skip
    columns = ["engine", "params", "workload", "class", "conc", "ok/n", "TTFT ms", "dec tok/s", "out tok/s", "miss"]
    # A column with one value for every row (one workload, one class) moves into the title.
    fixed = {i for i in (2, 3) if rows and len({row[i] for row in rows}) == 1}
    title = f"{plan.run_id}: medians over repeats" + "".join(f", {columns[i]} {rows[0][i]}" for i in sorted(fixed))
    caption = "dec tok/s: one stream's median at c=1, all streams' decode-phase aggregate at c>=2 (the report's)"
    table = Table(title=title, title_justify="left", caption=caption, caption_justify="left")
    keep = [i for i in range(len(columns)) if i not in fixed]
    for i in keep:
        # no value is ever cut or folded (K=8 and K=16 must not look alike): a column is at least as
        # wide as its longest value; only the headers wrap on a narrow terminal
        width = max((len(row[i]) for row in rows), default=1)
        table.add_column(columns[i], justify="left" if i <= 2 else "right", min_width=width, no_wrap=True)
    for row in rows:
        table.add_row(*(row[i] for i in keep))
    return table


def search_lines(manifest: Manifest) -> list[str]:
    """Each search of the run in words (benchsuite.run.search.describe): the choice, the measured
    candidates and those ruled out by the memory projection, which are not cells."""
    lines: list[str] = []
    for server in manifest.servers.values():
        if server.search is not None and server.search.candidates:
            lines.extend(describe(server.engine, server.search))
    return lines


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _fmt(value: float | None, spec: str, scale: float = 1.0) -> str:
    return "-" if value is None else format(value * scale, spec)
