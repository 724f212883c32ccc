"""The report's per-request prefill table (benchsuite.report.prefill_requests): a cell's measured requests split
at their median TTFT, each half's medians of the engine's own prefill keys; warm-up, failed and key-less requests
left out; cells with fewer than two such requests, cells above concurrency 1 and runs stored before the keys give
no row; two runs that share cell ids keep their own requests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from benchsuite.report.load import RunData
from benchsuite.report.prefill_requests import prefill_requests_table, request_figures
from benchsuite.results.manifest import Manifest


def cell(cid: str, concurrency: int = 1, run_id: str = "r") -> dict[str, Any]:
    return {"cell_id": cid, "run_id": run_id, "label": "tiny · paged", "routing": "synthetic:qwen3-30b-a3b",
            "workload": "w", "prompt_class": "2048", "concurrency": concurrency, "repeat": 0}  # fmt: skip


def request(cid: str, ttft_s: float, issue_ms: float | None, plan_ms: float, *, warmup: bool = False,
            ok: bool = True, shared: int = 0, as_text: bool = True) -> dict[str, Any]:  # fmt: skip
    timings: dict[str, Any] = {"prompt_n": 2048, "predicted_n": 8, "prompt_ms": ttft_s * 1e3 - 5}
    if issue_ms is not None:
        timings |= {"prefill_steps": 1, "prefill_shared_steps": shared, "prefill_layer_steps": 48,
                    "prefill_issue_ms": issue_ms, "prefill_issue_cpu_ms": issue_ms * 0.9,
                    "prefill_host_plan_ms": plan_ms * 48, "prefill_host_wait_ms": 0.48,
                    "prefill_router_ms": 9.0}  # fmt: skip
    return {"cell_id": cid, "warmup": warmup, "ok": ok, "t_sent_s": 100.0, "t_first_token_s": 100.0 + ttft_s,
            "engine_timings": json.dumps(timings) if as_text else timings}  # fmt: skip


def run(requests: list[dict[str, Any]], run_id: str = "r") -> RunData:
    manifest = Manifest(run_id=run_id, created_utc="now", matrix_source="m.yaml", matrix_hash="h", matrix={})
    return RunData(run_id, Path("."), manifest, pd.DataFrame(), pd.DataFrame(requests))


def test_the_requests_split_at_the_median_ttft_and_each_half_shows_its_hosts_side() -> None:
    requests = [
        request("a", 0.40, 300.0, 5.0), request("a", 0.41, 310.0, 5.2, as_text=False),  # the dict a fresh run holds
        request("a", 0.50, 490.0, 7.0), request("a", 0.52, 500.0, 7.5), request("a", 0.55, 520.0, 8.0),
        request("a", 0.10, 90.0, 1.0, warmup=True), request("a", 0.05, 40.0, 1.0, ok=False),  # never counted
    ]  # fmt: skip
    table = prefill_requests_table(pd.DataFrame([cell("a")]), [run(requests)])
    assert list(table["half"]) == ["fast", "slow"] and list(table["requests"]) == [2, 3]  # the odd one is slow
    fast, slow = (row for _, row in table.iterrows())
    assert fast["ttft_s"] == pytest.approx(0.405) and slow["ttft_s"] == pytest.approx(0.52)
    assert fast["prompt_ms"] == pytest.approx(400.0) and slow["issue_ms"] == pytest.approx(500.0)
    assert fast["issue_of_prompt"] == pytest.approx((300 / 395 + 310 / 405) / 2)
    assert slow["issue_of_prompt"] == pytest.approx(500 / 515)
    assert (fast["host_plan_ms"], slow["host_plan_ms"]) == pytest.approx((5.1, 7.5))  # per layer-step
    assert fast["host_wait_ms"] == pytest.approx(0.01) and fast["router_ms"] == 9.0
    assert (fast["on_cpu"], slow["on_cpu"]) == pytest.approx((0.9, 0.9))
    assert fast["shared_steps"] == 0


def test_cells_without_two_requests_with_the_keys_or_above_concurrency_one_give_no_row() -> None:
    requests = [request("one", 0.4, 300.0, 5.0), request("one", 0.5, None, 0.0),  # one has no prefill keys
                request("c4", 0.4, 300.0, 5.0, shared=1), request("c4", 0.8, 320.0, 5.0, shared=1)]  # fmt: skip
    # at c=4 a TTFT holds the request's place in the queue: a split on it sorts by arrival, not speed
    assert prefill_requests_table(pd.DataFrame([cell("one"), cell("c4", concurrency=4)]), [run(requests)]).empty
    assert prefill_requests_table(pd.DataFrame([cell("a")]), [run([])]).empty  # a run without requests


def test_two_runs_with_the_same_cell_ids_keep_their_own_requests() -> None:
    first = [request("a", 0.40, 300.0, 5.0), request("a", 0.41, 300.0, 5.0)]
    second = [request("a", 0.60, 500.0, 9.0), request("a", 0.61, 500.0, 9.0)]
    cells = pd.DataFrame([cell("a", run_id="r1"), cell("a", run_id="r2")])
    table = prefill_requests_table(cells, [run(first, "r1"), run(second, "r2")]).set_index(["run_id", "half"])
    assert table.loc[("r1", "fast"), "ttft_s"] == pytest.approx(0.40)
    assert table.loc[("r1", "slow"), "ttft_s"] == pytest.approx(0.41)
    assert table.loc[("r2", "fast"), "ttft_s"] == pytest.approx(0.60) and table.loc[("r2", "slow"), "host_plan_ms"] == 9


def test_request_figures_keep_warm_up_and_key_less_requests_for_the_analysis_script() -> None:
    """benchmarks/prefill_speeds.py lists every request, older runs' too: the figures the engine did not send are
    None, warm-up requests are kept and marked, failed ones and those without the engine's prompt_ms are left out."""
    requests = [request("a", 0.40, 300.0, 5.0, warmup=True), request("a", 0.50, None, 0.0),
                request("a", 0.30, 200.0, 5.0, ok=False),
                {**request("a", 0.2, None, 0.0), "engine_timings": None}]  # fmt: skip
    figures = request_figures("r", pd.DataFrame(requests))
    assert list(figures["warmup"]) == [True, False] and list(figures["ttft_s"]) == pytest.approx([0.40, 0.50])
    assert figures.loc[0, "issue_of_prompt"] == pytest.approx(300 / 395) and pd.isna(figures.loc[1, "issue_ms"])
    assert pd.isna(figures.loc[1, "on_cpu"]) and pd.isna(figures.loc[1, "host_plan_ms"])


