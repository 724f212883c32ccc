"""The report's decode per-token breakdown (benchsuite.report.decode_bounds): exact arithmetic on
hand-made cells (decode bytes from the miss rate, the model's shape and the bytes per miss; the
decode figure per concurrency; hidden time positive and negative), and the reason for every missing
part."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from benchsuite.report.decode_bounds import decode_bounds_table
from benchsuite.report.load import RunData
from benchsuite.results.manifest import Manifest, ServerRecord
from paged_experts.shape import ModelShape

SHAPE = ModelShape(num_layers=4, num_moe_layers=4, num_experts=32, top_k=2)  # 8 lookups per decode token


def cell(cid: str, mode: str, *, c: int = 1, one: float | None = None, agg: float | None = None,
         miss: float | None = None, misses: int | None = None, paged: float | None = None,
         server: str = "s-paged", status: str = "ok", repeat: int = 0,
         routing: str = "model") -> dict[str, Any]:  # fmt: skip
    return {"cell_id": cid, "run_id": "r", "engine_kind": "builtin", "mode": mode, "label": f"tiny · {mode}",
            "server_id": server, "routing": routing, "workload": "w", "prompt_class": "short", "concurrency": c,
            "repeat": repeat, "status": status, "decode_tok_s_p50": one, "decode_agg_tok_s": agg,
            "decode_miss_rate": miss, "expert_misses": misses, "bytes_paged": paged}  # fmt: skip


def run(
    link_gb_per_s: float | None = 50.0, shape: ModelShape | None = SHAPE, expert_bytes: int | None = None
) -> RunData:
    version = {"expert_bytes": expert_bytes} if expert_bytes else {}
    servers = {"s-paged": ServerRecord(engine="paged", kind="builtin", model=shape, version=version),
               "s-res": ServerRecord(engine="resident", kind="builtin", model=shape)}  # fmt: skip
    link = {"paging_gb_per_s": link_gb_per_s} if link_gb_per_s else None
    manifest = Manifest(run_id="r", created_utc="now", matrix_source="m.yaml", matrix_hash="h", matrix={},
                        link_bandwidth=link, servers=servers)  # fmt: skip
    return RunData("r", Path("."), manifest, pd.DataFrame(), pd.DataFrame())


def test_one_stream_decode_split_into_link_compute_and_time_beyond_serial() -> None:
    cells = pd.DataFrame([
        cell("res0", "resident", one=180.0, server="s-res"),
        cell("res1", "resident", one=220.0, server="s-res", repeat=1),
        # 8 lookups x 0.25 miss rate x 25 MB per miss = 50 MB per decode token: 1 ms at 50 GB/s
        cell("pg", "paged", one=125.0, miss=0.25, misses=10, paged=250e6),
    ])  # fmt: skip
    row = decode_bounds_table(cells, [run()]).set_index("cell_id").loc["pg"]
    assert row["decode_figure"] == "decode_tok_s_p50" and row["decode_mb_per_token"] == pytest.approx(50.0)
    assert row["link_ms"] == pytest.approx(1.0) and row["compute_ms"] == pytest.approx(5.0)  # median 200 tok/s
    assert row["measured_ms"] == pytest.approx(8.0) and row["hidden_ms"] == pytest.approx(-2.0)
    assert row["link_bound_tok_s"] == pytest.approx(1000.0) and row["roofline_tok_s"] == pytest.approx(200.0)
    assert row["serial_tok_s"] == pytest.approx(1000 / 6) and row["of_serial"] == pytest.approx(0.75)
    assert row["of_link_bound"] == pytest.approx(0.125) and row["note"] == ""
    assert row["compute_cell_ids"] == "res0 res1"


def test_several_streams_use_the_decode_phase_aggregate_and_can_hide_copies() -> None:
    cells = pd.DataFrame([
        cell("res", "resident", c=4, one=100.0, agg=400.0, server="s-res"),  # compute 2.5 ms per token
        cell("pg", "paged", c=4, one=30.0, agg=250.0, miss=0.5, misses=4, paged=40e6),  # 40 MB: 0.8 ms
    ])  # fmt: skip
    row = decode_bounds_table(cells, [run()]).set_index("cell_id").loc["pg"]
    assert row["decode_figure"] == "decode_agg_tok_s" and row["decode_tok_s"] == pytest.approx(250.0)
    assert row["hidden_ms"] == pytest.approx(0.8 + 2.5 - 4.0)  # -0.7: beyond serial
    cells.loc[1, "decode_agg_tok_s"] = 1000 / 2.9  # faster than copy-then-compute: 0.4 ms hidden
    row = decode_bounds_table(cells, [run()]).set_index("cell_id").loc["pg"]
    assert row["hidden_ms"] == pytest.approx(0.4) and row["of_serial"] > 1


def test_a_cell_with_no_miss_takes_the_servers_expert_bytes() -> None:
    cells = pd.DataFrame([cell("res", "resident", one=200.0, server="s-res"),
                          cell("pg", "paged", one=190.0, miss=0.0, misses=0, paged=0.0)])  # fmt: skip
    row = decode_bounds_table(cells, [run(expert_bytes=25_000_000)]).set_index("cell_id").loc["pg"]
    assert row["decode_mb_per_token"] == 0.0 and pd.isna(row["link_bound_tok_s"]) and row["note"] == ""
    row = decode_bounds_table(cells, [run()]).set_index("cell_id").loc["pg"]
    assert "no bytes per expert" in row["note"] and pd.isna(row["decode_mb_per_token"])


def test_every_missing_part_says_why() -> None:
    cells = pd.DataFrame([
        cell("old", "paged", one=100.0, misses=5, paged=1e6),  # stored before decode_miss_rate
        cell("syn", "paged", one=100.0, miss=0.1, misses=5, paged=1e6, routing="synthetic:x"),  # no reference
        cell("bad", "paged", status="failed"),
    ])  # fmt: skip
    table = decode_bounds_table(cells, [run()]).set_index("cell_id")
    assert table.loc["old", "note"].startswith("no decode miss rate")
    assert "no ok resident cell with the same workload, routing" in table.loc["syn", "note"]
    assert table.loc["syn", "link_ms"] > 0 and pd.isna(table.loc["syn", "hidden_ms"])
    assert table.loc["bad", "note"].startswith("cell failed") and pd.isna(table.loc["bad", "decode_tok_s"])
    no_shape = decode_bounds_table(cells, [run(shape=None)]).set_index("cell_id")
    assert "the server's model shape is not in the manifest" in no_shape.loc["syn", "note"]
    no_link = decode_bounds_table(cells, [run(link_gb_per_s=None)]).set_index("cell_id")
    assert pd.isna(no_link.loc["syn", "link_ms"]) and "linkbw" in no_link.loc["syn", "note"]
