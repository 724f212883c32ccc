"""Per-request samples recomputed from requests.parquet: the raw material of the distribution
figures and of compare's significance tests. Warmup requests and failed requests are excluded.

Definitions (the same as benchsuite.metrics states for the per-cell aggregates):
- ttft_s = t_first_token_s - t_sent_s  (first chunk with non-empty generated text)
- decode_tok_s = (output_tokens - 1) / (t_last_token_s - t_first_token_s), where t_last_token_s
  is the last content chunk's time (t_done_s when no chunk times were kept); undefined (dropped)
  for fewer than 2 output tokens or a zero-length decode interval
- e2e_output_tok_s = output_tokens / (t_done_s - t_sent_s): one request's share of output rate
"""

from __future__ import annotations

import math

import pandas as pd


def _decode_tok_s(output_tokens: float | None, t_first: float | None, chunk_times: list[float], t_done: float | None) -> float | None:
    if output_tokens is None or t_first is None or math.isnan(output_tokens) or output_tokens < 2:
        return None
    t_last = chunk_times[-1] if chunk_times else t_done
    if t_last is None or math.isnan(t_last) or t_last <= t_first:
        return None
    return (output_tokens - 1) / (t_last - t_first)


def _e2e_output_tok_s(output_tokens: float | None, t_sent: float, t_done: float | None) -> float | None:
    if output_tokens is None or t_done is None or math.isnan(output_tokens) or math.isnan(t_done) or t_done <= t_sent:
        return None
    return output_tokens / (t_done - t_sent)


def request_samples(requests: pd.DataFrame) -> pd.DataFrame:
    """One row per measured ok request: cell_id, ttft_s, decode_tok_s, e2e_output_tok_s (None where undefined)."""
    columns = ["cell_id", "request_index", "ttft_s", "decode_tok_s", "e2e_output_tok_s"]
    if requests.empty:
        return pd.DataFrame(columns=columns)
    measured = requests[(~requests["warmup"].astype(bool)) & (requests["ok"].astype(bool))]
    rows = []
    for _, r in measured.iterrows():
        t_first = None if pd.isna(r["t_first_token_s"]) else float(r["t_first_token_s"])
        t_done = None if pd.isna(r["t_done_s"]) else float(r["t_done_s"])
        out_tokens = None if pd.isna(r["output_tokens"]) else float(r["output_tokens"])
        rows.append({
            "cell_id": r["cell_id"], "request_index": int(r["request_index"]),
            "ttft_s": None if t_first is None else t_first - float(r["t_sent_s"]),
            "decode_tok_s": _decode_tok_s(out_tokens, t_first, list(r["chunk_times_s"]), t_done),
            "e2e_output_tok_s": _e2e_output_tok_s(out_tokens, float(r["t_sent_s"]), t_done),
        })
    return pd.DataFrame(rows, columns=columns)
