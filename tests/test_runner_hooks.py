"""The runner's optional adapter hooks and end-of-server steps: per-cell engine flags (SGLang's log
parsing on a written log excerpt), the routing capture after a server's cells (SGLang adapter against
a scripted endpoint), per-request timeouts that keep a cell's records, max_error_rate, and the leak
canary at the end of a run on the real built-in server (manifest and report)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
import yaml
from aiohttp.test_utils import TestServer

from benchsuite.config.matrix import load_matrix
from benchsuite.config.plan import Plan, build_plan
from benchsuite.engines.sglang.adapter import SGLangAdapter
from benchsuite.report.flags import cell_flags
from benchsuite.run import cell as cell_measure
from benchsuite.run import runner
from benchsuite.run.context import RunContext
from benchsuite.run.server_launch import RunningServer

try:
    from test_runner import FakeAdapter, matrix, only_run_dir, run_cli
    from test_sglang_routing import CONFIG, _fake_sglang
except ImportError:  # run from inside tests/
    from test_runner import FakeAdapter, matrix, only_run_dir, run_cli  # type: ignore[no-redef]
    from test_sglang_routing import CONFIG, _fake_sglang  # type: ignore[no-redef]

from paged_experts.routing.trace import read_trace

# SGLang 0.5.23 lines (formats from benchsuite.engines.sglang.logs): paged K=26, decode graphs up to batch 3,
# a KV pool of 10,000 tokens where the matrix fixed 10,240. A backslash at a line end continues the log line.
SGLANG_LOG = """\
[2026-11-29 10:00:01] server_args={'model_path': '/m', 'max_total_tokens': 10240, \
'enable_paged_experts': True, 'paged_experts_num_resident': 26}
[2026-11-29 10:00:11 TP0] Paged experts: decode CUDA graphs captured at batch sizes [1, 2, 3] (at most K // top_k)
[2026-11-29 10:02:01 TP0] Capture target decode CUDA graph end. bs=[1, 2, 3], elapsed=6.12 s, \
mem usage=0.05 GB, avail mem=0.69 GB.
[2026-11-29 10:02:02 TP0] max_total_num_tokens=10000, chunked_prefill_size=2048, max_prefill_tokens=16384, \
max_running_requests=4, context_len=40960, available_gpu_mem=0.69 GB
"""


def sglang_plan(tmp_path: Path, options: dict[str, Any], concurrency: list[int]) -> Plan:
    body = {
        "name": "sg",
        "output_root": str(tmp_path / "results"),
        "fairness": {"kv_capacity_tokens": 10240},
        "engines": {
            "sg": {"kind": "sglang", "options": {"model_path": str(tmp_path / "model"), "mode": "unpaged", **options}}
        },
        "workloads": {"w": {"output_tokens": 3, "concurrency": concurrency, "num_requests": 2}},
    }
    (tmp_path / "model").mkdir(exist_ok=True)
    (tmp_path / "model" / "config.json").write_text(json.dumps(CONFIG))
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump(body))
    return build_plan(load_matrix(path))


def test_sglang_flags_from_the_log_are_stored_per_cell_and_read_by_the_report(tmp_path: Path) -> None:
    plan = sglang_plan(tmp_path, {}, [2, 4])
    (spec,) = plan.servers
    log = tmp_path / "server.log"
    log.write_text(SGLANG_LOG)
    by_concurrency = {c.concurrency: c for c in plan.cells}
    low = cell_measure.log_extras(SGLangAdapter(), spec, by_concurrency[2], log)
    high = cell_measure.log_extras(SGLangAdapter(), spec, by_concurrency[4], log)
    kv = "KV pool holds 10000 tokens, not the 10240 the matrix fixed for every engine"
    assert low["flags"] == [kv]
    assert len(high["flags"]) == 2 and high["flags"][1] == kv
    assert high["flags"][0].startswith("concurrency 4 exceeds the largest captured decode batch 3 (paged experts caps")
    assert high["engine_log"]["batch_cap"] == 3
    assert cell_flags(pd_row(high)) == high["flags"]
    # an adapter without the hook: checked, nothing to say
    assert cell_measure.log_extras(FakeAdapter(), spec, by_concurrency[4], log) == {"flags": []}


def pd_row(extras: dict[str, Any]) -> Any:
    import pandas as pd

    return pd.Series({"extras": extras, "usage_mismatches": 0})


async def test_routing_capture_after_the_cells_writes_a_trace_and_records_it(tmp_path: Path) -> None:
    plan = sglang_plan(tmp_path, {"return_routed_experts": True}, [1])
    (spec,) = plan.servers
    assert "--enable-return-routed-experts" in SGLangAdapter().launch_plan(spec, 1).argv
    store = runner.open_store(plan)
    bodies: list[dict[str, Any]] = []
    async with TestServer(_fake_sglang(bodies)) as http, aiohttp.ClientSession() as session:
        ctx = RunContext(plan, store, session)
        server = RunningServer(spec, SGLangAdapter(), None, str(http.make_url("")).rstrip("/"), [])  # type: ignore[arg-type]
        await runner._after_cells(ctx, server, plan.cells_of(spec.server_id))
    entry = json.loads((store.run_dir / "manifest.json").read_text())["servers"][spec.server_id]
    facts = entry["facts"]  # the adapter hook's facts (ServerRecord.facts)
    assert facts["routing_trace"] == f"routing/{spec.server_id}.trace" and facts["routing_requests"] == 2
    assert entry["canary"] is None  # the matrix did not ask for one
    # the cells' two prompts, sent once more for their routing
    assert len(bodies) == 2 and all(b["return_routed_experts"] and b["max_tokens"] == 3 for b in bodies)
    trace = read_trace(store.run_dir / facts["routing_trace"])
    prompt_tokens = [len(b["prompt"].split()) for b in bodies]
    assert (
        trace.num_tokens == sum(p + 3 - 1 for p in prompt_tokens) and trace.meta.top_k == CONFIG["num_experts_per_tok"]
    )
    assert np.asarray(trace.ids).max() < CONFIG["num_experts"]


async def test_a_failed_routing_capture_is_recorded_not_raised(tmp_path: Path) -> None:
    plan = sglang_plan(tmp_path, {"return_routed_experts": True}, [1])
    (spec,) = plan.servers
    store = runner.open_store(plan)
    async with TestServer(aiohttp.web.Application()) as http, aiohttp.ClientSession() as session:  # answers 404
        server = RunningServer(spec, SGLangAdapter(), None, str(http.make_url("")).rstrip("/"), [])  # type: ignore[arg-type]
        await runner._after_cells(RunContext(plan, store, session), server, plan.cells_of(spec.server_id))
    entry = json.loads((store.run_dir / "manifest.json").read_text())["servers"][spec.server_id]
    error = entry["facts"]["after_cells_error"]
    assert error.startswith("RunError: routing capture:") and "HTTP 404" in error
    assert not (store.run_dir / "routing").exists()


def test_a_request_that_never_answers_fails_alone_and_the_cell_keeps_its_records(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from benchsuite.engines import ADAPTERS

    monkeypatch.setitem(ADAPTERS._loaded, "builtin", FakeAdapter())  # type: ignore[attr-defined]
    # two warm-ups (the first cell of a server sends one more: its first request goes alone) + 2 measured
    # answer, the third measured request never does; the server stays up
    engines = {"e": {"behaviour": "stall", "die_after": 4}}
    path = matrix(tmp_path, engines, concurrency=[1], num_requests=3)
    assert run_cli(str(path), "--request-timeout-s", "1", "--cell-timeout-s", "120") == 0
    (payload,) = [json.loads(p.read_text()) for p in (only_run_dir(tmp_path) / "cells").glob("*.json")]
    cell, measured = payload["cell"], [r for r in payload["requests"] if not r["warmup"]]
    assert cell["status"] == "invalid" and cell["reason"] == "error rate 0.333 > allowed 0.000"
    assert [r["ok"] for r in measured] == [True, True, False] and "timeout after 1 s" in measured[2]["error"]
    # the same cell with a tolerated error rate is ok, its figures from the two answered requests
    body = yaml.safe_load(path.read_text())
    body["workloads"]["w"]["max_error_rate"] = 0.5
    body["output_root"] = str(tmp_path / "lenient")
    path.write_text(yaml.safe_dump(body))
    assert run_cli(str(path), "--request-timeout-s", "1") == 0
    (run_dir,) = (tmp_path / "lenient").iterdir()
    (payload,) = [json.loads(p.read_text()) for p in (run_dir / "cells").glob("*.json")]
    assert payload["cell"]["status"] == "ok" and payload["cell"]["error_rate"] == pytest.approx(1 / 3)


@pytest.mark.slow
def test_canary_at_the_end_of_a_run_is_stored_and_shown(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from benchsuite.cli import main
    from benchsuite.engines import ADAPTERS
    from benchsuite.engines.builtin.adapter import BuiltinAdapter

    monkeypatch.setitem(ADAPTERS._loaded, "builtin", BuiltinAdapter())  # type: ignore[attr-defined]
    monkeypatch.chdir(tmp_path)  # the report goes to ./reports/<run-id>
    body = {
        "name": "canary",
        "canary": True,
        "fairness": {"kv_capacity_tokens": 2048},
        "engines": {
            "paged": {
                "kind": "builtin",
                "options": {"model": str(tiny_model_dir), "mode": "paged", "resident_experts": 8},
            }
        },
        "workloads": {"w": {"output_tokens": 4, "concurrency": [2], "num_requests": 2, "warmup_requests": 0}},
    }
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump(body))
    assert main(["run", str(path), "--output-root", str(tmp_path / "results"), "--quiet"]) == 0
    run_dir = only_run_dir(tmp_path)
    (server,) = json.loads((run_dir / "manifest.json").read_text())["servers"].values()
    canary = server["canary"]
    assert canary["passed"] is True and canary["leaks"] == [] and canary["requests_checked"] == 8 + 8 + 1
    assert canary["marker"].startswith("CANARY-")
    (payload,) = [json.loads(p.read_text()) for p in (run_dir / "cells").glob("*.json")]
    assert payload["cell"]["extras"]["flags"] == []
    page = (tmp_path / "reports" / run_dir.name / "index.html").read_text()
    assert "canary: passed (17 responses checked)" in page and "LEAK CANARY FAILED" not in page
