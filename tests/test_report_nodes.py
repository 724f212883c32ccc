"""A run spread over several machines (`run --ray`): the report groups its cells by node, and its first
screen says when a setup's ratios compare cells measured on different kinds of machine."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pandas as pd

from benchsuite.report import write_report
from benchsuite.report.nodes import TITLE, mixed_machines_caveat
from benchsuite.tools.machine import machine_kind

FIXTURE = Path(__file__).parent / "data" / "report_fixture"
NODE_A, NODE_B = "a" * 56, "b" * 56
H200 = {"name": "NVIDIA H200", "vram_bytes": 141 * 2**30}
MACHINE = {
    "hostname": "gpu-1",
    "address": "10.0.0.1",
    "cpu_model": "EPYC 9654",
    "cpu_cores_logical": 16,
    "gpus": [H200],
}


def _spread(tmp_path: Path, second: dict[str, Any]) -> Path:
    """The report fixture with its servers alternately on two nodes, the second node's machine `second`."""
    run = tmp_path / "run"
    shutil.copytree(FIXTURE, run)
    cells = pd.read_parquet(run / "cells.parquet")
    servers = list(dict.fromkeys(cells["server_id"]))
    on = {s: NODE_A if i % 2 == 0 else NODE_B for i, s in enumerate(servers)}
    cells["node"] = [on[s] for s in cells["server_id"]]
    cells.to_parquet(run / "cells.parquet", index=False)
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["nodes"] = {NODE_A: MACHINE, NODE_B: {**MACHINE, "hostname": "gpu-2", "address": "10.0.0.2", **second}}
    (run / "manifest.json").write_text(json.dumps(manifest))
    return run


def test_machine_kind_is_the_cpu_its_cores_and_each_gpu() -> None:
    assert machine_kind(MACHINE) == "EPYC 9654 x16, NVIDIA H200 141 GiB"
    assert machine_kind({**MACHINE, "gpus": [H200] * 8}) == "EPYC 9654 x16, 8 x NVIDIA H200 141 GiB"
    assert machine_kind({"cpu_model": "Xeon", "cpu_cores_logical": 2, "gpus": []}) == "Xeon x2, no GPU"


def test_one_kind_of_machine_is_grouped_by_node_without_a_caveat(tmp_path: Path) -> None:
    page = write_report([_spread(tmp_path, {})], tmp_path / "out").read_text()
    assert TITLE in page and "gpu-1 [aaaaaaaa]" in page and "gpu-2 [bbbbbbbb]" in page
    assert "different kinds of machine (" not in page


def test_ratios_across_kinds_of_machine_are_named_on_the_first_screen(tmp_path: Path) -> None:
    other = {"gpus": [{"name": "NVIDIA RTX 4070 Laptop", "vram_bytes": 8 * 2**30}]}
    page = write_report([_spread(tmp_path, other)], tmp_path / "out").read_text()
    first_screen = page[page.index('<section id="verdict">') :]
    first_screen = first_screen[: first_screen.index("</section>")]
    assert "Measured on different kinds of machine" in first_screen
    assert "NVIDIA RTX 4070 Laptop 8 GiB" in first_screen and "NVIDIA H200 141 GiB" in first_screen


def test_a_run_on_one_machine_has_no_nodes_section_and_no_caveat(tmp_path: Path) -> None:
    page = write_report([FIXTURE], tmp_path / "out").read_text()
    assert TITLE not in page and "different kinds of machine" not in page
    cells = pd.DataFrame({"node": [None, None], "engine": ["a", "b"]})
    assert mixed_machines_caveat(cells, {}) is None
