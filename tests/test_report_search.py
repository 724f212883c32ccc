"""The report's search table: candidates the memory projection ruled out come from the manifest's
search record, with their projection, and are not failed or invalid cells."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from benchsuite.report import search_section
from benchsuite.report.build import build_report_data

FIXTURE = Path(__file__).parent / "data" / "report_fixture"
GB = 10**9


def test_ruled_out_candidates_are_rows_of_the_search_table_not_failures(tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(FIXTURE, run)
    manifest = json.loads((run / "manifest.json").read_text())
    projection = {"source": "llama-fit-params", "n_cpu_moe": 0}
    manifest["servers"]["s-llama-search"] = {"engine": "llama", "kind": "llamacpp", "search": {
        "budget_bytes": 8 * GB, "margin_bytes": 2**30, "launches": 2, "linear_scan_launches": 3,
        "objective_cell": {"workload": "bundled", "prompt_class": "short", "concurrency": 1},
        "candidates": [
            {"n": 0, "outcome": "ruled out", "projected_bytes": 9_500_000_000, "projection": projection, "value": None,
             "cell_id": None},
            {"n": 2, "outcome": "measured", "projected_bytes": 7 * GB, "projection": projection, "value": 46.0,
             "cell_id": "ll2-s1-r0"},
        ],
    }}  # fmt: skip
    (run / "manifest.json").write_text(json.dumps(manifest))
    data = build_report_data([run], reference_dirs=[FIXTURE / "reference"])
    search = data.tables[search_section.TITLE]
    ruled = search[search["status"] == "ruled out"]
    assert list(ruled["N"]) == [0] and list(ruled["projected_bytes"]) == [9_500_000_000]
    assert (
        ruled.iloc[0]["reason"] == "llama-fit-params projection 9.50 GB with the margin > budget 8.00 GB; not launched"
    )
    assert list(search["N"]) == [0, 1, 2, 2, 3]  # sorted by N; N=1 is the fixture's old-style cell
    failures = data.tables["Failed and invalid cells"]
    assert "ruled out" not in set(failures.get("status", []))
    (figure,) = [f for f in data.figures if f.anchor == "fig-search"]
    assert "" not in figure.cell_ids