def test_each_half_says_how_the_engine_thread_spent_its_time_and_what_the_sampler_read_meanwhile() -> None:
    """The thread's scheduling keys (queued, blocked, switches, CPUs) and the memory sampler's NVML read time inside
    each request's wait for its first token (its record's sampler_read_s), per half; a run stored before either has
    None there, not 0."""

    def sched(req: dict[str, Any], delay_ms: float, voluntary: int, cpu: int, read_s: float) -> dict[str, Any]:
        timings = json.loads(req["engine_timings"])
        timings |= {
            "prefill_issue_run_delay_ms": delay_ms, "prefill_issue_voluntary_switches": voluntary,
            "prefill_issue_involuntary_switches": 2, "prefill_cpu_id_first": cpu, "prefill_cpu_id_last": cpu,
        }  # fmt: skip
        return {**req, "engine_timings": json.dumps(timings), "sampler_read_s": read_s}

    requests = [
        sched(request("a", 0.40, 400.0, 5.0), 4.0, 1, cpu=3, read_s=0.0),
        sched(request("a", 0.41, 400.0, 5.0), 4.0, 3, cpu=5, read_s=0.0),
        sched(request("a", 0.50, 500.0, 7.0), 50.0, 9, cpu=3, read_s=0.004),
        sched(request("a", 0.52, 500.0, 7.0), 50.0, 11, cpu=3, read_s=0.002),
    ]
    fast, slow = (row for _, row in prefill_requests_table(pd.DataFrame([cell("a")]), [run(requests)]).iterrows())
    assert (fast["queued"], slow["queued"]) == pytest.approx((0.01, 0.1))  # run delay over issue time
    assert (fast["blocked"], slow["blocked"]) == pytest.approx((0.09, 0.0))  # 1 - on_cpu (0.9) - queued
    assert (fast["switches"], slow["switches"]) == ("2/2", "10/2")  # voluntary / involuntary medians
    assert (fast["cpu_ids"], slow["cpu_ids"]) == ("3,5", "3")
    assert (fast["sampler_ms"], slow["sampler_ms"]) == pytest.approx((0.0, 3.0))  # medians of (0, 0) and (4, 2)
    many = [sched(request("b", 0.4 + i / 100, 400.0, 5.0), 4.0, 1, cpu=i, read_s=0.0) for i in range(12)]
    assert set(prefill_requests_table(pd.DataFrame([cell("b")]), [run(many)])["cpu_ids"]) == {"6 CPUs"}
    # a run without the keys or the sampler's reads: unknown, not 0
    old = prefill_requests_table(pd.DataFrame([cell("a")]), [run([request("a", 0.4, 400.0, 5.0)] * 2)])
    assert old[["queued", "blocked", "switches", "sampler_ms", "cpu_ids"]].isna().all().all()
