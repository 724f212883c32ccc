"""`benchsuite run`'s progress (benchsuite.commands.run_progress): cells done of the total, elapsed and
time left from the cells measured so far, one line per finished cell when the output is a log, and a
failed start shown by the log's last line rather than by a header."""

from __future__ import annotations

import dataclasses
import io

from rich.console import Console

from benchsuite.commands.run_progress import Eta, ProgressEvents, clock_text, outcome
from benchsuite.config.plan import CellSpec
from benchsuite.config.schema import Workload
from benchsuite.records import CellResult


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_time_left_comes_from_the_cells_measured_so_far() -> None:
    clock = FakeClock()
    eta = Eta(total=10, clock=clock)
    assert eta.text() == "0/10 cells, 0s"  # nothing measured: no estimate
    eta.start()
    clock.now += 30.0
    eta.finish_one()
    clock.now += 30.0
    eta.finish_one()  # 2 cells in 60 s: 8 left at 30 s each
    assert eta.left_s == 240.0
    assert eta.text() == "2/10 cells, 1m00s, ~4m00s left"
    for _ in range(9):  # a search adds cells as it goes: the total follows
        eta.finish_one()
    assert (eta.done, eta.total, eta.left_s) == (11, 11, 0.0)


def test_clock_text() -> None:
    assert [clock_text(s) for s in (9, 65, 3725)] == ["9s", "1m05s", "1h02m"]


def _cell(repeat: int) -> CellSpec:
    return CellSpec(f"c{repeat}", "s1", "paged", {"resident_experts": 8}, "chat", Workload(), "short", 1, repeat)


def _result(cell: CellSpec, status: str = "ok", reason: str | None = None) -> CellResult:
    return CellResult(
        cell_id=cell.cell_id, run_id="r", engine=cell.engine, engine_kind="builtin", mode="paged",
        server_id=cell.server_id, params=dict(cell.params),
        workload=cell.workload, prompt_class=cell.prompt_class, concurrency=cell.concurrency, repeat=cell.repeat,
        status=status, reason=reason, decode_tok_s_p50=123.45 if status == "ok" else None,
    )  # fmt: skip


def test_a_log_gets_one_line_per_cell_with_the_counter_and_time_left() -> None:
    out = io.StringIO()
    console = Console(file=out, width=200, force_terminal=False)  # a log: no live line
    clock = FakeClock()
    with ProgressEvents(console, 3, clock=clock) as events:
        for repeat in range(2):
            cell = _cell(repeat)
            events.cell_started(cell)
            clock.now += 20.0
            events.cell_finished(cell, _result(cell))
    lines = out.getvalue().splitlines()
    assert lines == [
        "[1/3 cells, 20s, ~40s left] ok      paged resident_experts=8 chat/short c=1 r=0  decode 123.5 tok/s",
        "[2/3 cells, 40s, ~20s left] ok      paged resident_experts=8 chat/short c=1 r=1  decode 123.5 tok/s",
    ]


def test_a_server_that_died_at_start_shows_its_logs_last_line() -> None:
    reason = (
        "engine did not start: engine exited with code 1 while starting; log logs/s1.log, last lines:\n"
        "Loading model\n"
        "RuntimeError: Found no NVIDIA driver on your system.\n"
    )
    cell = _cell(0)
    text = outcome(_result(cell, "failed", reason))
    assert text.endswith("last lines: ... RuntimeError: Found no NVIDIA driver on your system.")
    assert outcome(_result(cell, "failed", "one line")) == "one line"


def test_a_cell_of_several_streams_says_its_all_streams_rate_first() -> None:
    """At c>=2 the line leads with the report's figure (all streams' decode-phase aggregate): h200-paged16's
    log said 'decode 29.7 tok/s' for a cell whose streams decoded 104.7 tok/s together."""
    cell = _cell(0)
    four = dataclasses.replace(_result(cell), concurrency=4, decode_agg_tok_s=104.66, decode_tok_s_p50=29.7)
    assert outcome(four) == "decode 104.7 tok/s all streams (29.7 one stream's median)"
    assert outcome(_result(cell)) == "decode 123.5 tok/s"


def test_a_search_s_final_cells_are_in_the_total_from_the_start(tmp_path) -> None:
    """The H200 headline run showed '~0s left' for ten minutes while three searches still had to run
    their 24 final cells: those cells count from the start, less the ones a resumed run stored (per
    search: one engine's searches at other swept values, its fixed values, probes and failed cells
    are not that search's stored finals)."""
    from benchsuite.commands.run import searched_cells_left
    from benchsuite.config.matrix import load_matrix
    from benchsuite.config.plan import build_plan
    from benchsuite.run.runner import open_store

    path = tmp_path / "m.yaml"
    path.write_text(
        "name: s\nengines:\n  e:\n    kind: builtin\n"
        "    options: {model: tiny, mode: paged, resident_experts: [search, 8], cpu_threads: [1, 2]}\n"
        "  r:\n    kind: builtin\n    options: {model: tiny, mode: resident}\n"
        "workloads:\n  a: {prompt_classes: [short, '64'], concurrency: [1, 2], num_requests: 1}\nrepeats: 2\n"
    )
    plan = build_plan(load_matrix(path))
    fixed_server = next(s.server_id for s in plan.servers if s.name == "e")
    store = open_store(plan, tmp_path / "results")
    try:
        # 2 searches (cpu_threads 1 and 2), 8 final cells each; the fixed K=8 and resident cells are planned
        assert len(plan.searches) == 2 and len(plan.cells) == 3 * 8
        assert searched_cells_left(plan, store) == 16

        def stored(cell_id: str, params: dict, status: str = "ok", server: str = "chosen") -> CellResult:
            return CellResult(cell_id=cell_id, run_id=plan.run_id, engine="e", engine_kind="builtin", mode="paged",
                              server_id=server, params=params, workload="a", prompt_class="short", concurrency=1,
                              repeat=0, status=status)  # fmt: skip

        for cell in (
            stored("probe", {"resident_experts": 40, "cpu_threads": 1, "search_n": 40}),  # a probe
            stored("failed", {"resident_experts": 40, "cpu_threads": 1}, status="failed"),  # runs again
            stored("fixed", {"resident_experts": 8, "cpu_threads": 1}, server=fixed_server),  # a planned cell
        ):
            store.write_cell(cell, [])
        assert searched_cells_left(plan, store) == 16
        store.write_cell(stored("final-1", {"resident_experts": 40, "cpu_threads": 1}), [])
        store.write_cell(stored("final-2", {"resident_experts": 40, "cpu_threads": 1}), [])
        assert searched_cells_left(plan, store) == 14  # the cpu_threads=1 search's, not the other's
        store.write_cell(stored("final-3", {"resident_experts": 36, "cpu_threads": 2}, status="invalid"), [])
        assert searched_cells_left(plan, store) == 13
    finally:
        store.close()


def test_a_cell_warms_every_stream_at_once() -> None:
    """warmup_requests is a minimum raised to the cell's concurrency (h200-ttft's resident c=4 stalled 3.4 s on
    its first four-prompt step after a one-request warm-up); 0 still means no warm-up."""
    assert [Workload(warmup_requests=1).warmups_at(c) for c in (1, 2, 4)] == [1, 2, 4]
    assert Workload(warmup_requests=6).warmups_at(4) == 6 and Workload(warmup_requests=0).warmups_at(4) == 0
