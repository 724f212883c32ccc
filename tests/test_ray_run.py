"""`benchsuite run --ray` on a local Ray cluster of two one-CPU worker nodes (ray.cluster_utils.Cluster):
the real built-in server on the generated tiny model, its servers spread over both nodes into one store
of the same shape as a plain run; a node killed mid-run fails its unsent cells with a reason and a rerun
completes them; Ctrl-C cancels the tasks, stops every engine and keeps what was stored."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml

from benchsuite.cli import main
from benchsuite.config.matrix import load_matrix
from benchsuite.config.plan import CellSpec, build_plan
from benchsuite.records import CellResult
from benchsuite.results.stored_files import read_cells, read_manifest
from benchsuite.run.context import SilentEvents
from benchsuite.run.runner import open_store, run_plan

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

pytestmark = pytest.mark.slow
OBJECT_STORE_BYTES = 80 * 2**20


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    """A head that runs nothing (no CPU) and two worker nodes of one CPU each: one server per node at a time."""
    head = {"num_cpus": 0, "object_store_memory": OBJECT_STORE_BYTES, "include_dashboard": False}
    c = Cluster(initialize_head=True, head_node_args=head)
    for _ in range(2):
        c.add_node(num_cpus=1, object_store_memory=OBJECT_STORE_BYTES)
    c.wait_for_nodes()
    yield c
    c.shutdown()


def _matrix(
    tmp_path: Path, model: Path, concurrency: list[int], repeats: int = 1, output_tokens: int = 8, requests: int = 3
) -> Path:
    """Two built-in servers on the tiny model, small cells (a few seconds each on a shared 2-core box)."""
    body = {
        "name": "raytiny",
        "output_root": str(tmp_path / "results"),
        "repeats": repeats,
        "repeat_order": "interleaved",
        "fairness": {"kv_capacity_tokens": 1024, "prefix_caching": False},
        "engines": {
            "resident": {"kind": "builtin", "options": {"model": str(model), "mode": "resident"}},
            "paged": {"kind": "builtin", "options": {"model": str(model), "mode": "paged", "resident_experts": 8}},
        },
        "workloads": {
            "bundled": {
                "dataset": "bundled", "prompt_classes": ["short"], "output_tokens": output_tokens,
                "concurrency": concurrency, "num_requests": requests, "warmup_requests": 1,
            }
        },
    }  # fmt: skip
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump(body))
    return path


def _engines_of(model: Path) -> list[psutil.Process]:
    """Engine processes serving this test's model (its path is unique to the session)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if "paged_experts.server" in cmdline and str(model) in " ".join(cmdline):
            found.append(proc)
    return found


def _assert_no_engines_left(model: Path, within_s: float = 20.0) -> None:
    deadline = time.monotonic() + within_s
    while _engines_of(model) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _engines_of(model) == []


def _run_on_ray(matrix: Path, cluster: Cluster, events: Any = None) -> tuple[list[str], Path]:
    from benchsuite.run.ray_run import run_on_ray

    plan = build_plan(load_matrix(matrix))
    store = open_store(plan)
    try:
        return run_on_ray(plan, store, events, address=cluster.address, notify=lambda line: None), store.run_dir
    finally:
        store.close()


def _payloads(run_dir: Path) -> dict[str, dict[str, Any]]:
    return {p.stem: json.loads(p.read_text()) for p in (run_dir / "cells").glob("*.json")}


def test_servers_spread_over_two_nodes_into_one_store_shaped_like_a_plain_run(
    cluster: Cluster, tiny_model_dir: Path, tmp_path: Path
) -> None:
    matrix = _matrix(tmp_path, tiny_model_dir, concurrency=[1], repeats=2)  # 4 tasks: 2 servers x 2 repeats
    code = main(["run", str(matrix), "--ray", cluster.address, "--quiet", "--no-report"])
    assert code == 0
    (run_dir,) = (tmp_path / "results").iterdir()
    plan = build_plan(load_matrix(matrix))
    cells = {c.cell_id: c for c in read_cells(run_dir)}
    assert set(cells) == {c.cell_id for c in plan.cells}
    assert all(c.status == "ok" for c in cells.values()), [c.reason for c in cells.values()]
    manifest = read_manifest(run_dir)
    workers = {n.node_id for n in cluster.worker_nodes}
    # every cell names the node that measured it; both nodes measured (two one-CPU nodes, four tasks)
    assert {c.node for c in cells.values()} == workers
    assert set(manifest.nodes) == workers
    assert all(manifest.nodes[n]["hostname"] and manifest.nodes[n]["cpu_cores_logical"] for n in workers)
    for server_id, server in manifest.servers.items():
        assert server.node in workers and server.argv and server.startup_s is not None
        # each launch's engine log shipped back from its node, appended as a local run's log grows
        assert (run_dir / "logs" / f"{server_id}.log").read_text().count("# benchsuite: starting") == 2
    # the same store as a plain run of the same plan: the same files per cell, the same fields
    plain_matrix = _matrix(tmp_path / "plain", tiny_model_dir, concurrency=[1], repeats=1)
    plain_plan = build_plan(load_matrix(plain_matrix))
    store = open_store(plain_plan)
    try:
        asyncio.run(run_plan(plain_plan, store))
    finally:
        store.close()
    plain, ours = _payloads(store.run_dir), _payloads(run_dir)
    shape = {(k, type(v).__name__) for p in plain.values() for k, v in p.items() if k != "written_utc"}
    assert shape == {(k, type(v).__name__) for p in ours.values() for k, v in p.items() if k != "written_utc"}
    # each server's one cell at c=1: 3 measured, 1 warm-up and the server's first request alone (cold)
    assert {len(p["requests"]) for p in ours.values()} == {len(p["requests"]) for p in plain.values()} == {5}
    assert {p.name for p in (run_dir / "engine_metrics").iterdir()} == {f"{c}.json" for c in cells}
    for name in ("cells.parquet", "cells.csv", "requests.parquet"):
        assert (run_dir / name).is_file()
    assert all(c.node is None for c in read_cells(store.run_dir))  # a plain run records no node
    _assert_no_engines_left(tiny_model_dir)


