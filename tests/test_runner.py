"""The run loop against a fake engine process: one start per server, cells stored as they end,
failures recorded without stopping the matrix, resume after SIGKILL, Ctrl-C keeps results.

The fake engine is this file run as a script (`--serve`): an aiohttp OpenAI-style streaming
server with /health, /metrics (paging-style counters), /flush_cache, and scripted failures. It
is wired in as the `builtin` kind through the adapter registry's cache (FakeAdapter below).
`--cli ...` runs `benchsuite` with that wiring, for the subprocess tests.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import psutil
import pytest
import yaml

from benchsuite.engines import RUN_DIR_PLACEHOLDER
from benchsuite.engines.base import (
    EngineAdapter,
    EngineOptions,
    LaunchPlan,
    Placement,
    ServerSpec,
    TraceReplay,
    options_of,
)

HERE = Path(__file__).resolve()


class FakeOptions(EngineOptions):
    behaviour: Literal["ok", "crash", "die", "hang", "stall"] = "ok"
    # completions served before the process exits (die), blocks forever (hang), or leaves every later
    # completion unanswered while /health and /metrics still answer (stall)
    die_after: int = 0
    token_delay_s: float = 0.01
    label: int | Literal["search"] = 0  # something to sweep, or to search
    tag: str = ""  # marks the engine processes of one test, to look for orphans
    tokenizer: str = ""  # for exact-length and random-token prompts (FakeAdapter.tokenizer_dir)

    def placement(self) -> Placement:
        return Placement("fake")


class FakeAdapter(EngineAdapter):
    kind = "builtin"
    options_model = FakeOptions
    flush_cache_path = "/flush_cache"

    def validate(self, spec: ServerSpec) -> None:
        pass

    def launch_plan(self, spec: ServerSpec, port: int) -> LaunchPlan:
        o = options_of(spec, FakeOptions)
        argv = [sys.executable, str(HERE), "--serve", "--port", str(port), "--behaviour", o.behaviour,
                "--die-after", str(o.die_after), "--token-delay-s", str(o.token_delay_s), "--tag", o.tag]  # fmt: skip
        return LaunchPlan(argv=argv, startup_timeout_s=60.0)

    def tokenizer_dir(self, spec: ServerSpec) -> Path:
        return Path(options_of(spec, FakeOptions).tokenizer)

    def request_extras(self, spec: ServerSpec) -> dict[str, Any]:
        return {}

    def version(self, spec: ServerSpec) -> dict[str, Any]:
        return {"engine": "fake"}

    async def scrape(self, session: Any, base_url: str) -> dict[str, float] | None:
        from benchsuite.tools.scrape import parse_prometheus

        async with session.get(f"{base_url}/metrics") as resp:
            return parse_prometheus(await resp.text())

    def parse_log(self, log_text: str) -> dict[str, Any]:
        return {}


class RecordingOptions(FakeOptions):
    stop_s: float = 0.0  # what the engine takes to write its trace once told to stop


class RecordingAdapter(FakeAdapter):
    """The fake engine writing routing/<server-id>.trace when it stops, as a recording built-in server does."""

    options_model = RecordingOptions

    def launch_plan(self, spec: ServerSpec, port: int) -> LaunchPlan:
        stop_s = options_of(spec, RecordingOptions).stop_s
        argv = super().launch_plan(spec, port).argv
        argv += ["--trace", f"{RUN_DIR_PLACEHOLDER}/routing/{spec.server_id}.trace", "--stop-s", str(stop_s)]
        return LaunchPlan(argv=argv, startup_timeout_s=60.0, stop_grace_s=stop_s + 10)

    def trace_replay(self, spec: ServerSpec) -> TraceReplay | None:
        return TraceReplay(1, "recent", True, f"routing/{spec.server_id}.trace")


def use_fake_engine() -> None:
    from benchsuite.engines import ADAPTERS

    ADAPTERS._loaded["builtin"] = FakeAdapter()  # type: ignore[attr-defined]


@pytest.fixture(autouse=True)
def fake_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    from benchsuite.engines import ADAPTERS

    monkeypatch.setitem(ADAPTERS._loaded, "builtin", FakeAdapter())  # type: ignore[attr-defined]


def matrix(tmp_path: Path, engines: dict[str, Any], concurrency: Sequence[int] = (1, 2), num_requests: int = 3) -> Path:
    body = {
        "name": "fake",
        "output_root": str(tmp_path / "results"),
        "engines": {name: {"kind": "builtin", "options": options} for name, options in engines.items()},
        "workloads": {
            "w": {
                "output_tokens": 4,
                "concurrency": list(concurrency),
                "num_requests": num_requests,
                "warmup_requests": 1,
            }
        },
    }
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump(body))
    return path


def run_cli(*args: str) -> int:
    from benchsuite.cli import main

    return main(["run", *args, "--quiet", "--no-report"])


def only_run_dir(tmp_path: Path) -> Path:
    (run_dir,) = (tmp_path / "results").iterdir()
    return run_dir


def cells(run_dir: Path) -> dict[str, dict[str, Any]]:
    return {p.stem: json.loads(p.read_text()) for p in (run_dir / "cells").glob("*.json")}


def starts(log: Path) -> int:
    return log.read_text().count("# benchsuite: starting")


def orphans(tag: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if "--serve" in cmdline and tag in cmdline:
            found.append(proc)
    return found


def test_each_server_starts_once_and_a_rerun_skips_finished_cells(tmp_path: Path) -> None:
    path = matrix(tmp_path, {"e": {"label": [1, 2]}})
    assert run_cli(str(path)) == 0
    run_dir = only_run_dir(tmp_path)
    stored = cells(run_dir)
    assert len(stored) == 4 and {c["cell"]["status"] for c in stored.values()} == {"ok"}
    logs = sorted((run_dir / "logs").glob("*.log"))
    assert len(logs) == 2 and [starts(log) for log in logs] == [1, 1]
    one = next(iter(stored.values()))
    assert one["cell"]["params"] in ({"label": 1}, {"label": 2})
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert all("--serve" in s["argv"] for s in manifest["servers"].values())
    assert manifest["machine"]["cpu_cores_logical"] >= 1 and manifest["machine"]["packages"]["aiohttp"]
    assert len(manifest["git"]["commit"]) == 40 and manifest["git"]["source"] == "package"
    metrics = json.loads(next((run_dir / "engine_metrics").glob("*.json")).read_text())
    assert metrics["after"]["paged_experts:expert_hits_total"] > metrics["before"]["paged_experts:expert_hits_total"]
    # every cell flushes the prefix cache before its warm-ups and again after them (they sent measured prompts);
    # warm-ups: one per stream, one more in a server's first cell (its first request goes alone): c=1 sends
    # 1 + 1, then 3 measured; c=2 sends 2 (the flush before c=2's warm-ups comes 2 + 3 completions after the first)
    flushes = [[int(w) for w in re.findall(r"flush after (\d+) completions", log.read_text())] for log in logs]
    assert flushes == [[0, 2, 5, 7]] * 2
    for payload in stored.values():
        c = payload["cell"]
        measured = [r for r in payload["requests"] if not r["warmup"]]
        assert len(measured) == 3 and c["output_tokens_total"] == 12
        # each completion adds 3 hits and 1 miss to the fake's counters; the warmup is not counted
        assert c["expert_hits"] == 3 * 3 and c["miss_rate"] == pytest.approx(0.25)
    before = {p.name: p.read_bytes() for p in (run_dir / "cells").glob("*.json")}
    assert run_cli(str(path)) == 0
    assert [starts(log) for log in logs] == [1, 1]  # nothing started again
    assert {p.name: p.read_bytes() for p in (run_dir / "cells").glob("*.json")} == before
    assert len(json.loads((run_dir / "manifest.json").read_text())["invocations"]) == 2


def test_interleaved_repeats_launch_per_repeat_and_every_cell_records_the_machine(tmp_path: Path) -> None:
    path = matrix(tmp_path, {"a": {}, "b": {"label": 2}}, concurrency=[1])
    body = yaml.safe_load(path.read_text())
    path.write_text(yaml.safe_dump({**body, "repeats": 2, "repeat_order": "interleaved"}))
    assert run_cli(str(path)) == 0
    run_dir = only_run_dir(tmp_path)
    assert [starts(log) for log in sorted((run_dir / "logs").glob("*.log"))] == [
        2,
        2,
    ]  # one launch per server and repeat
    stored = sorted((c["cell"] for c in cells(run_dir).values()), key=lambda c: c["repeat"])
    assert [c["repeat"] for c in stored] == [0, 0, 1, 1]
    for cell in stored:
        noise = cell["extras"]["machine"]
        assert noise["before"]["load_1m"] >= 0 and noise["after"]["cpus"] >= 1 and noise["wall_s"] > 0
        assert noise["other_cores"] >= 0 and isinstance(noise["busy"], bool)


def test_failures_are_recorded_the_rest_continues_and_a_rerun_retries(tmp_path: Path) -> None:
    engines = {"crash": {"behaviour": "crash"}, "dies": {"behaviour": "die", "die_after": 2}, "good": {}}
    path = matrix(tmp_path, engines)
    assert run_cli(str(path)) == 1
    run_dir = only_run_dir(tmp_path)
    by_engine: dict[str, list[dict[str, Any]]] = {}
    for payload in cells(run_dir).values():
        by_engine.setdefault(payload["cell"]["engine"], []).append(payload["cell"])
    assert {c["status"] for c in by_engine["good"]} == {"ok"}
    assert all(c["status"] == "failed" and "engine did not start" in c["reason"] for c in by_engine["crash"])
    assert any("Traceback (most recent call last)" in c["reason"] for c in by_engine["crash"])
    assert {c["status"] for c in by_engine["dies"]} == {"failed"}
    assert all("engine exited" in c["reason"] or "Error" in c["reason"] for c in by_engine["dies"])
    assert (run_dir / "cells.csv").read_text().count("failed") == 4
    assert run_cli(str(path)) == 1  # failed cells run again once per rerun; earlier attempts kept
    attempts = sorted(p.name for p in (run_dir / "attempts").iterdir())
    assert len(attempts) == 4 and all(name.endswith(".1.json") for name in attempts)
    assert {c["attempt"] for c in cells(run_dir).values() if c["cell"]["engine"] == "good"} == {1}


def test_a_hung_engine_fails_its_cell_by_timeout_and_its_later_cells_at_once(tmp_path: Path) -> None:
    tag = f"tag-{tmp_path.name}"
    path = matrix(
        tmp_path, {"hung": {"behaviour": "hang", "die_after": 1, "tag": tag}}, concurrency=[1, 2], num_requests=2
    )
    t0 = time.monotonic()
    assert run_cli(str(path), "--cell-timeout-s", "3") == 1
    assert time.monotonic() - t0 < 60  # one timeout, not one per cell
    assert orphans(tag) == []
    first, second = sorted((p["cell"] for p in cells(only_run_dir(tmp_path)).values()), key=lambda c: c["concurrency"])
    assert first["status"] == "failed" and first["reason"].startswith("TimeoutError: engine did not finish cell")
    assert "within 3 s" in first["reason"]
    assert second["status"] == "failed" and second["reason"].startswith(
        "engine did not finish cell " + first["cell_id"]
    )


def test_a_port_taken_before_launch_fails_that_server_and_the_rest_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import socket

    from benchsuite.run import process, server_launch

    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen(1)
    ports = iter([squatter.getsockname()[1]])
    monkeypatch.setattr(server_launch, "free_port", lambda: next(ports, None) or process.free_port())
    try:
        assert run_cli(str(matrix(tmp_path, {"first": {}, "second": {}}, concurrency=[1], num_requests=2))) == 1
    finally:
        squatter.close()
    status = {
        p["cell"]["engine"]: (p["cell"]["status"], p["cell"]["reason"]) for p in cells(only_run_dir(tmp_path)).values()
    }
    assert status["first"][0] == "failed" and "already in use" in status["first"][1]
    assert status["second"] == ("ok", None)


def test_sigkill_mid_run_then_rerun_completes_and_keeps_what_was_written(tmp_path: Path) -> None:
    tag = f"tag-{tmp_path.name}"
    # six cells of about a second each: the kill lands after the first one, long before the last
    path = matrix(
        tmp_path, {"slow": {"token_delay_s": 0.05, "tag": tag}}, concurrency=[1, 2, 3, 4, 5, 6], num_requests=4
    )
    child = subprocess.Popen(
        [sys.executable, str(HERE), "--cli", str(path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not list((tmp_path / "results").glob("*/cells/*.json")):
            time.sleep(0.1)
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
    run_dir = only_run_dir(tmp_path)
    written = {p.name: p.read_bytes() for p in (run_dir / "cells").glob("*.json")}
    assert 1 <= len(written) < 6
    deadline = time.monotonic() + 10
    while orphans(tag) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert orphans(tag) == []  # the engine died with its parent
    assert run_cli(str(path)) == 0
    after = {p.name: p.read_bytes() for p in (run_dir / "cells").glob("*.json")}
    assert len(after) == 6 and all(after[name] == data for name, data in written.items())


def test_ctrl_c_stops_the_engine_keeps_results_and_exits_130(tmp_path: Path) -> None:
    tag = f"tag-{tmp_path.name}"
    path = matrix(tmp_path, {"slow": {"token_delay_s": 0.05, "tag": tag}}, concurrency=[1, 2, 3, 4], num_requests=4)
    child = subprocess.Popen(
        [sys.executable, str(HERE), "--cli", str(path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        # as a terminal's foreground job: a test runner started in the background ignores SIGINT, and the
        # runner would inherit that (and rightly keep ignoring it)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not list((tmp_path / "results").glob("*/cells/*.json")):
            time.sleep(0.1)
        child.send_signal(signal.SIGINT)
        out, _ = child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == 130, out
    assert "interrupted; finished cells are kept" in out
    assert orphans(tag) == []
    run_dir = only_run_dir(tmp_path)
    assert list((run_dir / "cells").glob("*.json"))
    assert (run_dir / "cells.parquet").exists()


def test_a_search_hands_back_options_that_then_run_every_workload(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import benchsuite.run.search
    from benchsuite.errors import RunError

    seen = []

    async def found(ctx: Any, task: Any) -> EngineOptions:
        seen.append((task.option, task.spec.options.label))
        return task.spec.options.replaced(label=5)

    monkeypatch.setattr(benchsuite.run.search, "run_search", found)
    path = matrix(tmp_path, {"s": {"label": "search"}}, concurrency=[1], num_requests=2)
    assert run_cli(str(path)) == 0
    assert seen == [("label", "search")]
    (stored,) = cells(only_run_dir(tmp_path)).values()
    assert stored["cell"]["status"] == "ok" and stored["cell"]["params"] == {"label": 5}

    async def nothing_fits(ctx: Any, task: Any) -> EngineOptions:
        raise RunError("engine s: no label value fits")

    monkeypatch.setattr(benchsuite.run.search, "run_search", nothing_fits)
    assert run_cli(str(path), "--run-id", "again") == 1
    manifest = json.loads((tmp_path / "results" / "again" / "manifest.json").read_text())
    assert [s.get("search_error") for s in manifest["servers"].values()] == ["engine s: no label value fits"]


def test_datasets_reach_the_engine_as_text_or_exact_token_ids(tmp_path: Path, tiny_model_dir: Path) -> None:
    sharegpt = [{"id": f"sg{i}",
                 "conversations": [{"from": "human", "value": f"question {i}"}, {"from": "gpt", "value": "a"}]}
                for i in range(4)]  # fmt: skip
    (tmp_path / "sg.json").write_text(json.dumps(sharegpt))
    path = matrix(tmp_path, {"e": {"tokenizer": str(tiny_model_dir)}}, concurrency=[1], num_requests=2)
    body = yaml.safe_load(path.read_text())
    w = body["workloads"].pop("w")
    body["workloads"] = {
        "sg": {**w, "dataset": "sharegpt", "path": "sg.json"},
        "rnd": {**w, "dataset": "random"},
        "exact": {**w, "prompt_classes": ["8"]},
    }
    path.write_text(yaml.safe_dump(body))
    assert run_cli(str(path)) == 0
    stored = {p["cell"]["workload"]: p["requests"] for p in cells(only_run_dir(tmp_path)).values()}
    ids = {w: {r["prompt_id"] for r in rs} for w, rs in stored.items()}
    tokens = {w: {r["prompt_tokens"] for r in rs} for w, rs in stored.items()}
    assert tokens == {"sg": {5}, "rnd": {32}, "exact": {8}}  # text, then token ids of exact length
    assert ids["sg"] <= {f"sg{i}" for i in range(4)} and len(ids["sg"]) == 2
    assert all(i.startswith("rand32-s0-") for i in ids["rnd"])
    assert all(i.startswith("len8-s0-") for i in ids["exact"])


async def test_a_recording_server_gets_the_time_to_write_its_trace_and_no_earlier_trace_stands_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A search's launch at the chosen value and the server of its cells share an id, so the trace path: the
    server's own trace must be the one replayed. Killed at the default 5 s grace, the H200's recording servers
    left the search launch's trace in place (2026-12-03: "the trace holds 390 steps")."""
    from benchsuite.config.matrix import load_matrix
    from benchsuite.config.plan import build_plan
    from benchsuite.engines import ADAPTERS
    from benchsuite.run.context import RunContext
    from benchsuite.run.runner import client_session, open_store
    from benchsuite.run.server_launch import launch_server

    monkeypatch.setitem(ADAPTERS._loaded, "builtin", RecordingAdapter())  # type: ignore[attr-defined]
    plan = build_plan(load_matrix(matrix(tmp_path, {"r": {"stop_s": 6.0}}, concurrency=[1])))
    store = open_store(plan)
    spec = plan.servers[0]
    trace = store.run_dir / "routing" / f"{spec.server_id}.trace"
    trace.parent.mkdir(parents=True)
    trace.write_text("an earlier server's trace")
    try:
        async with client_session() as session:
            async with launch_server(RunContext(plan, store, session), spec) as server:
                assert not trace.exists()  # gone before this server started
                port = server.base_url.rsplit(":", 1)[1]
    finally:
        store.close()
    assert trace.read_text() == f"written by the server on port {port}"  # 6 s: past the default 5 s grace


