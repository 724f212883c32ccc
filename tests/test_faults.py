"""The fault matrix (docs/faults.md) on the real built-in engine, and on llama-server where built.

Each test injects one kind of fault into a tiny matrix run (few requests, few output tokens) and
checks the same contract: no finished cell is lost, no engine process is left behind (process
table, psutil), the failed cell is stored with its reason, the rest of the matrix continues, and
a rerun resumes (finished cells untouched, failed ones retried).

Runs are in-process (`runner.execute`, so a test can hold the event hooks, the store's write
seam and the cell timeout) except the runner-killed and Ctrl-C faults, which run
`python -m benchsuite run` as a subprocess and signal it. Every engine process of a test carries
a per-test model path (a symlink to the tiny checkpoint) in its argv, which is how the process
table is searched for orphans.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml

from benchsuite.cli import main as cli_main
from benchsuite.config.matrix import load_matrix
from benchsuite.config.plan import CellSpec, build_plan
from benchsuite.engines.llamacpp.adapter import find_binary
from benchsuite.records import CellResult
from benchsuite.results.store import RunStore, Writer, atomic_write_bytes
from benchsuite.run import server_launch
from benchsuite.run.context import RunContext, SilentEvents
from benchsuite.run.process import EngineProcess
from benchsuite.run.runner import client_session, execute, open_store

REPO = Path(__file__).resolve().parent.parent
RUN_BOUND_S = 240.0  # a run of these matrices takes seconds; past this the runner is hung


# ---- matrices and process table ------------------------------------------------------------------


def tagged_model(tmp_path: Path, tiny_model_dir: Path) -> Path:
    """A per-test path to the tiny checkpoint: it appears in every engine argv of this test."""
    link = tmp_path / f"model-{tmp_path.name}"
    link.symlink_to(tiny_model_dir, target_is_directory=True)
    return link


def broken_model(tag: Path, tiny_model_dir: Path) -> Path:
    """The tiny checkpoint with its weights cut short (its path carries the tag): the server exits while
    loading it. A bad K no longer reaches a launch: the matrix refuses it when it loads."""
    broken = Path(f"{tag}-broken")
    broken.mkdir()
    for item in tiny_model_dir.iterdir():
        if item.suffix == ".safetensors":
            (broken / item.name).write_bytes(item.read_bytes()[:1000])
        else:
            (broken / item.name).symlink_to(item)
    return broken


def write_matrix(
    tmp_path: Path,
    engines: dict[str, dict[str, Any]],
    *,
    concurrency: list[int],
    output_tokens: int = 8,
    num_requests: int = 2,
    kind: str = "builtin",
    kv_capacity_tokens: int = 1024,
) -> Path:
    body = {
        "name": "faults",
        "output_root": str(tmp_path / "results"),
        "fairness": {"kv_capacity_tokens": kv_capacity_tokens},
        "engines": {name: {"kind": kind, "options": options} for name, options in engines.items()},
        "workloads": {
            "w": {
                "output_tokens": output_tokens,
                "concurrency": concurrency,
                "num_requests": num_requests,
                "warmup_requests": 0,
            }
        },
    }
    path = tmp_path / "matrix.yaml"
    path.write_text(yaml.safe_dump(body, sort_keys=False))
    return path


def engine_processes(tag: str) -> list[psutil.Process]:
    """Live (non-zombie) processes whose command line mentions `tag`, this test's model path."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        try:
            if proc.info["status"] == psutil.STATUS_ZOMBIE or proc.pid == os.getpid():
                continue
            cmdline = proc.info["cmdline"] or []
            if any(tag in arg for arg in cmdline) and "benchsuite" not in cmdline[1:3]:  # not `python -m benchsuite`
                found.append(proc)
        except psutil.Error:
            continue
    return found


def assert_no_orphans(tag: str, wait_s: float = 10.0) -> None:
    deadline = time.monotonic() + wait_s
    while engine_processes(tag) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = engine_processes(tag)
    assert left == [], f"engine processes left behind: {[(p.pid, p.info['cmdline']) for p in left]}"


