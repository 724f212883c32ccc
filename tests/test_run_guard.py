"""One run cannot corrupt another (issue 18): the run directory's lock, the input fingerprint a
resume must match, and damaged stored files set aside and measured again.

Real parts: `benchsuite run` as a subprocess, real run directories, a copy of the generated tiny
checkpoint as the model, and (in the end-to-end test) the built-in engine on loopback.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from benchsuite.config.matrix import load_matrix
from benchsuite.config.plan import build_plan
from benchsuite.engines.base import Fairness
from benchsuite.errors import UserError
from benchsuite.records import CellResult
from benchsuite.results.manifest import Manifest
from benchsuite.results.store import RunStore
from benchsuite.run.runner import open_store
from benchsuite.tools.machine import GPU_PROBE_ANSWERED, GpuFacts, MachineFacts


def bare_manifest(matrix_hash: str) -> Manifest:
    """A manifest with only what a resume compares (no fingerprint: nothing else to match)."""
    return Manifest(run_id="r", created_utc="2026-12-01T00:00:00+00:00", matrix_source="m.yaml",
                    matrix_hash=matrix_hash, matrix={})  # fmt: skip


REPO = Path(__file__).resolve().parents[1]


def write_matrix(tmp_path: Path, model: str, *, sharegpt: Path | None = None, output_tokens: int = 8) -> Path:
    workloads: dict[str, Any] = {"w": {"concurrency": [1], "num_requests": 2, "warmup_requests": 0,
                                       "output_tokens": output_tokens}}  # fmt: skip
    if sharegpt is not None:
        workloads["chat"] = {"dataset": "sharegpt", "path": str(sharegpt), "concurrency": [1], "num_requests": 2}
    doc = {"name": "guard", "output_root": str(tmp_path / "out"), "fairness": {"kv_capacity_tokens": 512},
           "engines": {"e": {"kind": "builtin", "options": {"model": model, "mode": "resident"}}},
           "workloads": workloads}  # fmt: skip
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def cli(*args: str, timeout_s: float = 240.0) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    argv = [sys.executable, "-m", "benchsuite", "run", *args, "--quiet", "--no-report"]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, env=env, check=False)


def finished_cell(store: RunStore, cell: Any) -> None:
    result = CellResult(cell_id=cell.cell_id, run_id="r", engine=cell.engine, engine_kind="builtin", mode="resident",
                        server_id=cell.server_id, params={}, workload=cell.workload, prompt_class=cell.prompt_class,
                        concurrency=cell.concurrency, repeat=cell.repeat, status="ok")  # fmt: skip
    store.write_cell(result, [])


@pytest.fixture
def model_copy(tiny_model_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(tiny_model_dir, tmp_path / "model"))


# ---- the lock ----------------------------------------------------------------------------------


def weightless_model(tmp_path: Path) -> str:
    """A model directory that exists (a missing one stops the run before the lock is even asked for);
    nothing starts: the lock refuses first."""
    from paged_experts.weights.synth_memory import write_weightless

    return str(write_weightless("tiny", tmp_path / "weightless"))


def test_a_second_runner_on_a_locked_run_exits_2_naming_the_holder(tmp_path: Path) -> None:
    path = write_matrix(tmp_path, weightless_model(tmp_path))
    store = open_store(build_plan(load_matrix(path)))
    try:
        done = cli(str(path))
    finally:
        store.close()
    assert done.returncode == 2, done.stderr + done.stdout
    assert f"pid {os.getpid()}" in done.stderr and "in use by another benchsuite run" in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_a_lock_left_by_a_killed_runner_is_taken_over_with_a_note(tmp_path: Path) -> None:
    path = write_matrix(tmp_path, weightless_model(tmp_path))
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time; from benchsuite.config.matrix import load_matrix; from benchsuite.config.plan import "
         "build_plan; from benchsuite.run.runner import open_store; open_store(build_plan(load_matrix(sys.argv[1]))); "
         "print('locked', flush=True); time.sleep(300)", str(path)],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        busy = cli(str(path))
        assert busy.returncode == 2 and f"pid {holder.pid}" in busy.stderr, busy.stderr
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    notes: list[str] = []
    plan = build_plan(load_matrix(path))
    store = RunStore.open(Path(plan.matrix.matrix.output_root) / plan.run_id, bare_manifest(plan.matrix.matrix_hash),
                          notify=notes.append)  # fmt: skip
    store.close()
    assert len(notes) == 1 and f"pid {holder.pid}" in notes[0] and "no longer running" in notes[0], notes
    again: list[str] = []
    RunStore.open(store.run_dir, bare_manifest(plan.matrix.matrix_hash), notify=again.append).close()
    assert again == []  # a clean release leaves nothing to take over


# ---- the input fingerprint ---------------------------------------------------------------------


def test_resume_refuses_a_regenerated_checkpoint_or_an_edited_dataset_naming_it(
    tmp_path: Path, model_copy: Path
) -> None:
    sharegpt = tmp_path / "sharegpt.json"
    sharegpt.write_text(json.dumps([{"id": "a", "conversations": [{"from": "human", "value": "Hello there"}]}]))
    plan = build_plan(load_matrix(write_matrix(tmp_path, str(model_copy), sharegpt=sharegpt)))
    store = open_store(plan)
    finished_cell(store, plan.cells[0])  # workload w, engine e
    store.close()
    open_store(plan).close()  # unchanged inputs resume
    weights = next(model_copy.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes() + b"\0")  # the checkpoint regenerated at the same path
    with pytest.raises(
        UserError, match=rf"other inputs.*model {model_copy}/{weights.name}: bytes \d+ -> \d+.*--new-run"
    ):
        open_store(plan)
    fresh = open_store(plan, new_run=True)
    fresh.close()
    assert not fresh.finished(plan.cells[0].cell_id)  # the new run starts empty
    aside = [p for p in fresh.run_dir.parent.iterdir() if p.name.startswith(f"{plan.run_id}.replaced-")]
    assert len(aside) == 1 and (aside[0] / "cells" / f"{plan.cells[0].cell_id}.json").is_file()  # kept, not deleted
    store = open_store(plan)
    chat = next(c for c in plan.cells if c.workload == "chat")
    finished_cell(store, chat)
    store.close()
    time.sleep(0.01)
    sharegpt.write_text(sharegpt.read_text().replace("Hello", "Howdy"))
    with pytest.raises(UserError, match=rf"dataset {sharegpt}: sha256 '[0-9a-f]+' -> '[0-9a-f]+' \(workload chat\)"):
        open_store(plan)


def test_a_small_file_written_again_with_the_same_bytes_resumes(
    tmp_path: Path, model_copy: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A device machine taken back: the synthetic model is generated anew on the next one, same bytes, new
    times. Small files are compared by content; a weight file above the hashed size still by its time."""
    plan = build_plan(load_matrix(write_matrix(tmp_path, str(model_copy))))
    store = open_store(plan)
    finished_cell(store, plan.cells[0])
    store.close()
    config = model_copy / "config.json"
    weights = next(model_copy.glob("*.safetensors"))
    for path in (config, weights):  # the tiny checkpoint's weights are small enough to be hashed too
        os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))  # same bytes, a new modification time
    open_store(plan).close()  # resumes
    import benchsuite.results.fingerprint as fingerprint

    monkeypatch.setattr(fingerprint, "HASHED_FILE_BYTES", 1024)  # the weights now "large": size and time only
    (tmp_path / "big").mkdir()
    plan = build_plan(load_matrix(write_matrix(tmp_path / "big", str(model_copy))))
    store = open_store(plan)
    finished_cell(store, plan.cells[0])
    store.close()
    os.utime(weights, ns=(time.time_ns(), time.time_ns() + 2 * 10**9))
    with pytest.raises(UserError, match=rf"model {model_copy}/{weights.name}: modified_utc"):
        open_store(plan)