class _InterruptOnce(SilentEvents):
    """Raises KeyboardInterrupt (as Ctrl-C does in the driver) when the first cell arrives."""

    def __init__(self) -> None:
        self.arrived: list[CellResult] = []

    def cell_finished(self, cell: CellSpec, result: CellResult) -> None:
        self.arrived.append(result)
        if len(self.arrived) == 1:
            raise KeyboardInterrupt


def test_ctrl_c_cancels_the_tasks_stops_every_engine_and_keeps_what_was_stored(
    cluster: Cluster, tiny_model_dir: Path, tmp_path: Path
) -> None:
    matrix = _matrix(tmp_path, tiny_model_dir, concurrency=[1, 2, 3])
    events = _InterruptOnce()
    with pytest.raises(KeyboardInterrupt):
        _run_on_ray(matrix, cluster, events)
    _assert_no_engines_left(tiny_model_dir)
    (run_dir,) = (tmp_path / "results").iterdir()
    stored = read_cells(run_dir)
    assert events.arrived[0].cell_id in {c.cell_id for c in stored}
    assert all(c.status == "ok" for c in stored)  # cancelled cells are not stored as failures: a rerun measures them
    assert len(stored) < 6
    problems, _ = _run_on_ray(matrix, cluster)
    assert problems == [] and sorted(c.status for c in read_cells(run_dir)) == ["ok"] * 6


class _KillNodeOnFirstCell(SilentEvents):
    """Removes the node that sent the first cell, while its server still has cells to measure."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.killed: str | None = None

    def cell_finished(self, cell: CellSpec, result: CellResult) -> None:
        if self.killed is None and result.node is not None:
            (node,) = [n for n in self.cluster.worker_nodes if n.node_id == result.node]
            self.cluster.remove_node(node, allow_graceful=False)
            self.killed = result.node


def test_a_node_killed_mid_run_fails_its_unsent_cells_and_a_rerun_completes_them(
    cluster: Cluster, tiny_model_dir: Path, tmp_path: Path
) -> None:
    # runs last: it leaves the cluster one worker node short. Cells of seconds each (64 tokens x 4
    # requests): on a quiet machine 8-token cells all finished before the driver removed the node.
    matrix = _matrix(tmp_path, tiny_model_dir, concurrency=[1, 2, 3], output_tokens=64, requests=4)
    events = _KillNodeOnFirstCell(cluster)
    problems, run_dir = _run_on_ray(matrix, cluster, events)
    assert problems == [] and events.killed is not None
    cells = read_cells(run_dir)
    lost = [c for c in cells if c.status == "failed"]
    assert lost, "the killed node's server had cells left"
    for cell in lost:
        assert cell.node == events.killed and "Ray task lost on node" in (cell.reason or "")
    assert len([c for c in cells if c.status == "ok"]) >= 4  # the other node's server, and the first cell
    _assert_no_engines_left(tiny_model_dir)
    problems, _ = _run_on_ray(matrix, cluster)
    cells = {c.cell_id: c for c in read_cells(run_dir)}
    assert problems == [] and sorted(c.status for c in cells.values()) == ["ok"] * 6
    survivors = {n.node_id for n in cluster.worker_nodes}
    assert all(cells[c.cell_id].node in survivors for c in lost)  # measured again, on the node left
    assert all((run_dir / "attempts" / f"{c.cell_id}.1.json").is_file() for c in lost)  # the failure kept
