"""The parts of `benchsuite run --ray` that need no cluster: the flags, the resources a server asks
for, the missing-Ray hint, and a task on a node without the model's path (one line, every cell failed)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

from benchsuite.cli import main
from benchsuite.commands.run import search_lines
from benchsuite.config.matrix import load_matrix
from benchsuite.config.plan import build_plan
from benchsuite.errors import UserError
from benchsuite.results.stored_files import read_cells, read_manifest
from benchsuite.run import ray_task
from benchsuite.run.context import SilentEvents
from benchsuite.run.ray_run import Driver, Submitted, import_ray, task_resources
from benchsuite.run.ray_task import CellStored, NodeFacts, ServerFiles, Timeouts, Work, measure_work
from benchsuite.run.runner import open_store, server_rounds


def _matrix(tmp_path: Path, model: str, device: str = "cpu") -> Path:
    body = {
        "name": "rayparts",
        "output_root": str(tmp_path / "results"),
        "engines": {"paged": {"kind": "builtin", "options": {"model": model, "mode": "resident", "device": device}}},
        "workloads": {"w": {"dataset": "bundled", "prompt_classes": ["short"], "output_tokens": 4,
                            "concurrency": [1, 2], "num_requests": 2}},
    }  # fmt: skip
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump(body))
    return path


def test_a_cpu_engine_asks_for_cpus_and_a_cuda_one_for_a_gpu(tmp_path: Path) -> None:
    (cpu,) = build_plan(load_matrix(_matrix(tmp_path, "tiny"))).servers
    (cuda,) = build_plan(load_matrix(_matrix(tmp_path, "tiny", device="cuda"))).servers
    assert task_resources(cpu, 16.0) == {"num_cpus": 16.0}
    assert task_resources(cuda, 16.0) == {"num_gpus": 1, "num_cpus": 1}


def test_flags_are_checked_and_a_missing_ray_is_one_line_with_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    matrix = str(_matrix(tmp_path, "tiny"))
    assert main(["run", matrix, "--ray-cpus", "2"]) == UserError.exit_code
    assert main(["run", matrix, "--ray", "--ray-cpus", "0"]) == UserError.exit_code
    assert capsys.readouterr().err.splitlines() == [
        "benchsuite: error: --ray-cpus is for --ray runs",
        "benchsuite: error: --ray-cpus must be > 0, got 0",
    ]
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    with pytest.raises(UserError, match=r"pip install 'benchsuite\[ray\]'"):
        import_ray()


def test_a_node_without_the_model_path_fails_every_cell_in_one_line_naming_the_node(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    missing = tmp_path / "not-on-this-node"
    plan = build_plan(load_matrix(_matrix(tmp_path, str(missing))))
    facts = NodeFacts("n" * 56, "gpu-7", "10.0.0.7", {})
    monkeypatch.setattr(ray_task, "node_facts", lambda: facts)  # outside a Ray worker
    store = open_store(plan)
    try:
        ((spec, cells),) = server_rounds(plan)
        messages = list(measure_work(plan, read_manifest(store.run_dir), Work(spec, cells), Timeouts(60.0, 60.0)))
    finally:
        store.close()
    assert messages[0] == facts and isinstance(messages[-1], ServerFiles)
    stored = [m.result for m in messages if isinstance(m, CellStored)]
    assert sorted(r.cell_id for r in stored) == sorted(c.cell_id for c in cells)
    for result in stored:
        assert result.status == "failed" and result.node == facts.node
        assert str(missing) in (result.reason or "") and "on node gpu-7 (10.0.0.7)" in (result.reason or "")
        assert "\n" not in (result.reason or "")


@pytest.mark.slow
def test_a_search_runs_as_one_task_and_its_messages_make_the_store_a_local_search_makes(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The K search on the real built-in server, as a Ray task runs it (its body in this process) and
    the driver writes its messages: the candidates and the chosen K's cells stored, all on the node."""
    body = yaml.safe_load(_matrix(tmp_path, str(tiny_model_dir)).read_text())
    body["engines"]["paged"]["options"].update(mode="paged", resident_experts="search", vram_budget_gb=16.0)
    body["workloads"]["w"]["concurrency"] = [1]
    (tmp_path / "m.yaml").write_text(yaml.safe_dump(body))
    plan = build_plan(load_matrix(tmp_path / "m.yaml"))
    (task,) = plan.searches
    facts = NodeFacts("s" * 56, "gpu-3", "10.0.0.3", {"cpu_model": "test"})
    monkeypatch.setattr(ray_task, "node_facts", lambda: facts)
    store = open_store(plan)
    try:
        driver = Driver(plan, store, SilentEvents(), say=lambda line: None)
        (work,) = driver.works()
        assert work.search == task and work.cells == ()
        submitted = Submitted(work)
        for message in measure_work(plan, read_manifest(store.run_dir), work, Timeouts(120.0, 60.0)):
            driver.write(submitted, message)
        store.rebuild_tables()
    finally:
        store.close()
    assert driver.problems == []
    manifest = read_manifest(store.run_dir)
    assert manifest.nodes == {facts.node: {"hostname": "gpu-3", "address": "10.0.0.3", "cpu_model": "test"}}
    searched = manifest.servers[task.spec.server_id].search
    assert searched is not None and searched.best_n is not None and searched.candidates
    assert search_lines(manifest)  # the CLI's summary of the search reads it as it reads a local one
    cells = read_cells(store.run_dir)
    chosen = [c for c in cells if "search_n" not in c.params]
    assert [c.resident_experts for c in chosen] == [searched.best_n] and chosen[0].status == "ok"
    # the chosen K's server and cells joined the manifest's plan (a PlannedMore message), as a local run's do
    (planned,) = [s for s, p in manifest.planned.servers.items() if p.search_of == task.spec.server_id]
    assert chosen[0].server_id == planned and chosen[0].cell_id in manifest.planned.cells
    assert all(c.node == facts.node for c in cells)
    assert all(s.node == facts.node for s in manifest.servers.values())
    assert all((store.run_dir / s.log).is_file() for s in manifest.servers.values() if s.log)


