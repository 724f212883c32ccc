"""Hand-made cells for the report's table, verdict and figure tests: one CellResult row per call
(`row`), annotated and folded into configurations (`frames`)."""

from __future__ import annotations

import pandas as pd

from benchsuite.records import CellResult
from benchsuite.report.groups import annotate_cells, group_configs
from benchsuite.report.load import normalize_cells

# server -> its typed placement (K, N), as the runner records it on every cell of the server
SERVERS = {"s-p8": (8, None), "s-p16": (16, None), "s-off": (None, None), "s-ll1": (None, 1), "s-ll2": (None, 2)}


def row(
    cell_id: str,
    server: str,
    mode: str,
    kind: str = "builtin",
    *,
    conc: int = 1,
    rep: int = 0,
    cls: str = "short",
    decode: float | None = None,
    output: float | None = None,
    ttft: float | None = None,
    status: str = "ok",
    reason: str | None = None,
    routing: str = "model",
    params: dict | None = None,
    extras: dict | None = None,
    miss: float | None = None,
    peak_bytes: int | None = None,
) -> dict:
    engine = "llama" if kind == "llamacpp" else "tiny"
    k, n = SERVERS[server]
    return CellResult(
        cell_id=cell_id,
        run_id="r1",
        engine=engine,
        engine_kind=kind,
        mode=mode,
        server_id=server,
        params=params or {},
        workload="w",
        prompt_class=cls,
        concurrency=conc,
        repeat=rep,
        status=status,
        reason=reason,
        routing=routing,
        resident_experts=k,
        n_cpu_moe=n,
        decode_tok_s_p50=decode,
        output_tok_s=output,
        ttft_p50_s=ttft,
        miss_rate=miss,
        extras=extras or {},
        peak_device_memory_bytes=peak_bytes,
    ).to_row()


def frames(rows: list[dict]) -> tuple[pd.DataFrame, pd.DataFrame]:
    cells = annotate_cells(normalize_cells(pd.DataFrame(rows)), many_runs=False)
    return cells, group_configs(cells)
