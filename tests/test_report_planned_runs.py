"""What a run planned and never measured, through real runs: `benchsuite run` against the fake engine of
test_runner (a budget search against test_search_run's scripted projection), stopped by an interrupt
raised where the runner measures a cell or runs a search, then `write_report` on the run directory.
The manifest's `planned` gains each resumed invocation's plan (`--only a`, then `--only b`) and a search's
chosen server and cells; the header counts what no invocation measured, a search that never chose is said."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from test_runner import cells, matrix, only_run_dir, run_cli
from test_search_run import SearchableFake

from benchsuite.report import write_report


@pytest.fixture(autouse=True)
def searchable_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    from benchsuite.engines import ADAPTERS

    monkeypatch.setitem(ADAPTERS._loaded, "builtin", SearchableFake())  # type: ignore[attr-defined]


def stop_after(monkeypatch: pytest.MonkeyPatch, measured: int) -> None:
    """The run is interrupted as it starts the cell after `measured` more cells (a Ctrl-C there)."""
    from benchsuite.run import runner

    real = runner.measure_cell
    done: list[int] = []

    async def measure_or_stop(*args: Any, **kwargs: Any) -> Any:
        if len(done) == measured:
            raise KeyboardInterrupt
        done.append(1)
        return await real(*args, **kwargs)

    monkeypatch.setattr(runner, "measure_cell", measure_or_stop)


def header(run_dir: Path, tmp_path: Path) -> tuple[list[str], list[str]]:
    """(the engine lines of tables.md's header, its "Not shown" lines) of the run's report."""
    index = write_report([run_dir], tmp_path / "report")
    md = (index.parent / "tables.md").read_text().splitlines()
    start = next(i for i, line in enumerate(md) if line.startswith("- builtin:"))
    end = md.index("", start)
    not_shown = md[md.index("## Not shown") :] if "## Not shown" in md else []
    return md[start:end], not_shown


def planned(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "manifest.json").read_text())["planned"]


def test_a_later_invocation_with_other_selectors_plans_its_cells_and_a_stop_before_them_is_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = matrix(tmp_path, {"a": {}, "b": {"label": [1, 2]}}, concurrency=[1, 2], num_requests=2)
    assert run_cli(str(path), "--only", "a") == 0
    run_dir = only_run_dir(tmp_path)
    first = planned(run_dir)
    assert len(first["cells"]) == 2 and len(first["servers"]) == 1
    with monkeypatch.context() as stopping:
        stop_after(stopping, 1)
        assert run_cli(str(path), "--only", "b") == 130  # one cell of b measured, then stopped
    record = planned(run_dir)
    assert record["cells"][:2] == first["cells"] and len(record["cells"]) == 6 == len(set(record["cells"]))
    assert list(record["servers"])[:1] == list(first["servers"]) and len(record["servers"]) == 3
    assert len(cells(run_dir)) == 3
    lines, not_shown = header(run_dir, tmp_path)
    why = "every invocation that planned them stopped before them"  # two invocations: the record merges both
    assert (
        lines[0]
        == f"- builtin: run (a, b): 3 ok cells, 0 failed or invalid, 3 of 6 planned cells not measured ({why})."
    )
    assert f"- b (builtin): 3 of its 4 planned cells not measured ({why})." in lines
    assert not_shown[-3:] == [
        f"- Planned cells not measured: 3 of the 6 cells run {run_dir.name} planned ({why}):",
        "  - b (fake) label=1 · workload w · prompt class short · concurrency 2 · repeat 0 (all 1)",
        "  - b label=2 · workload w · prompt class short · concurrency 1, 2 · repeat 0 (all 1)",
    ]
    assert run_cli(str(path), "--only", "b") == 0  # the rest: nothing planned is missing, nothing said
    assert planned(run_dir)["cells"] == record["cells"]  # planned again, not twice
    lines, not_shown = header(run_dir, tmp_path)
    assert lines[0] == "- builtin: run (a, b): 6 ok cells, 0 failed or invalid."
    assert not any(line.startswith("- Planned") for line in not_shown)


def test_a_stopped_run_finished_with_selectors_counts_what_it_never_selected_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = matrix(tmp_path, {"a": {}, "b": {}}, concurrency=[1, 2], num_requests=2)
    with monkeypatch.context() as stopping:
        stop_after(stopping, 1)
        assert run_cli(str(path)) == 130  # everything planned, one cell of a measured
    assert run_cli(str(path), "--only", "a") == 0  # a finished; b planned only by the stopped invocation
    run_dir = only_run_dir(tmp_path)
    lines, _ = header(run_dir, tmp_path)
    why = "every invocation that planned them stopped before them"  # true of b's: the second never planned them
    assert (
        lines[0] == f"- builtin: run (a): 2 ok cells, 0 failed or invalid, 2 of 4 planned cells not measured ({why})."
    )
    assert lines[-1] == "- b (builtin): named by the matrix but has no results (not run)."


def search_matrix(tmp_path: Path) -> Path:
    """A plain engine `a`, and `s`, whose label a search chooses (test_search_run's projection)."""
    return matrix(tmp_path, {"a": {}, "s": {"label": "search"}}, concurrency=[1, 2], num_requests=2)


def test_a_search_the_run_stopped_in_is_said_with_its_cells_never_planned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import benchsuite.run.search

    async def interrupted(ctx: Any, task: Any) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(benchsuite.run.search, "run_search", interrupted)
    assert run_cli(str(search_matrix(tmp_path))) == 130
    run_dir = only_run_dir(tmp_path)
    lines, not_shown = header(run_dir, tmp_path)
    assert lines[0] == "- builtin: run (a): 2 ok cells, 0 failed or invalid."  # every planned cell measured
    assert lines[1:] == [
        "- llamacpp: NOT RUN. These results contain no llamacpp cell; nothing in this report describes llamacpp.",
        "- sglang: NOT RUN. These results contain no sglang cell; nothing in this report describes sglang.",
        f"- run {run_dir.name}: 1 planned search not finished (s: label search): its cells were never planned "
        "(the run stopped before it chose a value).",
        "- s (builtin): named by the matrix but has no results (not run).",
    ]
    assert not_shown[-2:] == [
        f"- Planned searches that chose no value: 1 of the 1 searches run {run_dir.name} planned, so the cells "
        "of the value each would choose were never planned:",
        "  - s: label search: not finished (the run stopped before it chose a value)",
    ]


def test_a_resolved_searchs_cells_are_planned_and_its_launches_counted_on_both_sides(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from benchsuite.run import runner

    real = runner.resolve_search

    def resolve_then_stop(*args: Any) -> Any:  # the search chose: the run stops at its value's first cell
        stop_after(monkeypatch, 0)
        return real(*args)

    monkeypatch.setattr(runner, "resolve_search", resolve_then_stop)
    assert run_cli(str(search_matrix(tmp_path))) == 130
    run_dir = only_run_dir(tmp_path)
    stored = [c["cell"] for c in cells(run_dir).values()]
    launches = sum(1 for c in stored if "search_n" in c["extras"])
    assert launches >= 1 and len(stored) == 2 + launches  # a's cells and the search's launches
    record = planned(run_dir)
    (search,) = record["searches"]
    (server,) = [s for s in record["servers"].values() if s.get("search_of")]
    assert server["search_of"] == search["server_id"] and server["engine"] == search["engine"] == "s"
    assert len(record["cells"]) == 4  # a's 2, and the chosen value's 2 (launches: never in the record)
    lines, not_shown = header(run_dir, tmp_path)
    ok, launched = 2 + launches, f"({launches} of them search launches)"
    why = "the run stopped before them"  # one invocation
    assert lines[0] == (
        f"- builtin: run (a, s): {ok} ok cells, 0 failed or invalid, 2 of {ok + 2} planned cells {launched} "
        f"not measured ({why})."
    )
    assert lines[-1] == f"- s (builtin): 2 of its {launches + 2} planned cells {launched} not measured ({why})."
    best = server["params"]["label"]
    # named as its server's stored cells name it: the chosen value's launch ran on the same server id
    assert not_shown[-2:] == [
        f"- Planned cells not measured: 2 of the {ok + 2} cells run {run_dir.name} planned ({why}):",
        f"  - s (fake) label={best} (search) · workload w · prompt class short · concurrency 1, 2 · repeat 0 (all 1)",
    ]