class _CpuOnlyCluster:
    """What the driver asks of Ray to place a task: a cluster whose one alive node has CPUs only."""

    def __init__(self) -> None:
        self.cancelled: list[str] = []

    def nodes(self) -> list[dict[str, object]]:
        return [{"Alive": True, "Resources": {"CPU": 16.0}}, {"Alive": False, "Resources": {"CPU": 8.0, "GPU": 1.0}}]

    def cancel(self, gen: str) -> None:
        self.cancelled.append(gen)


def test_a_gpu_server_no_alive_node_can_hold_fails_its_cells_after_a_wait(tmp_path: Path) -> None:
    from benchsuite.run.ray_run import UNPLACEABLE_S

    plan = build_plan(load_matrix(_matrix(tmp_path, "tiny", device="cuda")))
    store = open_store(plan)
    said: list[str] = []
    try:
        driver = Driver(plan, store, SilentEvents(), say=said.append)
        (work,) = driver.works()
        tasks = {"gen": Submitted(work, {"GPU": 1.0, "CPU": 1.0})}
        ray = _CpuOnlyCluster()
        driver.fail_unplaceable(ray, tasks, now=100.0)
        driver.fail_unplaceable(ray, tasks, now=100.0 + UNPLACEABLE_S / 2)
        assert list(tasks) == ["gen"] and read_cells(store.run_dir) == []  # an autoscaler may still add a node
        driver.fail_unplaceable(ray, tasks, now=100.0 + UNPLACEABLE_S)
    finally:
        store.close()
    assert tasks == {} and ray.cancelled == ["gen"]
    cells = read_cells(store.run_dir)
    assert len(cells) == len(work.cells) and all(c.status == "failed" for c in cells)
    assert {c.reason for c in cells} == {
        f"no alive node of the Ray cluster has 1 GPU, 1 CPU (waited {UNPLACEABLE_S:g} s)"
    }
    assert said == [f"benchsuite: {cells[0].reason}"]
