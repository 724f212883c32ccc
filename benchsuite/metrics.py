"""Every metric of a cell, defined once here with its formula. Times in seconds (perf_counter).

Which requests count:
- *measured* = not warmup. Counts, error rate, throughput and the window use measured requests.
- *warm* = measured, ok and not cold. Latency distributions (TTFT, ITL, TPOT, decode rate) use warm
  requests, so the server's first request after start-up never mixes into them.
- *cold* = the record flagged cold (the first request after a server start, warmup or not).

Per request (r):
- TTFT = r.t_first_token_s - r.t_sent_s  (first chunk with non-empty generated text)
- latency = r.t_done_s - r.t_sent_s
- ITL = gaps between consecutive content chunks: chunk_times_s[i+1] - chunk_times_s[i], each chunk
  timed as its SSE event is parsed; so sum(ITL) = t_last_chunk - t_first_token, and
  latency - TTFT = sum(ITL) + (t_done - t_last_chunk). Where chunks carry several tokens it is an
  inter-chunk latency: tokens per chunk = (output_tokens - f) / (chunks - 1), f = the first chunk's tokens
- per-token latency = each gap / the tokens its later chunk carried (per-chunk usage counts where
  the engine sends them, else the request's mean tokens per chunk)
- TPOT = (latency - TTFT) / (output_tokens - 1)   (needs output_tokens >= 2)
- decode tok/s = (output_tokens - f) / (t_last_chunk - t_first_token), f = 1 unless per-chunk usage
  says the first chunk held more (needs output_tokens > f and two content chunks). A request whose
  whole stream came in one body read still counts: its span is the client's parse time, so it ranks
  as the fastest it is, and the cell says its client could not keep up (`client_flag`).
- coalesced gaps = chunk gaps inside one body read (the client did not read between the two chunks)

Per cell:
- TTFT p50/p90/p99 over warm requests; ITL p50/p99 and per-token latency p50 over all warm gaps
  pooled; TPOT p50 and decode tok/s p50 over warm requests (percentiles: linear interpolation).
  When half or more of the warm streams arrived whole in one read, the client timed no decode the
  median could land on: decode tok/s p50 is then the engine's own per-request figure, or for an
  engine without one a lower bound (a whole stream's (output_tokens - f) / (t_last_chunk - t_sent));
  extras `decode_source` says which.
- engine decode tok/s p50 = median over warm requests of the engine's own figure (llama.cpp
  `timings.predicted_per_second`); a cell where it and ours differ by more than
  ENGINE_TIMINGS_MARGIN carries `engine_timings_flag`.
- window = max(t_done_s) - min(t_sent_s) over measured requests
- aggregate output tok/s = sum(output_tokens of measured ok requests) / window
  (None when any of them lacks usage: a partial sum would understate it)
- request throughput = measured ok requests / window
- error rate = measured failed requests / measured requests
- cold TTFT = TTFT of the cold record when it succeeded

A metric that cannot be computed is None, never 0. The cell is `invalid` with every reason when
there is no successful request, when a headline metric (TTFT p50, decode tok/s p50, aggregate
output tok/s) is None, or when the error rate exceeds `max_error_rate`.

Paging counters (the built-in server's Prometheus text, read by `scrape.py`) become cell fields
through `paging.paging_delta(before, after)`; see its docstring (and `paging.PAGING_DEFINITIONS`, merged
into `DEFINITIONS`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import Any

from benchsuite.paging import PAGING_DEFINITIONS
from benchsuite.records import CellResult, RequestRecord

_TTFT = "TTFT = t_first_token - t_sent (first chunk with non-empty generated text), warm requests"
DEFINITIONS: dict[str, str] = {
    "num_requests": "measured (non-warmup) requests sent",
    "num_errors": "measured requests that failed (HTTP error, reset, timeout, error event, no tokens)",
    "error_rate": "num_errors / num_requests",
    "ttft_p50_s": f"median {_TTFT}",
    "ttft_p90_s": f"90th percentile {_TTFT}",
    "ttft_p99_s": f"99th percentile {_TTFT}",
    "itl_p50_s": (
        "median ITL; ITL = gap between consecutive content chunks (an inter-chunk latency where chunks carry "
        "several tokens), each chunk timed as its SSE event is parsed, all warm requests pooled"
    ),
    "itl_p99_s": "99th percentile ITL (inter-chunk latency), all warm requests pooled",
    "itl_per_token_p50_s": (
        "median per-token latency: each chunk gap / the tokens that chunk carried (per-chunk usage, else the mean)"
    ),
    "tokens_per_chunk_mean": "mean over warm requests of (output_tokens - f) / (chunks - 1), f = first chunk's tokens",
    "coalesced_gaps": "chunk gaps inside one body read: the client did not read between them (its gap is a parse time)",
    "whole_stream_reads": "warm requests whose every content chunk came in one body read (counted, ranked fastest)",
    "timings_decode_tok_s_p50": (
        "median over warm requests of the engine's own decode rate (llama.cpp timings.predicted_per_second)"
    ),
    "tpot_p50_s": "median over warm requests of TPOT = (latency - TTFT) / (output_tokens - 1)",
    "decode_tok_s_p50": (
        "median over warm requests of (output_tokens - f) / (t_last_chunk - t_first_token), "
        "f = first chunk's tokens (1 unless per-chunk usage says more)"
    ),
    "output_tok_s": "sum(output_tokens from usage, measured ok requests) / window_s",
    "request_s": "measured ok requests / window_s",
    "window_s": "last t_done - first t_sent over measured requests",
    "cold_ttft_s": "TTFT of the first request after the server started (kept out of the warm percentiles)",
    "prompt_tokens_mean": "mean usage.prompt_tokens over measured ok requests",
    "output_tokens_total": "sum of usage.completion_tokens over measured ok requests",
    "usage_mismatches": "measured requests with no usage, or more content chunks than usage.completion_tokens",
    **PAGING_DEFINITIONS,
}
"""Each CellResult metric field with its one-line formula, for reports to print beside the numbers."""

ENGINE_TIMINGS_MARGIN = 0.20
"""Our decode tok/s p50 and the engine's own may differ this much (HTTP and parsing cost) before the cell is flagged."""
CLIENT_BEHIND_FRACTION = 0.05
"""More than this fraction of a cell's chunk gaps inside one body read: the client could not keep up."""