def stored(run_dir: Path) -> dict[str, dict[str, Any]]:
    """cell id -> the stored cell row."""
    return {p.stem: json.loads(p.read_text())["cell"] for p in (run_dir / "cells").glob("*.json")}


def cell_bytes(run_dir: Path) -> dict[str, bytes]:
    return {p.stem: p.read_bytes() for p in (run_dir / "cells").glob("*.json")}


def by_engine(run_dir: Path) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for cell in stored(run_dir).values():
        out.setdefault(cell["engine"], []).append(cell)
    return out


class Hooks(SilentEvents):
    """run_context.RunEvents that calls `on_start(cell, index)` as each cell starts (index counts all cells)."""

    def __init__(self, on_start: Callable[[CellSpec, int], None] | None = None) -> None:
        self.on_start = on_start
        self.started: list[str] = []
        self.finished: list[CellResult] = []

    def cell_started(self, cell: CellSpec) -> None:
        self.started.append(cell.cell_id)
        if self.on_start is not None:
            self.on_start(cell, len(self.started) - 1)

    def cell_finished(self, cell: CellSpec, result: CellResult) -> None:
        self.finished.append(result)


async def run_in_process(
    matrix_path: Path,
    events: Hooks | None = None,
    *,
    cell_timeout_s: float = 120.0,
    write: Writer = atomic_write_bytes,
    bound_s: float = RUN_BOUND_S,
) -> RunStore:
    """One `benchsuite run` through the library, with the seams a CLI run does not expose.
    A run still going after `bound_s` is cancelled (its engines stop) and the test fails."""
    plan = build_plan(load_matrix(matrix_path))
    store = open_store(plan, write=write)
    async with client_session() as session:  # the runner's own session (force_close: see runner)
        ctx = RunContext(plan, store, session, events or Hooks(), cell_timeout_s=cell_timeout_s)
        try:
            await asyncio.wait_for(execute(ctx), bound_s)
        except TimeoutError:
            pytest.fail(
                f"the run did not finish within {bound_s:g} s: the runner is hung; stored so far: "
                + json.dumps({k: (c["status"], (c["reason"] or "")[:80]) for k, c in stored(store.run_dir).items()})
            )
    return store


BUILTIN_RUNNING = "paged_experts:num_running_reqs"
LLAMACPP_RUNNING = "llamacpp:requests_processing"


def signal_engine_mid_generation(
    tag: str, sig: signal.Signals, gauge: str = BUILTIN_RUNNING, timeout_s: float = 60.0
) -> None:
    """Send `sig` to the engine of the cell starting now (the one live process of this test's tag)
    as soon as its /metrics `gauge` shows a running request, so the fault lands inside the cell's
    load, not between cells. A thread polls; it never touches an engine started later."""
    targets = engine_processes(tag)

    def running(port: str) -> bool:
        with (
            contextlib.suppress(OSError),
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as resp,
        ):
            for line in resp.read().decode().splitlines():
                if line.startswith((gauge + " ", gauge + "{")):
                    return float(line.split()[-1]) >= 1
        return False

    def fire() -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and any(p.is_running() for p in targets):
            for proc in targets:
                with contextlib.suppress(psutil.Error, ValueError, IndexError):
                    argv = proc.cmdline()
                    if running(argv[argv.index("--port") + 1]):
                        proc.send_signal(sig)
                        return
            time.sleep(0.01)

    threading.Thread(target=fire, daemon=True).start()


# ---- engine faults -------------------------------------------------------------------------------


