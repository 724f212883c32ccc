"""The n_cpu_moe search through `benchsuite run`, against the fake engine of test_runner with a
scripted memory projection: values the projection rules out are recorded with it in the manifest
and the summary, never stored as cells; `--dry-run` prints the search's command template."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from test_runner import FakeAdapter, cells, matrix, only_run_dir

from benchsuite.cli import main
from benchsuite.engines.llamacpp.fit import Projection

GB = 10**9
CANDIDATES = range(6)  # N = 0 and 1 project 12 and 11 GB + the 1 GiB margin against a 12 GB budget: ruled out
MARGIN = 2**30


class SearchableFake(FakeAdapter):
    def vram_budget_bytes(self, spec: Any) -> int:
        return 12 * GB

    def projections(self, spec: Any, settings: Any) -> dict[int, Projection]:
        return {n: Projection(n, (12 - n) * GB, 0, 0, n * GB, "scripted") for n in CANDIDATES}


@pytest.fixture(autouse=True)
def searchable_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    from benchsuite.engines import ADAPTERS

    monkeypatch.setitem(ADAPTERS._loaded, "builtin", SearchableFake())  # type: ignore[attr-defined]


def test_ruled_out_values_are_not_cells_but_the_summary_names_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = matrix(tmp_path, {"s": {"label": "search"}}, concurrency=[1], num_requests=2)
    assert main(["run", str(path), "--no-report"]) == 0
    out = capsys.readouterr().out
    run_dir = only_run_dir(tmp_path)
    stored = [p["cell"] for p in cells(run_dir).values()]
    searched = {c["extras"]["search_n"]: c for c in stored if "search_n" in c["extras"]}
    assert searched and min(searched) == 2  # the search starts at the smallest fitting N
    assert all(c["status"] == "ok" for c in stored)  # no invalid "0/1" cell for N = 0 or 1
    manifest = json.loads((run_dir / "manifest.json").read_text())
    (record,) = [s["search"] for s in manifest["servers"].values() if "candidates" in (s["search"] or {})]
    outcomes = {c["n"]: c["outcome"] for c in record["candidates"]}
    assert outcomes[0] == outcomes[1] == "ruled out" and {outcomes[n] for n in searched} == {"measured"}
    assert {outcomes[n] for n in set(range(2, 6)) - set(searched)} <= {"not launched"}
    assert [c["projected_bytes"] for c in record["candidates"][:2]] == [12 * GB + MARGIN, 11 * GB + MARGIN]
    assert record["objective_cell"] == {"workload": "w", "prompt_class": "short", "concurrency": 1}
    assert (
        "ruled out by the scripted projection, never launched: N=0-1 "
        "(projected 12.07-13.07 GB with the margin > 12.00 GB)" in out
    )
    assert f"best N={record['best_n']}" in out and "0/1" not in out


def test_dry_run_prints_the_search_command_template(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = matrix(tmp_path, {"s": {"label": "search"}}, concurrency=[1, 2], num_requests=2)
    assert main(["run", str(path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "search s: label is searched" in out
    assert "--serve --port 8000" in out
    assert (
        "({N}: each candidate the memory projection lets through; one cell per launch: "
        "workload=w class=short concurrency=2)" in out
    )
