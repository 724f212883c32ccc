"""Per-request samples recomputed from requests.parquet with benchsuite.measure.metrics' own per-request
definitions (ttft_s, decode_tok_s, latency_s): the raw material of the distribution figures and of
compare's significance tests. Like the cell metrics, only warm requests count: warmup, cold (first
after a server start) and failed requests are excluded.

- ttft_s, decode_tok_s: benchsuite.measure.metrics (None where undefined, e.g. fewer than 2 tokens)
- e2e_output_tok_s = output_tokens / metrics.latency_s: one request's share of output rate
- one_read: the stream arrived whole, or mostly whole, in one body read (request_metrics.mostly_whole):
  the client timed no decode, so its decode_tok_s is a parse time (670,000 tok/s seen), not a rate;
  the per-request decode figure leaves such requests out and says how many
"""

from __future__ import annotations

import math
from typing import Any

import pandas as pd

from benchsuite.measure import metrics, request_metrics
from benchsuite.records import RequestRecord
from benchsuite.report.load import REQUEST_COLUMNS


def _clean(value: Any) -> Any:
    if isinstance(value, float) and math.isnan(value):
        return None
    return value.item() if hasattr(value, "item") else value


def _record(row: pd.Series) -> RequestRecord:
    lists = ("chunk_times_s", "chunk_reads", "chunk_tokens", "count_times_s", "count_tokens", "count_reads")
    values = {c: _clean(row[c]) for c in REQUEST_COLUMNS if c not in (*lists, "engine_timings")}
    as_list: dict[str, Any] = {
        c: [] if row[c] is None or (isinstance(row[c], float) and math.isnan(row[c])) else list(row[c]) for c in lists
    }
    return RequestRecord(**values, **as_list)


def _e2e_output_tok_s(record: RequestRecord) -> float | None:
    latency = metrics.latency_s(record)
    if record.output_tokens is None or latency is None or latency <= 0:
        return None
    return record.output_tokens / latency


def request_samples(requests: pd.DataFrame) -> pd.DataFrame:
    """One row per warm ok request: cell_id, request_index, ttft_s, decode_tok_s, e2e_output_tok_s, one_read."""
    columns = ["cell_id", "request_index", "ttft_s", "decode_tok_s", "e2e_output_tok_s", "one_read"]
    if requests.empty:
        return pd.DataFrame(columns=columns)
    rows = []
    for _, row in requests.iterrows():
        record = _record(row)
        if record.warmup or record.cold or not record.ok:
            continue
        rows.append(
            {
                "cell_id": record.cell_id,
                "request_index": record.request_index,
                "ttft_s": metrics.ttft_s(record),
                "decode_tok_s": metrics.decode_tok_s(record),
                "e2e_output_tok_s": _e2e_output_tok_s(record),
                "one_read": request_metrics.mostly_whole(record),
            }
        )
    return pd.DataFrame(rows, columns=columns)
