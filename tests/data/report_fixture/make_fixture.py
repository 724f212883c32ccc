"""Writes the hand-made results run in this directory (cells/*.json, cells.parquet, cells.csv,
requests.parquet) from the literal rows below, through benchsuite.store so the layout is the
store's own; manifest.json (store layout, schema version 2) and model/config.json are written by hand;
each cell's typed K / N / options come from its server's options in manifest.json. Run it after
changing a row: `python tests/data/report_fixture/make_fixture.py`. The numbers are chosen so the
report tests can state exact expected values (see tests/test_report_tables.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from benchsuite.records import CellResult, RequestRecord
from benchsuite.store import RunStore

HERE = Path(__file__).resolve().parent
RUN_ID = "fixture-run"
SERVERS = json.loads((HERE / "manifest.json").read_text())["servers"]
OUTPUT_TOKENS = 9
# (cell_id, engine, kind, mode, server, params, prompt_class, concurrency, repeat, status, reason, routing,
#  decode_tok_s_p50, output_tok_s, ttft_p50_s, paging (miss_rate, bytes_paged_per_token, waves_per_step, union_mean), extras)
ROWS = [
    ("p8-s1-r0", "tiny", "builtin", "paged", "s-paged8", {"resident_experts": 8}, "short", 1, 0, "ok", None, "model", 40.0, 38.0, 0.100, (0.30, 1000.0, 1.0, 4.0), {}),
    ("p8-s1-r1", "tiny", "builtin", "paged", "s-paged8", {"resident_experts": 8}, "short", 1, 1, "ok", None, "model", 44.0, 42.0, 0.120, (0.32, 1100.0, 1.0, 4.0), {}),
    ("p8-s2-r0", "tiny", "builtin", "paged", "s-paged8", {"resident_experts": 8}, "short", 2, 0, "ok", None, "model", 30.0, 58.0, 0.150, (0.40, 1500.0, 1.0, 7.0), {}),
    ("p8-s2-r1", "tiny", "builtin", "paged", "s-paged8", {"resident_experts": 8}, "short", 2, 1, "ok", None, "model", 34.0, 62.0, 0.170, (0.42, 1600.0, 1.0, 7.5), {}),
    ("p8-l1-r0", "tiny", "builtin", "paged", "s-paged8", {"resident_experts": 8}, "2048", 1, 0, "ok", None, "model", 39.0, 35.0, 0.300, (0.31, 1050.0, 1.0, 4.0), {}),
    ("p8-l1-r1", "tiny", "builtin", "paged", "s-paged8", {"resident_experts": 8}, "2048", 1, 1, "ok", None, "model", 41.0, 37.0, 0.340, (0.33, 1150.0, 1.0, 4.0), {}),
    ("p12-s1-r0", "tiny", "builtin", "paged", "s-paged12", {"resident_experts": 12}, "short", 1, 0, "ok", None, "model", 50.0, 48.0, 0.090, (0.15, 500.0, 1.0, 4.0), {}),
    ("p12-s1-r1", "tiny", "builtin", "paged", "s-paged12", {"resident_experts": 12}, "short", 1, 1, "ok", None, "model", 52.0, 50.0, 0.094, (0.17, 540.0, 1.0, 4.0), {}),
    ("p12-s2-r0", "tiny", "builtin", "paged", "s-paged12", {"resident_experts": 12}, "short", 2, 0, "ok", None, "model", 46.0, 88.0, 0.120, (0.22, 700.0, 1.0, 7.0), {}),
    ("p12-s2-r1", "tiny", "builtin", "paged", "s-paged12", {"resident_experts": 12}, "short", 2, 1, "ok", None, "model", 48.0, 92.0, 0.130, (0.24, 760.0, 1.0, 7.2), {}),
    ("off-s1-r0", "tiny", "builtin", "offload", "s-offload", {}, "short", 1, 0, "ok", None, "model", 20.0, 19.0, 0.200, None, {}),
    ("off-s1-r1", "tiny", "builtin", "offload", "s-offload", {}, "short", 1, 1, "ok", None, "model", 22.0, 21.0, 0.220, None, {}),
    ("off-s2-r0", "tiny", "builtin", "offload", "s-offload", {}, "short", 2, 0, "ok", None, "model", 18.0, 35.0, 0.250, None, {}),
    ("off-s2-r1", "tiny", "builtin", "offload", "s-offload", {}, "short", 2, 1, "failed", "engine exited with code -11 (see logs/s-offload.log)", "model", None, None, None, None, {}),
    ("cpu-s1-r0", "tiny", "builtin", "cpu-experts", "s-cpu", {}, "short", 1, 0, "ok", None, "model", 41.0, 40.0, 0.110, None, {}),
    ("cpu-s1-r1", "tiny", "builtin", "cpu-experts", "s-cpu", {}, "short", 1, 1, "ok", None, "model", 45.0, 43.0, 0.115, None, {}),
    ("cpu-s2-r0", "tiny", "builtin", "cpu-experts", "s-cpu", {}, "short", 2, 0, "ok", None, "model", 25.0, 48.0, 0.140, None, {}),
    ("cpu-s2-r1", "tiny", "builtin", "cpu-experts", "s-cpu", {}, "short", 2, 1, "ok", None, "model", 27.0, 52.0, 0.160, None, {}),
    ("cpu-l1-r0", "tiny", "builtin", "cpu-experts", "s-cpu", {}, "2048", 1, 0, "ok", None, "model", 40.0, 36.0, 0.500, None, {}),
    ("cpu-l1-r1", "tiny", "builtin", "cpu-experts", "s-cpu", {}, "2048", 1, 1, "invalid", "no generated text streamed: TTFT undefined", "model", None, None, None, None, {}),
    ("syn8-s1-r0", "tiny", "builtin", "paged", "s-paged8-syn", {"resident_experts": 8}, "short", 1, 0, "ok", None, "synthetic:calibrated", 60.0, 58.0, 0.080, (0.20, 800.0, 1.0, 4.0), {}),
    ("syn8-s1-r1", "tiny", "builtin", "paged", "s-paged8-syn", {"resident_experts": 8}, "short", 1, 1, "ok", None, "synthetic:calibrated", 64.0, 62.0, 0.082, (0.22, 820.0, 1.0, 4.0), {}),
    ("ll1-s1-r0", "llama", "llamacpp", "n-cpu-moe", "s-llama1", {}, "short", 1, 0, "failed", "memory projection 9.1 GiB exceeds the VRAM budget 8.0 GiB", "model", None, None, None, None, {"search_n": 1, "fits": False}),
    ("ll2-s1-r0", "llama", "llamacpp", "n-cpu-moe", "s-llama2", {}, "short", 1, 0, "ok", None, "model", 45.0, 44.0, 0.105, None, {"search_n": 2, "fits": True, "chosen": True}),
    ("ll2-s1-r1", "llama", "llamacpp", "n-cpu-moe", "s-llama2", {}, "short", 1, 1, "ok", None, "model", 47.0, 46.0, 0.107, None, {"search_n": 2, "fits": True, "chosen": True}),
    ("ll3-s1-r0", "llama", "llamacpp", "n-cpu-moe", "s-llama3", {}, "short", 1, 0, "ok", None, "model", 39.0, 38.0, 0.103, None, {"search_n": 3, "fits": True, "chosen": False, "kv_capacity_flag": "server KV pool is 4352 tokens, the matrix fixed 4096"}),
]
# Per-request decode rates around the cell's median: the median of these factors is 1.
RATE_FACTORS = (0.9, 1.0, 1.0, 1.1)
TTFT_FACTORS = (0.95, 1.0, 1.0, 1.05)


def cell(row: tuple) -> CellResult:
    (cid, engine, kind, mode, server, params, cls, conc, rep, status, reason, routing, decode, output, ttft, paging, extras) = row
    miss, bytes_tok, waves, union = paging if paging else (None, None, None, None)
    ok = status == "ok"
    options = SERVERS.get(server, {}).get("options") or {}  # a search candidate never launched has no server
    return CellResult(
        cell_id=cid, run_id=RUN_ID, engine=engine, engine_kind=kind, mode=mode, server_id=server, params=params,
        workload="bundled", prompt_class=cls, concurrency=conc, repeat=rep, status=status, reason=reason, routing=routing,
        resident_experts=options.get("resident_experts"), n_cpu_moe=extras.get("search_n", options.get("n_cpu_moe")),
        options=options,
        num_requests=4, num_errors=0 if ok else 4, error_rate=0.0 if ok else 1.0, ttft_p50_s=ttft, decode_tok_s_p50=decode,
        output_tok_s=output, miss_rate=miss, bytes_paged_per_token=bytes_tok, waves_per_step=waves, union_mean=union,
        output_tokens_total=4 * OUTPUT_TOKENS if ok else None, extras=extras,
    )


def requests(c: CellResult) -> list[RequestRecord]:
    # llama.cpp's template adds 2 tokens to prompt p0: the report must flag the length mismatch.
    out = [RequestRecord(c.cell_id, 0, True, True, "p-warm", c.prompt_class, OUTPUT_TOKENS, 0.0, 0.5, 1.0,
                         [0.5, 1.0], 8, 2, 2, ok=True)]
    for index in range(4):
        t_sent = 10.0 + index
        prompt_tokens = 18 if c.engine == "llama" and index == 0 else 16
        if c.status != "ok":
            out.append(RequestRecord(c.cell_id, index + 1, False, False, f"p{index}", c.prompt_class, OUTPUT_TOKENS,
                                     t_sent, None, t_sent + 0.5, ok=False, error=c.reason))
            continue
        t_first = t_sent + c.ttft_p50_s * TTFT_FACTORS[index]
        step_s = 1.0 / (c.decode_tok_s_p50 * RATE_FACTORS[index])
        chunks = [t_first + i * step_s for i in range(OUTPUT_TOKENS)]
        out.append(RequestRecord(c.cell_id, index + 1, False, False, f"p{index}", c.prompt_class, OUTPUT_TOKENS,
                                 t_sent, t_first, chunks[-1], chunks, prompt_tokens, OUTPUT_TOKENS, OUTPUT_TOKENS, ok=True))
    return out


def main() -> None:
    for generated in ("cells", "attempts"):
        shutil.rmtree(HERE / generated, ignore_errors=True)
    store = RunStore(HERE)
    for row in ROWS:
        c = cell(row)
        store.write_cell(c, requests(c))
    store.rebuild_tables()


if __name__ == "__main__":
    main()