def test_a_fingerprint_recorded_before_files_were_hashed_compares_by_size_and_time() -> None:
    from benchsuite.results.fingerprint import Fingerprint, fingerprint_changes

    old = {"bytes": 10, "modified_utc": "2026-12-01T00:00:00.000000+00:00"}  # an older manifest's record
    new = {**old, "sha256": "ab" * 32}
    changes = fingerprint_changes(Fingerprint(engines={"e": {"model /m/config.json": old}}),
                                  Fingerprint(engines={"e": {"model /m/config.json": new}}))  # fmt: skip
    assert changes == {}
    later = {**new, "modified_utc": "2026-12-02T00:00:00.000000+00:00"}
    changes = fingerprint_changes(Fingerprint(engines={"e": {"model /m/config.json": old}}),
                                  Fingerprint(engines={"e": {"model /m/config.json": later}}))  # fmt: skip
    assert changes == {("engines", "e"): ["model /m/config.json: modified_utc '2026-12-01T00:00:00.000000+00:00' "
                                          "-> '2026-12-02T00:00:00.000000+00:00'"]}  # fmt: skip
    engine_old, engine_new = {"torch": "2.11.0"}, {"torch": "2.11.0", "triton": "3.6.0"}  # not a file: every fact
    changes = fingerprint_changes(Fingerprint(engines={"e": {"engine builtin": engine_old}}),
                                  Fingerprint(engines={"e": {"engine builtin": engine_new}}))  # fmt: skip
    assert changes == {("engines", "e"): ["engine builtin: triton None -> '3.6.0'"]}


