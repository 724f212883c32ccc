"""The report's decode per-token breakdown (benchsuite.report.decode_bounds): exact arithmetic on
hand-made cells (the engine's decode bytes per token, or an older cell's estimate from its counters;
the decode figure per concurrency; hidden time positive and negative), and the reason for every
missing part."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from benchsuite.report.decode_bounds import decode_bounds_table
from benchsuite.report.load import RunData
from benchsuite.results.manifest import Manifest

SAME = -1.0  # agg: the cell's decode_agg_tok_s equals its one-stream median


def cell(cid: str, mode: str, *, c: int = 1, one: float | None = None, agg: float | None = SAME,
         per_token: float | None = None, status: str = "ok", repeat: int = 0, routing: str = "model",
         **more: Any) -> dict[str, Any]:  # fmt: skip
    return {"cell_id": cid, "run_id": "r", "engine_kind": "builtin", "mode": mode, "label": f"tiny · {mode}",
            "server_id": "s", "routing": routing, "workload": "w", "prompt_class": "short", "concurrency": c,
            "repeat": repeat, "status": status, "decode_tok_s_p50": one,
            "decode_agg_tok_s": one if agg == SAME else agg, "decode_miss_rate": 0.1,
            "decode_bytes_per_token": per_token, **more}  # fmt: skip


def run(link_gb_per_s: float | None = 50.0) -> RunData:
    link = {"paging_gb_per_s": link_gb_per_s} if link_gb_per_s else None
    manifest = Manifest(run_id="r", created_utc="now", matrix_source="m.yaml", matrix_hash="h", matrix={},
                        link_bandwidth=link)  # fmt: skip
    return RunData("r", Path("."), manifest, pd.DataFrame(), pd.DataFrame())


def test_one_stream_decode_split_into_link_compute_and_time_beyond_serial() -> None:
    cells = pd.DataFrame([
        cell("res0", "resident", one=181.0, agg=180.0),  # median of the two aggregates: 200 tok/s
        cell("res1", "resident", one=219.0, agg=220.0, repeat=1),
        cell("pg", "paged", one=126.0, agg=125.0, per_token=50e6),  # 50 MB per decode token: 1 ms at 50 GB/s
        cell("pf", "paged", one=126.0, agg=125.0, per_token=50e6, prefetch_accuracy=0.75),
    ])  # fmt: skip
    table = decode_bounds_table(cells, [run()]).set_index("cell_id")
    assert table.loc["pf", "prefetch_accuracy"] == pytest.approx(0.75) and pd.isna(table.loc["pg", "prefetch_accuracy"])
    row = table.loc["pg"]
    assert row["decode_figure"] == "decode_agg_tok_s" and row["decode_mb_per_token"] == pytest.approx(50.0)
    assert row["link_ms"] == pytest.approx(1.0) and row["compute_ms"] == pytest.approx(5.0)
    assert row["measured_ms"] == pytest.approx(8.0) and row["hidden_ms"] == pytest.approx(-2.0)
    assert row["link_bound_tok_s"] == pytest.approx(1000.0) and row["roofline_tok_s"] == pytest.approx(200.0)
    assert row["serial_tok_s"] == pytest.approx(1000 / 6) and row["of_serial"] == pytest.approx(0.75)
    assert row["of_link_bound"] == pytest.approx(0.125) and row["note"] == ""
    assert row["compute_cell_ids"] == "res0 res1"


def test_the_decode_bytes_at_the_copy_kernels_rate_sit_beside_the_dma_link() -> None:
    """kernel_link_ms: the decode's bytes at the rate the run's probe measured for the runtime's copy kernel (the
    path a built-in decode step pages with), beside link_ms at the DMAs'; empty where the probe did not time it
    (every run before 2026-12-07), and nothing else moves."""
    cells = pd.DataFrame([cell("res", "resident", one=200.0), cell("pg", "paged", one=125.0, per_token=50e6)])
    timed = run()
    assert timed.manifest.link_bandwidth is not None
    link = timed.manifest.link_bandwidth.model_copy(update={"report": {"kernel_gb_per_s": 25.0}})
    with_kernel = RunData("r", Path("."), timed.manifest.model_copy(update={"link_bandwidth": link}), pd.DataFrame(),
                          pd.DataFrame())  # fmt: skip
    row = decode_bounds_table(cells, [with_kernel]).set_index("cell_id").loc["pg"]
    assert row["kernel_link_ms"] == pytest.approx(2.0) and row["link_ms"] == pytest.approx(1.0)
    before = decode_bounds_table(cells, [run()]).set_index("cell_id").loc["pg"]
    assert pd.isna(before["kernel_link_ms"])
    assert before.drop("kernel_link_ms").equals(row.drop("kernel_link_ms"))


def test_one_stream_is_timed_like_its_bytes_and_says_when_its_median_is_not_its_mean() -> None:
    """c=1 pairs the decode-phase aggregate (tokens over decoding time) with the bytes per token (bytes over
    those tokens): a median request faster than the mean one (h200-paged16: 236 tok/s median, 178 aggregate)
    no longer shows copies hidden that were not; the note says the two differ. A cell stored without the
    aggregate falls back to the median, said."""
    cells = pd.DataFrame([
        cell("res", "resident", one=300.0, agg=300.0),
        cell("pg", "paged", one=236.0, agg=178.0, per_token=94e6),
        cell("old", "paged", one=236.0, agg=None, per_token=94e6, repeat=1),
    ])  # fmt: skip
    table = decode_bounds_table(cells, [run()]).set_index("cell_id")
    row = table.loc["pg"]
    assert row["decode_tok_s"] == pytest.approx(178.0) and row["measured_ms"] == pytest.approx(1e3 / 178)
    assert (
        row["hidden_ms"] < 0
        and row["note"] == "one stream's median 236.0 tok/s is 1.33x the aggregate: its requests differ"
    )
    old = table.loc["old"]
    assert old["decode_figure"] == "decode_tok_s_p50" and old["decode_tok_s"] == pytest.approx(236.0)
    assert old["note"].startswith("no decode_agg_tok_s stored: one stream's median stands in")


def test_several_streams_say_when_other_streams_prefills_slowed_the_window() -> None:
    """At c>=2 the aggregate's window holds other streams' prefill steps, which the bytes per token leave out:
    where the engine's all-decode rate is over 10% above it (h200-paged16, 2,048 tokens, c=4: 122 vs 212), the
    note says so; within 10% nothing is said."""
    cells = pd.DataFrame([
        cell("res", "resident", c=4, one=100.0, agg=400.0),
        cell("slow", "paged", c=4, one=30.0, agg=122.5, per_token=40e6, engine_decode_tok_s=211.8),
        cell("even", "paged", c=4, one=30.0, agg=200.0, per_token=40e6, engine_decode_tok_s=215.0, repeat=1),
    ])  # fmt: skip
    table = decode_bounds_table(cells, [run()]).set_index("cell_id")
    assert table.loc["slow", "decode_tok_s"] == pytest.approx(122.5)
    assert table.loc["slow", "note"] == (
        "the engine's own all-decode rate is 211.8 tok/s (1.73x): the decode window also held other streams' "
        "prefills and time between the engine's steps"
    )
    assert table.loc["even", "note"] == ""


def test_several_streams_use_the_decode_phase_aggregate_and_can_hide_copies() -> None:
    cells = pd.DataFrame([
        cell("res", "resident", c=4, one=100.0, agg=400.0),  # compute 2.5 ms per token
        cell("pg", "paged", c=4, one=30.0, agg=250.0, per_token=40e6),  # 0.8 ms of link
    ])  # fmt: skip
    row = decode_bounds_table(cells, [run()]).set_index("cell_id").loc["pg"]
    assert row["decode_figure"] == "decode_agg_tok_s" and row["decode_tok_s"] == pytest.approx(250.0)
    assert row["hidden_ms"] == pytest.approx(0.8 + 2.5 - 4.0)  # -0.7: beyond serial
    cells.loc[1, "decode_agg_tok_s"] = 1000 / 2.9  # faster than copy-then-compute: 0.4 ms hidden
    row = decode_bounds_table(cells, [run()]).set_index("cell_id").loc["pg"]
    assert row["hidden_ms"] == pytest.approx(0.4) and row["of_serial"] > 1


def test_an_older_cell_estimates_its_decode_bytes_from_its_counters_and_says_so() -> None:
    # 9 GB paged, 2 prompt chunks of 2 GB each: 5 GB over 128 - 2 decode tokens (each request's first
    # token is its prefill step's); the miss rate is not used (a step's tokens share experts)
    old = cell("old", "paged", one=100.0, bytes_paged=9e9, prefill_chunks=2, prefill_bytes_per_chunk=2e9,
               output_tokens_total=128, num_requests=2)  # fmt: skip
    cells = pd.DataFrame([cell("res", "resident", one=200.0), old])
    row = decode_bounds_table(cells, [run()]).set_index("cell_id").loc["old"]
    assert row["decode_mb_per_token"] == pytest.approx(5e9 / 126 / 1e6)
    assert row["note"] == "decode bytes per token estimated (a cell stored before the engine's count)"
    assert pd.notna(row["hidden_ms"])
    # without prefill counters every prefill byte would count as decode: no estimate
    bare = cell("bare", "paged", one=100.0, bytes_paged=9e9, output_tokens_total=128, num_requests=2)
    row = decode_bounds_table(pd.DataFrame([bare]), [run()]).set_index("cell_id").loc["bare"]
    assert pd.isna(row["decode_mb_per_token"]) and row["note"].startswith("no decode bytes counted")


def test_every_missing_part_says_why() -> None:
    cells = pd.DataFrame([
        cell("res0", "resident", one=100.0), cell("res1", "resident", one=300.0, repeat=1),
        cell("none", "paged", one=100.0),  # no count and no counters to estimate it from
        cell("syn", "paged", one=100.0, per_token=1e6, routing="synthetic:x"),  # no reference on its routing
        cell("bad", "paged", status="failed"),
        cell("ok", "paged", one=100.0, per_token=1e6),
    ])  # fmt: skip
    table = decode_bounds_table(cells, [run()]).set_index("cell_id")
    assert table.loc["none", "note"].startswith("no paging counters") and pd.isna(table.loc["none", "link_ms"])
    assert "no ok resident cell with the same workload, routing" in table.loc["syn", "note"]
    assert table.loc["syn", "link_ms"] > 0 and pd.isna(table.loc["syn", "hidden_ms"])
    assert table.loc["bad", "note"].startswith("cell failed") and pd.isna(table.loc["bad", "decode_tok_s"])
    # a reference whose repeats disagree (100 and 300 tok/s): its median stands for neither, said
    assert table.loc["ok", "note"] == "the reference's repeats range 100-300 tok/s"
    no_link = decode_bounds_table(cells, [run(link_gb_per_s=None)]).set_index("cell_id")
    assert pd.isna(no_link.loc["syn", "link_ms"]) and "linkbw" in no_link.loc["syn", "note"]