# ---- the fake engine ---------------------------------------------------------------------------


def serve(args: argparse.Namespace) -> None:
    import asyncio

    from aiohttp import web

    if args.behaviour == "crash":
        print("Traceback (most recent call last):\n  RuntimeError: fake engine cannot start", flush=True)
        sys.exit(1)
    counters = {"hits": 0, "misses": 0, "tokens": 0, "completions": 0}

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def flush(request: web.Request) -> web.Response:
        print(f"flush after {counters['completions']} completions", flush=True)  # what the runner's tests read
        return web.Response(text="flushed")

    async def metrics(request: web.Request) -> web.Response:
        text = (
            f"paged_experts:expert_hits_total {counters['hits']}\n"
            f"paged_experts:expert_misses_total {counters['misses']}\n"
            f"paged_experts:generation_tokens_total {counters['tokens']}\n"
        )
        return web.Response(text=text)

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        counters["completions"] += 1
        if args.behaviour == "die" and counters["completions"] > args.die_after:
            print("Segmentation fault (fake)", flush=True)
            os._exit(139)
        if args.behaviour == "hang" and counters["completions"] > args.die_after:
            time.sleep(3600)  # blocks the event loop: health, metrics and flush stop answering too
        if args.behaviour == "stall" and counters["completions"] > args.die_after:
            await asyncio.sleep(3600)  # this request never answers; the server does
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        n = int(body["max_tokens"])
        for i in range(n):
            await asyncio.sleep(args.token_delay_s)
            chunk = {"choices": [{"index": 0, "text": f" t{i}", "finish_reason": "length" if i == n - 1 else None}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        counters["hits"] += 3
        counters["misses"] += 1
        counters["tokens"] += n
        prompt_tokens = len(body["prompt"]) if isinstance(body["prompt"], list) else 5  # ids are counted as sent
        usage = {
            "choices": [],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": n + prompt_tokens},
        }
        await resp.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/flush_cache", flush)
    app.router.add_post("/v1/completions", completions)
    if args.trace:

        def write_trace_now() -> None:
            time.sleep(args.stop_s)
            Path(args.trace).parent.mkdir(parents=True, exist_ok=True)
            Path(args.trace).write_text(f"written by the server on port {args.port}")

        def early_term(signum: int, frame: object) -> None:  # before aiohttp takes SIGTERM over
            write_trace_now()
            os._exit(0)

        signal.signal(signal.SIGTERM, early_term)

        async def write_trace(app: web.Application) -> None:  # on SIGTERM, as the built-in server writes its trace
            write_trace_now()

        app.on_shutdown.append(write_trace)  # first in aiohttp's shutdown: no open connection delays it
    web.run_app(app, host="127.0.0.1", port=args.port, print=None)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--cli"]:
        use_fake_engine()
        from benchsuite.cli import main

        sys.exit(main(["run", *sys.argv[2:], "--no-report"]))
    parser = argparse.ArgumentParser()
    parser.add_argument("--serve", action="store_true")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--behaviour", default="ok")
    parser.add_argument("--die-after", type=int, default=0)
    parser.add_argument("--token-delay-s", type=float, default=0.0)
    parser.add_argument("--tag", default="")
    parser.add_argument("--trace", default="")
    parser.add_argument("--stop-s", type=float, default=0.0)
    serve(parser.parse_args())
