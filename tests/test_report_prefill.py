"""The report's prefill section (benchsuite.report.prefill): the floor arithmetic on hand-made cells,
a run without a link figure (bytes and times only, and why), runs stored before the prefill counters,
and end to end: `benchsuite run` of resident + paged on the real built-in server, a scripted link
probe, then the section built from the store."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import yaml

import benchsuite.tools.linkbw
from benchsuite.cli import main
from benchsuite.report import prefill_requests
from benchsuite.report.build import build_report_data
from benchsuite.report.load import RunData
from benchsuite.report.prefill import TITLE, prefill_table
from benchsuite.results.manifest import Manifest
from benchsuite.tools import device_memory


def cell(cid: str, mode: str, ttft: float | None, chunk_bytes: float | None, *, cls: str = "2048", status: str = "ok",
         repeat: int = 0, chunks: int | None = 4, concurrency: int = 1) -> dict[str, Any]:  # fmt: skip
    return {"cell_id": cid, "run_id": "r", "engine_kind": "builtin", "mode": mode, "label": f"tiny · {mode}",
            "routing": "synthetic:qwen3-30b-a3b", "workload": "w", "prompt_class": cls, "concurrency": concurrency,
            "repeat": repeat, "status": status, "ttft_p50_s": ttft, "prefill_chunks": chunks,
            "prefill_bytes_per_chunk": chunk_bytes, "prefill_router_s_per_chunk": 0.05,
            "prefill_copy_s_per_chunk": 0.6, "prefill_span_s_per_chunk": 0.8, "prefill_copy_busy": 0.75,
            "prefill_waves_per_layer": 10.0, "decode_tok_s_p50": 20.0, "decode_miss_rate": 0.2,
            "ttft_p90_s": None if ttft is None else ttft * 1.5, "gc_pause_s": 0.004, "num_requests": 4,
            "gc_full_collections": 1, "prefill_host_wait_s": 0.0005, "prefill_host_plan_s": 0.007}  # fmt: skip


def run(link: dict[str, Any] | None) -> RunData:
    manifest = Manifest(run_id="r", created_utc="now", matrix_source="m.yaml", matrix_hash="h", matrix={},
                        link_bandwidth=link)  # fmt: skip
    return RunData("r", Path("."), manifest, pd.DataFrame(), pd.DataFrame())


def test_floor_from_the_bytes_per_chunk_and_the_link() -> None:
    cells = pd.DataFrame([
        cell("res0", "resident", 0.30, 0.0), cell("res1", "resident", 0.34, 0.0, repeat=1),
        cell("pg", "paged", 1.3, 50e9),  # 50 GB at 50 GB/s: a 1 s floor
        cell("short", "paged", 0.2, 20e9, cls="short"),  # no resident cell of class short
        cell("decode-only", "paged", 0.1, None, chunks=0),  # no prompt chunk: not a row
        cell("bad", "paged", None, 50e9, status="failed"),
    ])  # fmt: skip
    table = prefill_table(cells, [run({"paging_gb_per_s": 50.0})]).set_index("cell_id")
    assert set(table.index) == {"res0", "res1", "pg", "short", "bad"}
    pg = table.loc["pg"]
    assert pg["prefill_gb_per_chunk"] == pytest.approx(50.0) and pg["floor_s"] == pytest.approx(1.0)
    assert pg["ttft_of_floor"] == pytest.approx(1.3) and pg["resident_ttft_s"] == pytest.approx(0.32)
    assert pg["paging_of_floor"] == pytest.approx(1.25)  # 0.05 s of the TTFT was the synthetic router's
    assert (pg["router_s"], pg["copy_busy"], pg["waves_per_layer"], pg["note"]) == (0.05, 0.75, 10.0, "")
    assert (pg["host_wait_ms"], pg["host_plan_ms"]) == pytest.approx((0.5, 7.0))  # per layer-step, in ms
    assert pd.isna(table.loc["short", "resident_ttft_s"]) and table.loc["short", "floor_s"] == pytest.approx(0.4)
    assert pd.isna(table.loc["res0", "floor_s"])  # a resident cell pages nothing: no floor, its TTFT is the compute
    assert table.loc["bad", "note"] == "cell failed" and pd.isna(table.loc["bad", "ttft_of_floor"])
    assert pg["span_of_floor"] == pytest.approx(0.8)  # the chunk's 0.8 s device span over its 1 s floor
    assert pg["ttft_p90_of_p50"] == pytest.approx(1.5) and pg["gc_ms_per_request"] == pytest.approx(1.0)
    assert pg["gc_full_collections"] == 1
    assert pd.isna(table.loc["bad", "ttft_p90_of_p50"])  # no TTFT: no spread


def test_at_concurrency_above_one_the_row_says_the_ttft_holds_several_chunks() -> None:
    """Four prompts at once prefill a chunk per step: the p50 request's TTFT holds ~2.5 chunks, so the row
    says so and span_of_floor (one chunk's span) stays the queue-free figure."""
    cells = pd.DataFrame([cell("c4", "paged", 2.5, 50e9, concurrency=4), cell("c1", "paged", 1.0, 50e9)])
    table = prefill_table(cells, [run({"paging_gb_per_s": 50.0})]).set_index("cell_id")
    assert table.loc["c4", "note"] == (
        "c=4: the TTFT p50 holds ~2.5 chunks (prompts prefill a chunk a step); span_of_floor is one chunk's"
    )
    assert table.loc["c4", "ttft_of_floor"] == pytest.approx(2.5)
    assert table.loc["c4", "span_of_floor"] == pytest.approx(0.8)
    assert table.loc["c1", "note"] == ""
    resident = prefill_table(
        pd.DataFrame([cell("r4", "resident", 0.4, 0.0, concurrency=4)]), [run({"paging_gb_per_s": 50.0})]
    )
    assert resident.loc[0, "note"] == ""  # no floor: nothing to hold the TTFT against


def test_without_a_link_the_rows_show_bytes_and_times_and_say_why() -> None:
    cells = pd.DataFrame([cell("pg", "paged", 1.3, 50e9)])
    (row,) = prefill_table(cells, [run(None)]).to_dict("records")
    assert pd.isna(row["floor_s"]) and row["prefill_gb_per_chunk"] == pytest.approx(50.0) and row["copy_s"] == 0.6
    assert "matrix `linkbw: true` measures it" in row["note"]
    old = pd.DataFrame([{k: v for k, v in cell("pg", "paged", 1.3, 50e9).items() if not k.startswith("prefill")}])
    assert prefill_table(old, [run(None)]).empty  # a run stored before the prefill counters


@pytest.mark.slow
def test_end_to_end_on_the_builtin_server(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = "import json; print(json.dumps({'paging_gb_per_s': 10.0, 'device': 'scripted', 'schema_version': 1}))"
    monkeypatch.setattr(benchsuite.tools.linkbw, "PROBE_ARGV", (sys.executable, "-c", script))
    monkeypatch.setattr(device_memory, "open_reader", lambda: None)  # no NVML, also on a GPU machine
    model = {"model": str(tiny_model_dir), "routing": "qwen3-30b-a3b"}
    body = {
        "name": "prefill", "output_root": str(tmp_path / "results"), "linkbw": True,
        "engines": {"resident": {"kind": "builtin", "options": {**model, "mode": "resident"}},
                    "paged": {"kind": "builtin", "options": {**model, "mode": "paged", "resident_experts": 8,
                                                             "prefill_residency": ["recent", "lru"]}}},
        "workloads": {"w": {"prompt_classes": ["short", "200"], "output_tokens": 8, "concurrency": [1],
                            "num_requests": 2, "warmup_requests": 1}},
    }  # fmt: skip
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump(body))
    assert main(["run", str(path), "--quiet", "--no-report"]) == 0
    (run_dir,) = (tmp_path / "results").iterdir()
    table = build_report_data([run_dir]).tables[TITLE]
    assert len(table) == 3 * 2, table  # resident + two paged servers x two prompt classes
    paged = table[table["configuration"].str.contains("paged")]
    assert len(paged) == 4 and paged["configuration"].str.contains("prefill_residency=lru").sum() == 2
    for _, row in paged.iterrows():
        assert row["prefill_gb_per_chunk"] > 0 and row["link_gb_per_s"] == 10.0 and row["floor_s"] > 0
        assert row["router_s"] > 0 and 0 < row["copy_busy"] <= 1 and row["waves_per_layer"] >= 1
    long = paged[paged["prompt_class"] == "200"]
    assert (long["ttft_of_floor"] > 0).all() and (long["paging_of_floor"] < long["ttft_of_floor"]).all()
    # each request's own prefill keys: every cell's 2 measured requests, a fast and a slow half of one each
    halves = build_report_data([run_dir]).tables[prefill_requests.TITLE]
    assert len(halves) == 2 * 6 and set(halves["half"]) == {"fast", "slow"} and (halves["requests"] == 1).all()
    assert ((halves["issue_of_prompt"] > 0) & (halves["issue_of_prompt"] <= 1)).all()
    assert ((halves["on_cpu"] > 0) & (halves["on_cpu"] <= 1.05)).all()  # CPU time over wall time, one thread
    paged_halves = halves[halves["configuration"].str.contains("paged")]
    assert (paged_halves["host_plan_ms"] > 0).all() and (paged_halves["router_ms"] > 0).all()
    assert halves[~halves["configuration"].str.contains("paged")]["host_plan_ms"].isna().all()  # nothing paged
    if sys.platform.startswith("linux"):  # how the engine thread spent it, and where (paged_experts.thread_clock)
        assert ((halves["queued"] >= 0) & (halves["blocked"] >= 0)).all()
        assert (halves["queued"] + halves["on_cpu"] <= 1.05).all()  # shares of one thread's wall time
        assert halves["cpu_ids"].notna().all() and halves["switches"].str.fullmatch(r"[0-9.]+/[0-9.]+").all()
    assert halves["sampler_ms"].isna().all()  # no NVML reader: the memory sampler timed no read
    # benchmarks/prefill_speeds.py reads the same keys from the stored run, request by request
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, str(root / "benchmarks" / "prefill_speeds.py"), str(run_dir),
                           "--prompt-class", "200"], capture_output=True, text=True, check=False, timeout=120,
                          cwd=root, env={**os.environ, "PYTHONPATH": str(root)})  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    measured = [row for row in _columns(out) if not row["warm"]]  # a request's row: its server's id first
    assert len(measured) == 2 * 2 and all(0 < float(r["on_cpu"]) <= 1.05 for r in measured), out
    assert all(r["sampler_ms"] == "" for r in measured)  # no NVML reader
    if sys.platform.startswith("linux"):
        assert all(float(r["queued"]) >= 0 and int(r["cpu"]) >= 0 and int(r["vol"]) >= 0 for r in measured), out
    if sys.platform.startswith("linux"):
        assert "per CPU (fast half / slow half of their cell): " in out, out
    # --against: a run compared with itself finds every figure's medians equal (ratio 1, p 1)
    proc = subprocess.run([sys.executable, str(root / "benchmarks" / "prefill_speeds.py"), str(run_dir),
                           "--prompt-class", "200", "--against", str(run_dir)], capture_output=True, text=True,
                          check=False, timeout=120, cwd=root, env={**os.environ, "PYTHONPATH": str(root)})  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    against = proc.stdout.split("\n== against ", 1)[1].splitlines()[2:]
    assert len(against) == 2, proc.stdout  # the paged server with its two prefill policies, at c=1
    for line in against:
        fields = line.split()
        assert fields[3] == "2/2" and fields[6:8] == ["1.000", "1.000"], line  # prompt_ms: ratio 1, p 1
    resident = table[~table["configuration"].str.contains("paged") & (table["prompt_class"] == "200")]
    if (resident["note"] == "").all():  # (a cell a busy client read in one go is invalid: issue 19 fixes that)
        assert (long["resident_ttft_s"] > 0).all()


def _columns(out: str) -> list[dict[str, str]]:
    """prefill_speeds.py's request rows by its header's columns (blank: unknown)."""
    rows: list[dict[str, str]] = []
    header: list[tuple[str, int, int]] = []
    for line in out.splitlines():
        if line.startswith("server ") and "ttft_ms" in line:
            header = [(m.group(), m.start(), m.end()) for m in re.finditer(r"\S+", line)]
        elif header and re.match(r"[0-9a-f]{12} ", line):
            # the server's id is left-aligned up to the separator before the next name; every other field is
            # right-aligned, ending where its name ends
            cuts = [0, header[1][1] - 1] + [end for _, _, end in header[1:-1]] + [len(line)]
            rows.append({name: line[a:b].strip() for (name, _, _), a, b in zip(header, cuts, cuts[1:])})
    return rows
