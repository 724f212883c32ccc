"""Results store: atomic writes through the seam, versioned files, resume bookkeeping, tables."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from benchsuite.errors import RunError, UserError
from benchsuite.records import SCHEMA_VERSION, CellResult, RequestRecord
from benchsuite.results.manifest import Manifest, Planned, PlannedSearch, PlannedServer
from benchsuite.results.server_facts import CanaryResult
from benchsuite.results.store import RunStore, atomic_write_bytes
from benchsuite.results.stored_files import read_cells, read_manifest, read_requests

MANIFEST = Manifest(run_id="r", created_utc="2026-12-01T00:00:00+00:00", matrix_source="m.yaml", matrix_hash="abc",
                    matrix={}, machine={"hostname": "h"}, git={"commit": "c", "dirty": False})  # fmt: skip
FIXTURE_V1 = Path(__file__).parent / "data" / "results_v1"


def cell(cell_id: str = "c1", status: str = "ok", **kw) -> CellResult:
    return CellResult(
        cell_id=cell_id, run_id="r", engine="e", engine_kind="builtin", mode="paged", server_id="s1",
        params={"resident_experts": 4}, workload="w", prompt_class="short", concurrency=2, repeat=0,
        status=status, **kw,
    )  # fmt: skip


def request(cell_id: str = "c1", i: int = 0) -> RequestRecord:
    return RequestRecord(
        cell_id=cell_id, request_index=i, warmup=False, cold=i == 0, prompt_id=f"p{i}", prompt_class="short",
        max_tokens=8, t_sent_s=1.0, t_first_token_s=1.5, t_done_s=2.0, chunk_times_s=[1.5, 2.0],
        prompt_tokens=5, output_tokens=2, streamed_chunks=2, ok=True, engine_timings={"x": 1},
    )  # fmt: skip


def test_cells_round_trip_and_tables(tmp_path: Path) -> None:
    store = RunStore.open(tmp_path / "r", MANIFEST)
    store.write_cell(cell("c1", ttft_p50_s=0.5), [request("c1", 0), request("c1", 1)])
    store.write_cell(cell("c2", status="invalid", reason="no tokens"), [request("c2", 0)])
    store.write_engine_metrics("c1", {"before": {"a": 1.0}, "after": {"a": 3.0}})
    store.rebuild_tables()
    assert [c.cell_id for c in read_cells(store.run_dir)] == ["c1", "c2"]
    assert read_cells(store.run_dir)[0].params == {"resident_experts": 4}
    assert len(read_requests(store.run_dir)) == 3
    cells = pd.read_parquet(store.run_dir / "cells.parquet")
    assert list(cells["status"]) == ["ok", "invalid"] and cells["ttft_p50_s"].iloc[0] == 0.5
    assert json.loads(cells["params"].iloc[0]) == {"resident_experts": 4}
    assert list(pd.read_csv(store.run_dir / "cells.csv")["cell_id"]) == ["c1", "c2"]
    requests = pd.read_parquet(store.run_dir / "requests.parquet")
    assert list(requests["chunk_times_s"].iloc[0]) == [1.5, 2.0]
    assert read_manifest(store.run_dir).schema_version == SCHEMA_VERSION


def test_empty_run_still_has_typed_tables(tmp_path: Path) -> None:
    store = RunStore.open(tmp_path / "r", MANIFEST)
    store.rebuild_tables()
    assert "decode_tok_s_p50" in pd.read_parquet(store.run_dir / "cells.parquet").columns
    assert "t_first_token_s" in pd.read_parquet(store.run_dir / "requests.parquet").columns


def test_retry_keeps_the_failed_attempt(tmp_path: Path) -> None:
    store = RunStore.open(tmp_path / "r", MANIFEST)
    store.write_cell(cell(status="failed", reason="boom"), [])
    second = store.write_cell(cell(status="ok"), [request()])
    assert second.attempt == 2
    kept = json.loads((store.run_dir / "attempts" / "c1.1.json").read_text())
    assert kept["cell"]["reason"] == "boom"
    assert store.stored_cell("c1").result.status == "ok"


def test_resume_checks_matrix_and_schema(tmp_path: Path) -> None:
    RunStore.open(tmp_path / "r", MANIFEST)
    again = RunStore.open(tmp_path / "r", MANIFEST)
    assert len(read_manifest(again.run_dir).invocations) == 2
    with pytest.raises(UserError, match="different matrix; pass another --run-id"):
        RunStore.open(tmp_path / "r", MANIFEST.model_copy(update={"matrix_hash": "other"}))
    path = tmp_path / "r" / "manifest.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "schema_version": SCHEMA_VERSION + 1}))
    newer = f"schema version {SCHEMA_VERSION + 1}, this benchsuite reads versions 1, 2, 3: rerun"
    with pytest.raises(UserError, match=newer):
        read_manifest(tmp_path / "r")


def _planned(servers: list[str], cells: list[str], searches: list[PlannedSearch] | None = None) -> Planned:
    return Planned(servers={s: PlannedServer(engine="e", kind="builtin", params={}) for s in servers}, cells=cells,
                   searches=searches or [])  # fmt: skip


def test_each_resume_merges_its_plan_into_planned_in_first_seen_order(tmp_path: Path) -> None:
    old_search = PlannedSearch(engine="e", option="n_cpu_moe")  # a record from before server_id
    search = PlannedSearch(engine="e", option="n_cpu_moe", server_id="s9", params={"mode": "paged"})
    first = MANIFEST.model_copy(update={"planned": _planned(["s1"], ["c1", "c2"], [old_search])})
    RunStore.open(tmp_path / "r", first).close()
    later = MANIFEST.model_copy(update={"planned": _planned(["s2", "s1"], ["c3", "c1"], [search])})
    RunStore.open(tmp_path / "r", later).close()
    manifest = read_manifest(tmp_path / "r")
    assert len(manifest.invocations) == 2
    assert list(manifest.planned.servers) == ["s1", "s2"] and manifest.planned.cells == ["c1", "c2", "c3"]
    assert manifest.planned.searches == [search]  # the older form of the same search takes the one naming it
    store = RunStore.open(tmp_path / "r", first)
    store.record_planned(Planned(servers={"s3": PlannedServer(engine="e", kind="builtin", params={"n": 4},
                                                              search_of="s9")}, cells=["c4", "c3"]))  # fmt: skip
    store.close()
    planned = read_manifest(tmp_path / "r").planned
    assert planned.cells == ["c1", "c2", "c3", "c4"] and planned.servers["s3"].search_of == "s9"
    assert planned.searches == [search] and len(read_manifest(tmp_path / "r").invocations) == 3
    # a manifest from before `planned` gains the resumed invocation's plan: what it planned is known from here on
    bare = tmp_path / "bare"
    RunStore.open(bare, MANIFEST).close()
    path = bare / "manifest.json"
    path.write_text(json.dumps({k: v for k, v in json.loads(path.read_text()).items() if k != "planned"}))
    RunStore.open(bare, later).close()
    assert read_manifest(bare).planned == later.planned


def test_server_facts_are_typed_fields(tmp_path: Path) -> None:
    store = RunStore.open(tmp_path / "r", MANIFEST)
    store.record_server("s1", engine="e", argv=["serve", "--port", "1"])
    store.record_server("s1", canary={"passed": True})
    server = read_manifest(store.run_dir).servers["s1"]
    assert (server.engine, server.argv, server.canary) == ("e", ["serve", "--port", "1"], CanaryResult(passed=True))
    with pytest.raises(ValueError, match="argvv"):
        store.record_server("s1", argvv=["typo"])


def test_a_version_1_run_is_read_with_typed_placement_and_never_resumed(tmp_path: Path) -> None:
    manifest = read_manifest(FIXTURE_V1)
    assert manifest.schema_version == 1 and manifest.servers["s-paged8"].options["resident_experts"] == 8
    cells = {c.cell_id: c for c in read_cells(FIXTURE_V1)}
    assert (cells["p8-s1-r0"].resident_experts, cells["p8-s1-r0"].n_cpu_moe) == (8, None)
    assert cells["cpu-s1-r0"].n_cpu_moe == 4 and cells["ll3-s1-r0"].n_cpu_moe == 3  # server options, search extras
    assert cells["off-s1-r0"].options["offload_layers"] == 4
    with pytest.raises(UserError, match="schema version 1; this benchsuite reports it but writes only version 3"):
        RunStore.open(FIXTURE_V1, MANIFEST.model_copy(update={"matrix_hash": manifest.matrix_hash}))


def test_a_failing_write_raises_and_keeps_the_previous_file(tmp_path: Path) -> None:
    store = RunStore.open(tmp_path / "r", MANIFEST)
    store.write_cell(cell(status="failed", reason="first"), [])
    before = store.cell_path("c1").read_bytes()

    def disk_full(path: Path, data: bytes) -> None:
        if path.name == "c1.json":
            raise OSError(28, "No space left on device")
        atomic_write_bytes(path, data)

    broken = RunStore(store.run_dir, write=disk_full)
    with pytest.raises(RunError, match="No space left on device"):
        broken.write_cell(cell(status="ok"), [request()])
    assert store.cell_path("c1").read_bytes() == before


def test_atomic_write_leaves_no_partial_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "x.json"
    target.write_bytes(b"old")

    def crash(src: object, dst: object) -> None:
        raise OSError(5, "I/O error")

    monkeypatch.setattr("os.replace", crash)
    with pytest.raises(OSError):
        atomic_write_bytes(target, b"new")
    assert target.read_bytes() == b"old"
    assert list(tmp_path.iterdir()) == [target]


def test_gpu_facts_parse_nvidia_smi_and_unknowns_stay_none(monkeypatch: pytest.MonkeyPatch) -> None:
    from benchsuite.tools import machine

    line = (
        "NVIDIA H200, 570.86.15, 143771, 5, 16, 5, 16, GPU-8c0b1c8e-0000-4f00-9a00-000000000001\n"
        "NVIDIA RTX 4070 Laptop GPU, 566.03, 8188, [N/A], 8, 4, 8, [N/A]\n"
    )
    monkeypatch.setattr(machine, "_run", lambda argv: line if argv[0] == "nvidia-smi" else None)
    monkeypatch.setattr(machine.shutil, "which", lambda name: f"/usr/bin/{name}")
    h200, laptop = machine.gpu_facts()
    assert h200.model_dump() == {"name": "NVIDIA H200", "driver": "570.86.15", "vram_bytes": 143771 * 2**20,
                                 "pcie_gen": 5, "pcie_width": 16, "pcie_gen_max": 5, "pcie_width_max": 16,
                                 "uuid": "GPU-8c0b1c8e-0000-4f00-9a00-000000000001"}  # fmt: skip
    assert laptop.pcie_gen is None and laptop.pcie_width == 8 and laptop.uuid is None
    assert laptop.model_dump()["pcie_gen"] is None  # an unknown is written as null, not left out
    # no git: no commit, but the code is still named by its files' hashes (tests/test_code_provenance.py)
    no_git = machine.git_facts().model_dump()
    assert {k: no_git[k] for k in ("commit", "dirty", "tree")} == {"commit": None, "dirty": None, "tree": None}
    assert no_git["source"] == machine.FILES_SOURCE and set(no_git["code"]) == set(machine.CODE_DIRS)
    monkeypatch.setattr(machine, "_run", lambda argv: None)
    assert machine.gpu_facts() == []
    # a failed nvidia-smi (a timeout, a driver mismatch) is told apart from a machine without one: its GPUs are
    # unknown, so a resume compares its CPUs only (results.store), not a kind "without GPU"
    gpus, probe = machine.gpu_probe()
    assert gpus == [] and probe.startswith("nvidia-smi failed") and probe != machine.GPU_PROBE_ABSENT
    facts = machine.MachineFacts(cpu_model="Xeon", cpu_cores_logical=16, gpus=[], gpu_probe=probe)
    h200 = facts.model_copy(update={"gpus": [h200], "gpu_probe": machine.GPU_PROBE_ANSWERED})
    assert machine.machine_kind(facts.model_dump()) == f"Xeon x16, GPUs unknown ({probe})"
    assert machine.other_kind(h200, facts) is None and machine.other_kind(facts, h200) is None
    other_cpu = facts.model_copy(update={"cpu_cores_logical": 32})
    assert machine.other_kind(h200, other_cpu) == ("Xeon x16, NVIDIA H200 140 GiB", f"Xeon x32, GPUs unknown ({probe})")
    monkeypatch.setattr(machine.shutil, "which", lambda name: None)
    assert machine.gpu_probe() == ([], machine.GPU_PROBE_ABSENT)
    no_gpu = facts.model_copy(update={"gpu_probe": machine.GPU_PROBE_ABSENT})
    assert machine.other_kind(h200, no_gpu) == ("Xeon x16, NVIDIA H200 140 GiB", "Xeon x16, no GPU")
    older = machine.MachineFacts(cpu_model="Xeon", cpu_cores_logical=16)  # before gpu_probe, no GPUs: unknown
    assert machine.other_kind(older, h200) is None and machine.machine_kind(older.model_dump()) == "Xeon x16, no GPU"


def test_an_unwritable_output_root_is_one_run_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def read_only(self: Path, *args: object, **kwargs: object) -> None:
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(Path, "mkdir", read_only)
    with pytest.raises(RunError, match=f"cannot create the run directory {tmp_path / 'r'}: Read-only file system"):
        RunStore.open(tmp_path / "r", MANIFEST)


def test_git_facts_name_the_tracked_files_as_they_are(tmp_path) -> None:
    """A dirty checkout's `tree` is the tree its files would commit as (ignored files excepted): the
    code that ran, even on a machine whose copy of .git lags the files by commits that changed and
    added files (the GPU machine's copy of a working tree)."""
    import subprocess

    from benchsuite.tools.machine import git_facts

    def git(*a: str) -> str:
        done = subprocess.run(["git", "-C", str(tmp_path), *a], capture_output=True, text=True, check=True)
        return done.stdout.strip()

    git("init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    git("add", "a.py")
    git("-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "one")
    clean = git_facts(tmp_path)
    assert clean.dirty is False and clean.tree == git("rev-parse", "HEAD^{tree}")
    (tmp_path / ".gitignore").write_text("scratch/\n")
    (tmp_path / "a.py").write_text("x = 2\n")
    (tmp_path / "b.py").write_text("a module a later commit added\n")
    (tmp_path / "scratch").mkdir()
    (tmp_path / "scratch" / "out.json").write_text("ignored: never part of the code\n")
    dirty = git_facts(tmp_path)
    assert dirty.dirty is True and dirty.commit == clean.commit
    git("add", "a.py", "b.py", ".gitignore")
    git("-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "two")
    assert dirty.tree == git("rev-parse", "HEAD^{tree}")  # the commit of exactly those files
    assert git("status", "--porcelain", "--untracked-files=no") == ""  # the real index was untouched
    assert clean.code is None and dirty.code is None  # no benchsuite/ or paged_experts/: no code trees
    for name in ("benchsuite", "paged_experts"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "m.py").write_text(f"# {name}\n")
    git("add", "benchsuite", "paged_experts")
    git("-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "three")
    code = git_facts(tmp_path).code
    assert code == {n: git("rev-parse", f"HEAD:{n}") for n in ("benchsuite", "paged_experts")}
    (tmp_path / "paged_experts" / "m.py").write_text("# changed, not committed\n")
    changed = git_facts(tmp_path).code  # a dirty tree: the directory's hash as its files are
    assert changed is not None and changed["benchsuite"] == code["benchsuite"]
    assert changed["paged_experts"] != code["paged_experts"]


def test_git_facts_are_read_at_the_checkout_around_the_package() -> None:
    """The package's source directory is the checkout's root (where pyproject.toml is), not a
    folder inside it: a tree hash taken from a subfolder would name part of the code."""
    from benchsuite.tools import machine

    assert (machine._SOURCE_DIR / "pyproject.toml").is_file(), machine._SOURCE_DIR