DEFAULT_MAX_ERROR_RATE = 0.0
"""Any failed measured request invalidates the cell unless the caller allows some."""


def percentile(values: Iterable[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation between order statistics (numpy's
    default); None for no values."""
    data = sorted(values)
    if not data:
        return None
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    rank = (len(data) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(data) - 1)
    return data[low] + (data[high] - data[low]) * (rank - low)


# ---- per-request metrics ---------------------------------------------------------------------


def ttft_s(r: RequestRecord) -> float | None:
    if r.t_first_token_s is None:
        return None
    return r.t_first_token_s - r.t_sent_s


def latency_s(r: RequestRecord) -> float | None:
    if r.t_done_s is None:
        return None
    return r.t_done_s - r.t_sent_s


def itls_s(r: RequestRecord) -> list[float]:
    times = r.chunk_times_s
    return [b - a for a, b in itertools.pairwise(times)]


def tpot_s(r: RequestRecord) -> float | None:
    ttft, latency = ttft_s(r), latency_s(r)
    if ttft is None or latency is None or r.output_tokens is None or r.output_tokens < 2:
        return None
    return (latency - ttft) / (r.output_tokens - 1)


def first_chunk_tokens(r: RequestRecord) -> int:
    """Tokens in the first content chunk: the per-chunk usage count where the engine sent one, else 1."""
    if r.chunk_tokens and len(r.chunk_tokens) == len(r.chunk_times_s) and r.chunk_tokens[0] >= 1:
        return int(r.chunk_tokens[0])
    return 1


def decode_tok_s(r: RequestRecord) -> float | None:
    f = first_chunk_tokens(r)
    if r.output_tokens is None or r.output_tokens <= f or len(r.chunk_times_s) < 2:
        return None
    span_s = r.chunk_times_s[-1] - r.chunk_times_s[0]
    if span_s <= 0:  # only a scripted clock gives two chunks one reading
        return None
    return (r.output_tokens - f) / span_s


def tokens_per_chunk(r: RequestRecord) -> float | None:
    """Tokens each content chunk after the first carried, on average."""
    if r.output_tokens is None or len(r.chunk_times_s) < 2:
        return None
    return (r.output_tokens - first_chunk_tokens(r)) / (len(r.chunk_times_s) - 1)


def per_token_latencies_s(r: RequestRecord) -> list[float]:
    """Each chunk gap divided by the tokens its later chunk carried (per-chunk usage, else the mean)."""
    gaps = itls_s(r)
    if r.chunk_tokens and len(r.chunk_tokens) == len(r.chunk_times_s):
        sizes = [b - a for a, b in itertools.pairwise(r.chunk_tokens)]
        return [gap / size for gap, size in zip(gaps, sizes) if size > 0]
    mean = tokens_per_chunk(r)
    return [gap / mean for gap in gaps] if mean else []


def coalesced_gaps(r: RequestRecord) -> int:
    """Chunk gaps inside one body read (no read between the two chunks)."""
    return sum(1 for a, b in itertools.pairwise(r.chunk_reads) if a == b)


def timings_decode_tok_s(r: RequestRecord) -> float | None:
    """The engine's own decode rate for this request (llama.cpp timings.predicted_per_second)."""
    value = (r.engine_timings or {}).get("predicted_per_second")
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 else None


# ---- cell summary ----------------------------------------------------------------------------


def measured_records(records: Sequence[RequestRecord]) -> list[RequestRecord]:
    return [r for r in records if not r.warmup]


def warm_records(records: Sequence[RequestRecord]) -> list[RequestRecord]:
    return [r for r in records if not r.warmup and r.ok and not r.cold]


def summarize(
    records: Sequence[RequestRecord],
    *,
    base: CellResult,
    max_error_rate: float = DEFAULT_MAX_ERROR_RATE,
) -> CellResult:
    """Fill base's metric fields from the cell's records; status becomes ok or invalid (with
    reasons joined by '; '). A base already `failed` stays failed."""
    measured = measured_records(records)
    ok = [r for r in measured if r.ok]
    warm = warm_records(records)
    num_errors = len(measured) - len(ok)
    error_rate = num_errors / len(measured) if measured else None
    reasons = _request_reasons(measured, ok, warm, error_rate, max_error_rate)

    ttfts = [t for t in map(ttft_s, warm) if t is not None]
    itls = [gap for r in warm for gap in itls_s(r)]
    tpots = [t for t in map(tpot_s, warm) if t is not None]
    decode_rates = [d for d in map(decode_tok_s, warm) if d is not None]
    reasons += _decode_reasons(warm, decode_rates)
    decode_p50, decode_source = _decode_p50(warm, decode_rates)
    throughput, throughput_reasons = _throughput_fields(measured, ok)
    reasons += throughput_reasons
    cold = next((r for r in records if r.cold), None)

    result = replace(
        base,
        num_requests=len(measured),
        num_errors=num_errors,
        error_rate=error_rate,
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p90_s=percentile(ttfts, 90),
        ttft_p99_s=percentile(ttfts, 99),
        itl_p50_s=percentile(itls, 50),
        itl_p99_s=percentile(itls, 99),
        **_chunk_fields(warm),
        tpot_p50_s=percentile(tpots, 50),
        decode_tok_s_p50=decode_p50,
        **throughput,
        cold_ttft_s=ttft_s(cold) if cold is not None and cold.ok else None,
        usage_mismatches=sum(1 for r in measured if r.usage_mismatch),
    )
    headline = {
        "ttft_p50_s": result.ttft_p50_s,
        "decode_tok_s_p50": result.decode_tok_s_p50,
        "output_tok_s": result.output_tok_s,
    }
    if not reasons:
        reasons += [f"{name} could not be computed" for name, value in headline.items() if value is None]
    result = replace(
        result, extras={**result.extras, **_client_flags(result, len(itls)), "decode_source": decode_source}
    )
    if base.status == "failed":
        return result
    if reasons:
        return replace(result, status="invalid", reason="; ".join(reasons))
    return replace(result, status="ok", reason=None)


def _request_reasons(
    measured: Sequence[RequestRecord],
    ok: Sequence[RequestRecord],
    warm: Sequence[RequestRecord],
    error_rate: float | None,
    max_error_rate: float,
) -> list[str]:
    """Why the cell's requests leave it invalid: none measured, none succeeded, too many failed, only the cold one
    succeeded."""
    reasons: list[str] = []
    if not measured:
        reasons.append("no measured requests")
    elif not ok:
        reasons.append("no successful requests")
    elif error_rate is not None and error_rate > max_error_rate:
        reasons.append(f"error rate {error_rate:.3f} > allowed {max_error_rate:.3f}")
    if ok and not warm:
        reasons.append("no warm successful requests (only the cold one succeeded)")
    return reasons


def _decode_reasons(warm: Sequence[RequestRecord], decode_rates: list[float]) -> list[str]:
    """Why no warm request gave a decode rate."""
    if warm and all(r.output_tokens is not None and r.output_tokens <= 1 for r in warm):
        return ["output_tokens <= 1 for all requests"]
    if warm and not decode_rates:
        return ["no request has two content chunks and usage to compute decode tok/s"]
    return []


def _throughput_fields(
    measured: Sequence[RequestRecord], ok: Sequence[RequestRecord]
) -> tuple[dict[str, Any], list[str]]:
    """The window, aggregate output tok/s, request rate and token totals of a cell, and why any of them is missing."""
    reasons: list[str] = []
    window = _window_s(measured)
    missing_usage = [r for r in ok if r.output_tokens is None]
    output_total = None if missing_usage or not ok else sum(r.output_tokens or 0 for r in ok)
    if ok and missing_usage:
        reasons.append(f"usage missing for {len(missing_usage)} successful requests")
    if ok and not window:
        reasons.append("measured window is empty")
    prompt_counts = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    fields = {
        "output_tok_s": output_total / window if output_total is not None and window else None,
        "request_s": len(ok) / window if ok and window else None,
        "window_s": window,
        "prompt_tokens_mean": sum(prompt_counts) / len(prompt_counts) if prompt_counts else None,
        "output_tokens_total": output_total,
    }
    return fields, reasons


def whole_stream(r: RequestRecord) -> bool:
    """Every content chunk of the request came in one body read: the client saw no decode timing."""
    return len(r.chunk_reads) >= 2 and len(set(r.chunk_reads)) == 1


def _decode_p50(warm: Sequence[RequestRecord], decode_rates: list[float]) -> tuple[float | None, str]:
    """The cell's decode tok/s p50 and its source. Streams that arrived whole rank fastest, so the p50
    over all requests is right while fewer than half of them are whole. Past that the client timed no
    decode the median could land on: the engine's own per-request figure stands in where it sends one,
    else a lower bound (a whole stream decoded within its latency, so each value is at most the truth,
    and so is their median)."""
    whole = sum(1 for r in warm if whole_stream(r) and decode_tok_s(r) is not None)
    if not decode_rates or 2 * whole < len(decode_rates):
        return percentile(decode_rates, 50), "client"
    why = (
        f"{whole} of {len(decode_rates)} streams arrived whole in one body read, "
        "so the client could not time their decode"
    )
    engine = [d for d in map(timings_decode_tok_s, warm) if d is not None]
    if engine:
        return percentile(engine, 50), f"engine timings ({why})"
    bounds = [
        _whole_stream_bound(r) if whole_stream(r) else decode_tok_s(r) for r in warm if decode_tok_s(r) is not None
    ]
    return percentile(
        [b for b in bounds if b is not None], 50
    ), f"client lower bound ({why}: each decoded within its latency)"


def _whole_stream_bound(r: RequestRecord) -> float | None:
    """(output_tokens - f) / (last chunk - sent): a stream seen whole decoded no slower than this."""
    if r.output_tokens is None or not r.chunk_times_s or r.chunk_times_s[-1] <= r.t_sent_s:
        return None
    return (r.output_tokens - first_chunk_tokens(r)) / (r.chunk_times_s[-1] - r.t_sent_s)


def _chunk_fields(warm: Sequence[RequestRecord]) -> dict[str, Any]:
    """Per-token latency, tokens per chunk, coalesced reads and the engine's own decode rate of a cell."""
    sizes = [t for t in map(tokens_per_chunk, warm) if t is not None]
    engine = [d for d in map(timings_decode_tok_s, warm) if d is not None]
    return {
        "itl_per_token_p50_s": percentile([x for r in warm for x in per_token_latencies_s(r)], 50),
        "tokens_per_chunk_mean": sum(sizes) / len(sizes) if sizes else None,
        "coalesced_gaps": sum(coalesced_gaps(r) for r in warm),
        "whole_stream_reads": sum(1 for r in warm if whole_stream(r)),
        "timings_decode_tok_s_p50": percentile(engine, 50),
    }


def _client_flags(result: CellResult, gaps: int) -> dict[str, str]:
    """`client_flag` when the client could not keep up; `engine_timings_flag` when the engine's own decode
    rate disagrees."""
    flags: dict[str, str] = {}
    if gaps and result.coalesced_gaps > CLIENT_BEHIND_FRACTION * gaps:
        flags["client_flag"] = (
            f"client could not keep up: {result.coalesced_gaps} of {gaps} chunk gaps fell inside one body read "
            f"({result.whole_stream_reads} requests arrived whole in one read); those gaps are parse times, so ITL is "
            f"understated and decode tok/s of those requests overstated (they still count, ranked fastest)"
        )
    ours, theirs = result.decode_tok_s_p50, result.timings_decode_tok_s_p50
    if ours and theirs and abs(ours / theirs - 1.0) > ENGINE_TIMINGS_MARGIN:
        flags["engine_timings_flag"] = (
            f"decode tok/s p50: ours {ours:.1f}, the engine's own timings {theirs:.1f} "
            f"({ours / theirs - 1.0:+.0%}, more than the {ENGINE_TIMINGS_MARGIN:.0%} margin)"
        )
    return flags


def _window_s(measured: Sequence[RequestRecord]) -> float | None:
    done = [r.t_done_s for r in measured if r.t_done_s is not None]
    if not measured or not done:
        return None
    span_s = max(done) - min(r.t_sent_s for r in measured)
    return span_s if span_s > 0 else None