@pytest.mark.slow
async def test_engine_exit_at_start_and_sigkill_mid_cell_fail_only_their_cells_and_a_rerun_resumes(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    model = tagged_model(tmp_path, tiny_model_dir)
    tag = str(model)
    engines = {
        "killed": {"model": tag, "mode": "resident"},
        # weights cut short: the server starts, fails to read them and exits 1
        "bad": {"model": str(broken_model(model, tiny_model_dir)), "mode": "paged", "resident_experts": 8},
        "good": {"model": tag, "mode": "paged", "resident_experts": 8},
    }
    path = write_matrix(tmp_path, engines, concurrency=[1, 2, 3], output_tokens=48)

    def kill_second_cell(cell: CellSpec, index: int) -> None:
        if cell.engine == "killed" and index == 1:
            signal_engine_mid_generation(tag, signal.SIGKILL)

    store = await run_in_process(path, Hooks(kill_second_cell))
    assert_no_orphans(tag)
    cells = by_engine(store.run_dir)
    killed = sorted(cells["killed"], key=lambda c: c["concurrency"])
    assert [c["status"] for c in killed] == ["ok", "failed", "failed"]
    # the killed cell names the death (the runner waits for the exit behind a connection error),
    # and so does the cell after it
    assert "engine exited with code -9" in killed[1]["reason"], killed[1]["reason"]
    assert "engine exited with code -9" in killed[2]["reason"], killed[2]["reason"]
    assert {c["status"] for c in cells["bad"]} == {"failed"}
    # the cause is the exit or the crash line in the log, whichever the launcher saw first; the log
    # tail in the reason says what the server could not read
    assert all("engine did not start" in c["reason"] and "invalid header" in c["reason"] for c in cells["bad"]), cells[
        "bad"
    ][0]["reason"]
    assert {c["status"] for c in cells["good"]} == {"ok"}  # the matrix went on after both faults

    first = cell_bytes(store.run_dir)
    store = await run_in_process(path)
    assert_no_orphans(tag)
    again = by_engine(store.run_dir)
    assert {c["status"] for c in again["killed"]} == {"ok"}
    assert {c["status"] for c in again["bad"]} == {"failed"}
    after = cell_bytes(store.run_dir)
    for cell_id, data in first.items():
        if json.loads(data)["cell"]["status"] == "ok":
            assert after[cell_id] == data  # finished cells are never rewritten
    archived = sorted(p.name for p in (store.run_dir / "attempts").iterdir())
    assert len(archived) == 5 and all(name.endswith(".1.json") for name in archived)  # 2 killed + 3 bad


@pytest.mark.slow
async def test_engine_hung_by_sigstop_fails_its_cells_by_timeout_and_is_killed(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    model = tagged_model(tmp_path, tiny_model_dir)
    tag = str(model)
    path = write_matrix(tmp_path, {"hung": {"model": tag, "mode": "resident"}}, concurrency=[1, 2], output_tokens=48)

    def stop_first_cell(cell: CellSpec, index: int) -> None:
        if index == 0:
            signal_engine_mid_generation(tag, signal.SIGSTOP)

    t0 = time.monotonic()
    try:
        # each of the 2 cells may wait out its 5 s timeout; far more than that means the runner hangs
        store = await run_in_process(path, Hooks(stop_first_cell), cell_timeout_s=5.0, bound_s=60.0)
    finally:
        assert_no_orphans(tag)  # a stopped engine is killed too (SIGCONT + SIGTERM, then SIGKILL)
    elapsed_s = time.monotonic() - t0
    cells = sorted(stored(store.run_dir).values(), key=lambda c: c["concurrency"])
    assert [c["status"] for c in cells] == ["failed", "failed"]
    assert "TimeoutError" in cells[0]["reason"] or "within 5 s" in cells[0]["reason"], cells[0]["reason"]
    # the hung engine is not asked again for every later cell: each would wait its full timeout
    assert elapsed_s < 60.0, f"the run took {elapsed_s:.0f} s"

    store = await run_in_process(path)
    assert_no_orphans(tag)
    assert {c["status"] for c in stored(store.run_dir).values()} == {"ok"}


def squat(port: int, holders: list[socket.socket]) -> None:
    """Listen on 127.0.0.1:port, as another program would."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", port))
    sock.listen(1)
    holders.append(sock)


@pytest.mark.slow
async def test_port_taken_while_the_engine_starts_fails_that_server_and_the_rest_runs(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tagged_model(tmp_path, tiny_model_dir)
    tag = str(model)
    engines = {
        "raced": {"model": tag, "mode": "resident"},
        "good": {"model": tag, "mode": "paged", "resident_experts": 8},
    }
    path = write_matrix(tmp_path, engines, concurrency=[1])
    holders: list[socket.socket] = []

    class RacedProcess(EngineProcess):
        def start(self) -> None:
            super().start()
            if "resident" in self.argv:  # taken after the launcher's check, before the engine binds
                squat(int(self.health_url.rsplit(":", 1)[1].split("/")[0]), holders)

    monkeypatch.setattr(server_launch, "EngineProcess", RacedProcess)
    try:
        store = await run_in_process(path)
    finally:
        for sock in holders:
            sock.close()
    assert_no_orphans(tag)
    cells = {name: rows[0] for name, rows in by_engine(store.run_dir).items()}
    assert cells["raced"]["status"] == "failed", cells["raced"]
    assert (
        "engine did not start" in cells["raced"]["reason"]
        and "address already in use" in cells["raced"]["reason"].lower()
    )
    assert cells["good"]["status"] == "ok"


@pytest.mark.slow
async def test_port_taken_before_launch_fails_or_retries_that_server_and_the_rest_runs(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tagged_model(tmp_path, tiny_model_dir)
    tag = str(model)
    engines = {
        "taken": {"model": tag, "mode": "resident"},
        "good": {"model": tag, "mode": "paged", "resident_experts": 8},
    }
    path = write_matrix(tmp_path, engines, concurrency=[1])
    holders: list[socket.socket] = []
    real_free_port = server_launch.free_port

    def free_port() -> int:  # the first pick is taken by someone else before the launch
        port = real_free_port()
        if not holders:
            squat(port, holders)
        return port

    monkeypatch.setattr(server_launch, "free_port", free_port)
    try:
        store = await run_in_process(path)
    finally:
        for sock in holders:
            sock.close()
    assert_no_orphans(tag)
    cells = {name: rows[0] for name, rows in by_engine(store.run_dir).items()}
    taken = cells["taken"]
    assert taken["status"] == "ok" or (taken["status"] == "failed" and "already in use" in taken["reason"]), taken
    assert cells["good"]["status"] == "ok"


# ---- runner faults -------------------------------------------------------------------------------


def wait_for_cells(run_root: Path, more_than: int, child: subprocess.Popen[str], timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and child.poll() is None:
        if len(list(run_root.glob("*/cells/*.json"))) > more_than:
            return
        time.sleep(0.05)
    raise AssertionError(f"no cell beyond {more_than} was written (runner exit code {child.poll()})")


def start_cli_run(matrix_path: Path) -> subprocess.Popen[str]:
    argv = [sys.executable, "-m", "benchsuite", "run", str(matrix_path), "--quiet", "--no-report"]
    return subprocess.Popen(
        argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        # as a terminal's foreground job: a test runner started in the background ignores SIGINT, and the
        # runner would inherit that
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip


@pytest.mark.slow
def test_ctrl_c_then_sigkill_of_the_runner_keep_every_finished_cell_and_the_rerun_resumes(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    model = tagged_model(tmp_path, tiny_model_dir)
    tag = str(model)
    path = write_matrix(
        tmp_path, {"e": {"model": tag, "mode": "resident"}}, concurrency=[1, 2, 3, 4, 5], output_tokens=32
    )
    results = tmp_path / "results"

    child = start_cli_run(path)
    try:
        wait_for_cells(results, 0, child)
        child.send_signal(signal.SIGINT)
        out, _ = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == 130, out
    assert "interrupted; finished cells are kept" in out and "Traceback" not in out
    assert_no_orphans(tag)
    (run_dir,) = results.iterdir()
    assert (run_dir / "cells.parquet").exists()  # the tables are rebuilt on Ctrl-C
    after_int = cell_bytes(run_dir)
    assert 1 <= len(after_int) < 5 and all(json.loads(b)["cell"]["status"] == "ok" for b in after_int.values())

    child = start_cli_run(path)
    try:
        wait_for_cells(results, len(after_int), child)
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
    assert_no_orphans(tag)  # the engine dies with its parent even when the parent runs no Python
    after_kill = cell_bytes(run_dir)
    assert all(after_kill[k] == v for k, v in after_int.items())
    assert not list((run_dir / "cells").glob(".*.tmp"))  # atomic writes: no half file is left

    assert cli_main(["run", str(path), "--quiet", "--no-report"]) == 0
    assert_no_orphans(tag)
    final = cell_bytes(run_dir)
    assert len(final) == 5 and all(json.loads(b)["cell"]["status"] == "ok" for b in final.values())
    assert all(final[k] == v for k, v in after_kill.items() if json.loads(v)["cell"]["status"] == "ok")
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert len(manifest["invocations"]) == 3


# ---- store faults --------------------------------------------------------------------------------


@pytest.mark.slow
async def test_write_errors_at_the_store_seam_fail_the_cell_or_stop_the_run_and_the_rerun_resumes(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    model = tagged_model(tmp_path, tiny_model_dir)
    tag = str(model)
    path = write_matrix(tmp_path, {"e": {"model": tag, "mode": "resident"}}, concurrency=[1, 2, 3])
    cell_ids = [c.cell_id for c in build_plan(load_matrix(path)).cells]
    failures: list[str] = []

    def flaky(target: Path, data: bytes) -> None:
        # the first cell's engine counters cannot be written once; the second cell's result never
        if target.name == f"{cell_ids[0]}.json" and target.parent.name == "engine_metrics" and not failures:
            failures.append(str(target))
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        if target.name == f"{cell_ids[1]}.json" and target.parent.name == "cells":
            failures.append(str(target))
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        atomic_write_bytes(target, data)

    from benchsuite.errors import RunError

    with pytest.raises(RunError, match=rf"cannot write .*{cell_ids[1]}\.json: No space left on device"):
        await run_in_process(path, write=flaky)
    assert_no_orphans(tag)
    run_dir = tmp_path / "results" / build_plan(load_matrix(path)).run_id
    cells = stored(run_dir)
    assert set(cells) == {cell_ids[0]}  # the run stopped at the cell it could not record
    assert cells[cell_ids[0]]["status"] == "failed"
    assert "engine_metrics" in cells[cell_ids[0]]["reason"] and "No space left" in cells[cell_ids[0]]["reason"]

    store = await run_in_process(path)
    assert_no_orphans(tag)
    assert {c["status"] for c in stored(store.run_dir).values()} == {"ok"} and len(stored(store.run_dir)) == 3


@contextlib.contextmanager
def read_only(directory: Path) -> Iterator[None]:
    """Make `directory` read-only for this process: chmod for a normal user; root ignores modes,
    so as root a read-only bind mount of the directory onto itself (skip when not allowed)."""
    if os.geteuid() != 0:
        modes = {p: p.stat().st_mode for p in [directory, *directory.rglob("*")] if p.is_dir()}
        for p in modes:
            p.chmod(0o555)
        try:
            yield
        finally:
            for p, mode in modes.items():
                p.chmod(mode)
        return
    bind = subprocess.run(
        ["mount", "--bind", "-o", "ro", str(directory), str(directory)], capture_output=True, text=True, check=False
    )
    if bind.returncode != 0:
        pytest.skip(f"running as root and a read-only bind mount is not allowed here: {bind.stderr.strip()}")
    try:
        yield
    finally:
        subprocess.run(["umount", str(directory)], check=True)


def test_read_only_output_directory_is_one_error_line_and_nothing_starts(
    tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tagged_model(tmp_path, tiny_model_dir)
    path = write_matrix(tmp_path, {"e": {"model": str(model), "mode": "resident"}}, concurrency=[1])
    (tmp_path / "results").mkdir()
    with read_only(tmp_path / "results"):
        code = cli_main(["run", str(path), "--quiet", "--no-report"])
    err = capsys.readouterr().err
    assert code in (1, 2), err
    assert err.startswith("benchsuite: error:") and str(tmp_path / "results") in err and "Traceback" not in err
    assert engine_processes(str(model)) == []


@pytest.mark.slow
async def test_output_directory_turning_read_only_mid_run_stops_the_run_and_the_rerun_resumes(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    model = tagged_model(tmp_path, tiny_model_dir)
    tag = str(model)
    path = write_matrix(tmp_path, {"e": {"model": tag, "mode": "resident"}}, concurrency=[1, 2, 3])
    run_dir = tmp_path / "results" / build_plan(load_matrix(path)).run_id
    from benchsuite.errors import RunError

    with contextlib.ExitStack() as stack:

        def freeze_after_first(cell: CellSpec, index: int) -> None:
            if index == 1:  # the first cell is stored; everything after it cannot be
                stack.enter_context(read_only(run_dir))

        with pytest.raises(RunError, match="cannot write"):
            await run_in_process(path, Hooks(freeze_after_first))
        assert_no_orphans(tag)
        kept = cell_bytes(run_dir)
    assert len(kept) == 1 and json.loads(next(iter(kept.values())))["cell"]["status"] == "ok"
    store = await run_in_process(path)
    assert_no_orphans(tag)
    final = cell_bytes(store.run_dir)
    assert len(final) == 3 and all(final[k] == v for k, v in kept.items())


# ---- llama-server --------------------------------------------------------------------------------

needs_llama_server = pytest.mark.skipif(
    find_binary() is None, reason="no llama-server on PATH or in the cache: run `benchsuite install llama-server`"
)


@pytest.mark.llamacpp
@pytest.mark.slow
@needs_llama_server
async def test_llama_server_bad_flag_sigkill_and_sigstop_fail_only_their_cells_and_a_rerun_resumes(
    tmp_path: Path,
) -> None:
    tag = f"fault-{tmp_path.name}"  # `--alias TAG` marks this test's llama-server processes
    base = {"model": "tiny", "threads": 1}
    engines = {
        "bad": {**base, "extra_args": ["--alias", tag, "--no-such-flag-anywhere"]},  # refused at start
        "killed": {**base, "extra_args": ["--alias", tag]},
        "hung": {**base, "extra_args": ["--alias", tag]},
    }
    # llama-server decodes the tiny model at thousands of tokens/s: long outputs leave time to act
    path = write_matrix(
        tmp_path, engines, concurrency=[1, 2], output_tokens=768, kind="llamacpp", kv_capacity_tokens=4096
    )

    def inject(cell: CellSpec, index: int) -> None:
        if cell.engine == "killed" and cell.concurrency == 1:
            signal_engine_mid_generation(tag, signal.SIGKILL, LLAMACPP_RUNNING)
        if cell.engine == "hung" and cell.concurrency == 1:
            signal_engine_mid_generation(tag, signal.SIGSTOP, LLAMACPP_RUNNING)

    try:
        store = await run_in_process(path, Hooks(inject), cell_timeout_s=10.0, bound_s=180.0)
    finally:
        assert_no_orphans(tag)
    cells = by_engine(store.run_dir)
    assert {c["status"] for c in cells["bad"]} == {"failed"}
    assert all("engine did not start" in c["reason"] for c in cells["bad"])
    assert "no-such-flag-anywhere" in cells["bad"][0]["reason"]  # llama-server names the flag it refused
    assert [c["status"] for c in sorted(cells["killed"], key=lambda c: c["concurrency"])] == ["failed", "failed"]
    assert all("engine exited with code -9" in c["reason"] for c in cells["killed"])
    hung = sorted(cells["hung"], key=lambda c: c["concurrency"])
    assert hung[0]["status"] == "failed" and "TimeoutError" in hung[0]["reason"], hung[0]

    store = await run_in_process(path)
    assert_no_orphans(tag)
    again = by_engine(store.run_dir)
    assert {c["status"] for c in again["killed"] + again["hung"]} == {"ok"}, [
        (c["engine"], c["concurrency"], c["status"], c["reason"]) for c in again["killed"] + again["hung"]
    ]