def _set_code(run_dir: Path, code: dict[str, str] | None) -> None:
    """The stored run as if an earlier invocation had run other code (its manifest's git.code)."""
    path = run_dir / "manifest.json"
    doc = json.loads(path.read_text())
    doc["git"]["code"] = code
    path.write_text(json.dumps(doc))


def test_resume_refuses_cells_measured_by_other_code(
    tmp_path: Path, model_copy: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run resumed by other code (another machine's copy, a later commit) would report cells of two code
    versions as one run: refused once a cell has finished, naming the trees; before any, the run becomes
    the new code's; a run recorded before the code trees is not compared. This code's trees are fixed here
    (git_facts reads them from the checkout, which an installed package may not have)."""
    from benchsuite.results import manifest
    from benchsuite.tools.machine import GitFacts

    code = {"benchsuite": "a" * 40, "paged_experts": "b" * 40}
    facts = GitFacts(commit="c" * 40, dirty=False, tree="d" * 40, source="package", code=code)
    monkeypatch.setattr(manifest, "git_facts", lambda: facts)
    plan = build_plan(load_matrix(write_matrix(tmp_path, str(model_copy))))
    store = open_store(plan)
    run_dir = store.run_dir
    store.close()
    _set_code(run_dir, {"benchsuite": "1" * 40, "paged_experts": "2" * 40})
    open_store(plan).close()  # nothing finished: resumes, and the run takes this code's trees
    assert json.loads((run_dir / "manifest.json").read_text())["git"]["code"] == code
    store = open_store(plan)
    finished_cell(store, plan.cells[0])
    store.close()
    open_store(plan).close()  # the same code resumes
    _set_code(run_dir, {**code, "paged_experts": "2" * 40})
    with pytest.raises(
        UserError, match=rf"measured by other code .*paged_experts {'2' * 40} -> [0-9a-f]{{40}}.*--new-run"
    ):
        open_store(plan)
    _set_code(run_dir, None)  # recorded before the code trees: not compared
    open_store(plan).close()


def _card(name: str, vram_gib: int, host: str = "vm") -> MachineFacts:
    gpu = GpuFacts(name=name, driver="580.159.04", vram_bytes=vram_gib * 2**30, pcie_gen=5, pcie_width=16)
    return MachineFacts(hostname=host, cpu_model="Intel(R) Xeon(R) Processor", cpu_cores_logical=16, gpus=[gpu],
                        gpu_probe=GPU_PROBE_ANSWERED)  # fmt: skip


def test_resume_refuses_cells_measured_on_another_kind_of_machine(
    tmp_path: Path, model_copy: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run carried from one card to another would report both machines' cells under the first one's facts (and
    its link probe): refused once a cell has finished, naming both kinds; another box of the same kind resumes,
    and each invocation records the machine it ran on; before any cell has finished the run becomes the new
    machine's and probes its link again."""
    from benchsuite.results import manifest as manifest_module
    from benchsuite.results.stored_files import read_manifest
    from benchsuite.tools.linkbw import LinkBandwidth

    h100, h200 = _card("NVIDIA H100 80GB HBM3", 80), _card("NVIDIA H200", 141)
    machine = {"facts": h100}
    monkeypatch.setattr(manifest_module, "machine_facts", lambda: machine["facts"])
    plan = build_plan(load_matrix(write_matrix(tmp_path, str(model_copy))))
    store = open_store(plan)
    run_dir = store.run_dir
    store.record_run(link_bandwidth=LinkBandwidth(paging_gb_per_s=51.6, device="NVIDIA H100 80GB HBM3"))
    store.close()
    machine["facts"] = h200  # nothing finished: the run is the H200's now, and its H100 probe is gone
    open_store(plan).close()
    stored = read_manifest(run_dir)
    assert stored.machine.gpus[0].name == "NVIDIA H200" and stored.link_bandwidth is None
    assert [i.machine.gpus[0].name for i in stored.invocations if i.machine] == ["NVIDIA H100 80GB HBM3", "NVIDIA H200"]
    store = open_store(plan)
    finished_cell(store, plan.cells[0])
    store.close()
    machine["facts"] = _card("NVIDIA H200", 141, host="other-box")  # another H200 resumes, and says so
    open_store(plan).close()
    stored = read_manifest(run_dir)
    assert stored.machine.hostname == "vm" and stored.invocations[-1].machine.hostname == "other-box"
    failed = h200.model_copy(update={"gpus": [], "gpu_probe": "nvidia-smi failed (an error exit)"})
    machine["facts"] = failed  # the same box with a failed GPU probe is no other machine: it resumes, takes nothing
    open_store(plan).close()
    assert read_manifest(run_dir).machine.gpus[0].name == "NVIDIA H200"
    machine["facts"] = h100
    kinds = r"Intel\(R\) Xeon\(R\) Processor x16, NVIDIA H200 141 GiB; this is .* NVIDIA H100 80GB HBM3 80 GiB"
    with pytest.raises(UserError, match=rf"measured on another kind of machine \({kinds}\);.*--new-run"):
        open_store(plan)
    assert len(read_manifest(run_dir).invocations) == 5  # the refused one added nothing
    doc = json.loads((run_dir / "manifest.json").read_text())  # a run spread over Ray nodes: its cells name theirs
    (run_dir / "manifest.json").write_text(json.dumps({**doc, "nodes": {"n1": doc["machine"]}}))
    open_store(plan).close()
    (run_dir / "manifest.json").write_text(json.dumps({**doc, "machine": {}}))  # no facts recorded: not compared
    open_store(plan).close()
    open_store(plan, new_run=True).close()  # the way out the message names: a run of this machine
    assert read_manifest(run_dir).machine.gpus[0].name == "NVIDIA H100 80GB HBM3"


def test_changed_inputs_of_cells_not_finished_yet_are_recorded_anew(tmp_path: Path, model_copy: Path) -> None:
    plan = build_plan(load_matrix(write_matrix(tmp_path, str(model_copy))))
    open_store(plan).close()  # nothing finished
    (model_copy / "config.json").write_text((model_copy / "config.json").read_text() + "\n")
    notes: list[str] = []
    run_dir = Path(plan.matrix.matrix.output_root) / plan.run_id
    from benchsuite.results.manifest import build_manifest

    RunStore.open(run_dir, build_manifest(plan), notify=notes.append).close()
    assert any("recorded anew" in n for n in notes), notes


# ---- damaged files -----------------------------------------------------------------------------

DAMAGE: dict[str, Any] = {
    "empty_list": b"[]",
    "null": b"null",
    "garbage": b"\x00\xff\xfegarbage{",
    "number": b"42",
    "no_schema": lambda p: {k: v for k, v in p.items() if k != "schema_version"},
    "schema_as_text": lambda p: {**p, "schema_version": "1"},
    "no_attempt": lambda p: {k: v for k, v in p.items() if k != "attempt"},
    "no_cell": lambda p: {k: v for k, v in p.items() if k != "cell"},
    "cell_missing_field": lambda p: {**p, "cell": {k: v for k, v in p["cell"].items() if k != "status"}},
    "cell_wrong_type": lambda p: {**p, "cell": {**p["cell"], "concurrency": "many"}},
    "cell_of_another_id": lambda p: {**p, "cell": {**p["cell"], "cell_id": "0123456789ab"}},
    "requests_not_a_list": lambda p: {**p, "requests": {"a": 1}},
    "request_wrong_type": lambda p: {**p, "requests": [{"cell_id": 1}]},
}


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_a_damaged_cell_file_is_named_set_aside_and_the_cell_runs_again(tmp_path: Path, kind: str) -> None:
    notes: list[str] = []
    store = RunStore.open(tmp_path / "r", bare_manifest("h"), notify=notes.append)
    result = CellResult(cell_id="c0ffee000001", run_id="r", engine="e", engine_kind="builtin", mode="resident",
                        server_id="s", params={}, workload="w", prompt_class="short", concurrency=1, repeat=0,
                        status="ok")  # fmt: skip
    store.write_cell(result, [])
    path = store.cell_path(result.cell_id)
    damage = DAMAGE[kind]
    damaged = damage if isinstance(damage, bytes) else json.dumps(damage(json.loads(path.read_text()))).encode()
    path.write_bytes(damaged)
    assert not store.finished(result.cell_id)  # not measured: the run measures it again
    assert len(notes) == 1 and str(path) in notes[0] and "damaged" in notes[0], notes
    assert (store.run_dir / "attempts" / f"{result.cell_id}.1.json").read_bytes() == damaged
    assert store.write_cell(result, []).attempt == 2  # numbered after the damaged attempt
    store.rebuild_tables()
    store.close()


def test_a_damaged_manifest_is_one_line_and_new_run_starts_afresh(tmp_path: Path) -> None:
    store = RunStore.open(tmp_path / "r", bare_manifest("h"))
    store.close()
    for damage in (b"[]", b"null", b"\xff\x00", b'{"schema_version": "x"}'):
        store.manifest_path.write_bytes(damage)
        with pytest.raises(UserError, match=r"manifest.json is damaged \(.*\); .*--new-run") as err:
            RunStore.open(tmp_path / "r", bare_manifest("h"))
        assert "\n" not in str(err.value)
    RunStore.open(tmp_path / "r", bare_manifest("h"), new_run=True).close()


def test_a_damaged_cell_is_measured_again_by_the_next_run(tmp_path: Path, model_copy: Path) -> None:
    path = write_matrix(tmp_path, str(model_copy), output_tokens=4)
    first = cli(str(path))
    assert first.returncode == 0, first.stderr + first.stdout
    plan = build_plan(load_matrix(path))
    run_dir = Path(plan.matrix.matrix.output_root) / plan.run_id
    cell_file = run_dir / "cells" / f"{plan.cells[0].cell_id}.json"
    cell_file.write_bytes(b"null")
    second = cli(str(path))
    assert second.returncode == 0, second.stderr + second.stdout
    damaged_lines = [line for line in second.stderr.splitlines() if "damaged" in line]
    assert len(damaged_lines) == 1 and str(cell_file) in damaged_lines[0], second.stderr
    stored = json.loads(cell_file.read_text())
    assert stored["attempt"] == 2 and stored["cell"]["status"] == "ok"
    assert (run_dir / "attempts" / f"{plan.cells[0].cell_id}.1.json").read_bytes() == b"null"


# ---- the engine's environment ------------------------------------------------------------------


async def test_the_engine_gets_what_it_needs_and_what_the_matrix_declares_only(
    tmp_path: Path, model_copy: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import psutil

    from benchsuite.run.context import RunContext
    from benchsuite.run.runner import client_session
    from benchsuite.run.server_launch import launch_server

    path = write_matrix(tmp_path, str(model_copy))
    doc = yaml.safe_load(path.read_text())
    doc["env"] = {"DECLARED_FOR_ALL": "1"}
    doc["engines"]["e"]["env"] = {"DECLARED_FOR_E": 2, "HF_TOKEN": "secret-value"}
    path.write_text(yaml.safe_dump(doc))
    monkeypatch.setenv("LLAMA_ARG_CTX_SIZE", "5")  # left in the user's shell: must not reach an engine
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    plan = build_plan(load_matrix(path))
    store = open_store(plan)
    try:
        async with client_session() as session:
            async with launch_server(RunContext(plan, store, session), plan.servers[0]) as server:
                env = psutil.Process(server.process.pid).environ()
    finally:
        store.close()
    assert env["DECLARED_FOR_ALL"] == "1" and env["DECLARED_FOR_E"] == "2" and env["PATH"] == os.environ["PATH"]
    assert "LLAMA_ARG_CTX_SIZE" not in env and "OMP_NUM_THREADS" not in env
    manifest = json.loads((store.run_dir / "manifest.json").read_text())
    recorded = manifest["servers"][plan.servers[0].server_id]["env"]
    assert (
        recorded["DECLARED_FOR_E"] == "2" and recorded["HF_TOKEN"] == "<set>" and "LLAMA_ARG_CTX_SIZE" not in recorded
    )
    assert "secret-value" not in (store.run_dir / "manifest.json").read_text()


@pytest.mark.llamacpp
async def test_llama_server_is_started_so_no_web_page_can_read_it(tmp_path: Path) -> None:
    import aiohttp

    from benchsuite.engines.base import ServerSpec
    from benchsuite.engines.llamacpp.adapter import LlamaCppAdapter, LlamaCppOptions, binary_flags, find_binary
    from benchsuite.run.process import EngineProcess, free_port

    binary = find_binary()
    if binary is None:
        pytest.skip("no llama-server on PATH or in the cache: run `benchsuite install llama-server`")
    adapter = LlamaCppAdapter()
    options = LlamaCppOptions(model="tiny", threads=2)
    spec = ServerSpec("cors", "llamacpp", options, Fairness(256), 1, "cors")
    adapter.prepare(spec)
    port = free_port()
    launch = adapter.launch_plan(spec, port)
    assert "--cors-origins" in binary_flags(binary), "the pinned build lists --cors-origins"
    base = f"http://127.0.0.1:{port}"
    async with EngineProcess(launch.argv, launch.env, tmp_path / "server.log", f"{base}/health", 120):
        async with aiohttp.ClientSession() as http:
            for path in ("/props", "/metrics", "/v1/models"):
                headers = {"Origin": "http://evil.example"}
                async with http.get(base + path, headers=headers) as resp:
                    allowed = resp.headers.get("Access-Control-Allow-Origin")
                    assert allowed not in ("*", "http://evil.example"), (path, dict(resp.headers))
                    assert resp.headers.get("Access-Control-Allow-Credentials") != "true"
                async with http.options(
                    base + path, headers={**headers, "Access-Control-Request-Method": "GET"}
                ) as resp:
                    assert resp.headers.get("Access-Control-Allow-Origin") not in ("*", "http://evil.example")
    assert "cross_origin" in adapter.version(spec) and "--cors-origins" in adapter.version(spec)["cross_origin"]
