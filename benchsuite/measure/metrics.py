"""Every metric of a cell, defined once here with its formula. Times in seconds (perf_counter).

Which requests count:
- *measured* = not warmup. Counts, error rate, throughput and the window use measured requests.
- *warm* = measured, ok and not cold. Latency distributions (TTFT, ITL, TPOT, decode rate) use warm
  requests, so the server's first request after start-up never mixes into them.
- *cold* = the record flagged cold (the first request after a server start, warmup or not).

Per request (r), on its *token timeline* (`token_timeline`): the times at which the stream's
cumulative generated-token count first reached each value, (t_1, c_1), ..., (t_last, c_last), c
increasing. Its points are the chunks that carried a count, text or not (`count_tokens`: llama.cpp
timings_per_token, continuous usage stats; see benchsuite.load.stream_client), when every content chunk
carried one; else, for an engine that sends no counts, the content chunks, each one token, only
when usage says there were exactly as many tokens as text chunks. Otherwise the request is
*untimed*: no TTFT, rate, TPOT or ITL comes from it, and `untimed_reason` says why (a chunk without
text may have carried tokens, so the first and last text chunks are not token 1 and token n: on
llama.cpp with a random model this overstated decode tok/s by 12-40% at the median).
- f = c_1, the first point's tokens (1 unless a chunk carried several); n = c_last
- TTFT = t_1 - t_sent  (token 1: the first chunk whose count reached >= 1, text or not)
- time to first text = r.t_first_text_s - t_sent  (the first visible text; a separate figure)
- latency = t_done - t_sent
- decode tok/s = (n - f) / (t_last - t_1): the tokens after the first point over the time they took;
  needs two points. A *client-bound* request (token 1 or token n came in one body read with more
  than CLIENT_BOUND_FRACTION of its other points, a whole stream in one read being the extreme: the
  client read that end late, so its span is short) still counts: it ranks as fast as or faster than
  it was, and the cell says its client could not keep up (`client_flag`).
- ITL = gaps between consecutive points, each timed as its SSE event is parsed (an inter-chunk latency
  where a point added several tokens); sum(ITL) = t_last - t_1
- per-token latency = each gap / the tokens its later point added, once per token: sum = t_last - t_1
  over n - f values
- TPOT = (latency - TTFT) / (output_tokens - 1)   (needs output_tokens >= 2)
- coalesced gaps = gaps between points inside one body read (the client did not read between them)
- engine ratio = decode tok/s / the engine's own decode rate for the request (llama-server's and the
  built-in server's `timings.predicted_per_second` = (predicted_n - 1) / predicted_ms, token 1 to
  token n on the engine's clock: the same quantity); client-bound requests are not checked (their
  figure is the client's, `client_flag` says so). A request is outside when |ratio - 1| exceeds its
  tolerance = ENGINE_TIMINGS_MARGIN + CLIENT_JITTER_S / engine span (token 1 -> n, engine's clock):
  a relative allowance plus the client's timing jitter, which weighs only on short spans

Per cell:
- TTFT p50/p90/p99 and time-to-first-text p50 over warm requests; ITL p50/p99 and per-token latency
  p50 over all warm gaps pooled; TPOT p50 and decode tok/s p50 over warm requests (percentiles:
  linear interpolation). Untimed warm requests are counted (`untimed_requests`, `untimed_reason`,
  extras `untimed_flag`), never dropped silently and never timed on text chunks.
  When half or more of the warm streams arrived (mostly) whole (more than half of their points in
  the read of token 1 or of token n), the client timed no decode the median could land on: decode
  tok/s p50 is then the engine's own per-request figure, or for an engine without one a lower bound
  (such a stream's (n - f) / (t_last - t_sent)); extras `decode_source` says which.
- engine decode tok/s p50 = median over warm requests of the engine's own figure. Every warm request
  with both figures is cross-checked: `engine_timings_checked`, `engine_timings_outside` (those whose
  |ours / engine's - 1| > their tolerance), `engine_timings_ratio_p50` and `_max_dev`; a cell
  with any request outside carries `engine_timings_flag` (the report's first screen shows it).
- decode aggregate tok/s (c >= 2) = sum_i (n_i - f_i) / |U_i [t_1,i, t_last,i]| over measured ok
  requests: the tokens after each stream's first over the time at least one stream was decoding
  (`decode_window_s`, the measure of the union). Why this definition: it leaves out the time before a
  stream's first token (its prefill and queueing, which aggregate output tok/s counts: with 32 output
  tokens at c=4 that was 52-86% of the window), it reduces at c=1 to the requests' own decode rates
  averaged weighted by their decode time (sum of tokens / sum of spans: not a median, not weighted
  by tokens), and the union never counts a moment twice, so two streams decoding side by
  side at 50 tok/s each read 100. Prefill steps of one stream that fall inside another's decode stay
  in (continuous batching makes the decoding stream pay for them). None when any measured ok request
  is untimed (a partial sum would understate it).
- window = max(t_done_s) - min(t_sent_s) over measured requests
- aggregate output tok/s = sum(output_tokens of measured ok requests) / window
  (None when any of them lacks usage: a partial sum would understate it)
- request throughput = measured ok requests / window
- error rate = measured failed requests / measured requests
- cold TTFT = TTFT of the cold record when it succeeded

The per-request formulas are code in benchsuite.measure.request_metrics (re-exported here); their
definitions are this docstring. ENGINE_TIMINGS_MARGIN and its measured basis: its docstring below.

A metric that cannot be computed is None, never 0. The cell is `invalid` with every reason when
there is no successful request, when a headline metric (TTFT p50, decode tok/s p50, aggregate
output tok/s) is None, or when the error rate exceeds `max_error_rate`.

Paging counters (the built-in server's Prometheus text, read by `scrape.py`) become cell fields
through `paging.paging_delta(before, after)`; see its docstring (and `paging.PAGING_DEFINITIONS`, merged
into `DEFINITIONS`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from benchsuite.measure.paging import PAGING_DEFINITIONS
from benchsuite.measure.request_metrics import (
    CLIENT_BOUND_FRACTION,
    TokenTimeline,
    client_bound,
    coalesced_gaps,
    decode_interval,
    decode_tok_s,
    engine_ratio,
    engine_span_s,
    first_chunk_tokens,
    itls_s,
    latency_s,
    mostly_whole,
    per_token_latencies_s,
    timings_decode_tok_s,
    token_timeline,
    tokens_per_chunk,
    tpot_s,
    ttft_s,
    ttft_text_s,
    union_s,
    untimed_reason,
    whole_stream,
)
from benchsuite.records import CellResult, RequestRecord

__all__ = [  # the per-request formulas live in request_metrics; callers read them here, beside their definitions
    "CLIENT_BOUND_FRACTION",
    "CLIENT_JITTER_S",
    "DEFINITIONS",
    "ENGINE_TIMINGS_MARGIN",
    "TokenTimeline",
    "client_bound",
    "coalesced_gaps",
    "decode_interval",
    "decode_tok_s",
    "engine_ratio",
    "engine_span_s",
    "engine_tolerance",
    "first_chunk_tokens",
    "itls_s",
    "latency_s",
    "mostly_whole",
    "per_token_latencies_s",
    "percentile",
    "summarize",
    "timings_decode_tok_s",
    "token_timeline",
    "tokens_per_chunk",
    "tpot_s",
    "ttft_s",
    "ttft_text_s",
    "union_s",
    "untimed_reason",
    "whole_stream",
]

_TTFT = "TTFT = t_token1 - t_sent (the first chunk whose token count reached 1, text or not), warm requests"
DEFINITIONS: dict[str, str] = {
    "num_requests": "measured (non-warmup) requests sent",
    "num_errors": "measured requests that failed (HTTP error, reset, timeout, error event, no tokens)",
    "error_rate": "num_errors / num_requests",
    "ttft_p50_s": f"median {_TTFT}",
    "ttft_p90_s": f"90th percentile {_TTFT}",
    "ttft_p99_s": f"99th percentile {_TTFT}",
    "ttft_text_p50_s": "median over warm requests of t_first_text - t_sent (the first visible text, not token 1)",
    "itl_p50_s": (
        "median ITL; ITL = gap between consecutive points of the token timeline (an inter-chunk latency where a "
        "chunk carried several tokens), each timed as its SSE event is parsed, all warm requests pooled"
    ),
    "itl_p99_s": "99th percentile ITL (inter-chunk latency), all warm requests pooled",
    "itl_per_token_p50_s": (
        "median per-token latency: each timeline gap / the tokens its later point added, once per token, pooled"
    ),
    "tokens_per_chunk_mean": "mean over warm requests of (n - f) / (points - 1) on the token timeline",
    "coalesced_gaps": "timeline gaps inside one body read: the client did not read between them (a parse time)",
    "whole_stream_reads": "warm requests whose every timeline point came in one body read (counted, ranked fastest)",
    "timings_decode_tok_s_p50": (
        "median over warm requests of the engine's own decode rate (timings.predicted_per_second: llama-server, "
        "the built-in server)"
    ),
    "tpot_p50_s": "median over warm requests of TPOT = (latency - TTFT) / (output_tokens - 1)",
    "decode_tok_s_p50": (
        "median over warm requests of (n - f) / (t_tokenn - t_token1) on the token timeline, "
        "f = the first point's tokens (1 unless a chunk carried several)"
    ),
    "decode_agg_tok_s": (
        "sum over measured ok requests of (n - f) / measure of the union of their [t_token1, t_tokenn]: "
        "tokens after each stream's first over the time any stream was decoding (prefill before token 1 excluded)"
    ),
    "decode_window_s": "measure of the union of [t_token1, t_tokenn] over measured ok requests",
    "untimed_requests": "warm requests with no token timeline (no counts and tokens != text chunks): no rate from them",
    "untimed_reason": "why those requests have no token timeline (the most frequent reason)",
    "ttft_late_requests": (
        "warm requests whose first timed point carried f > 1 tokens: their TTFT is to token f (an upper bound "
        "on the time to token 1 by up to f - 1 decode steps)"
    ),
    "engine_timings_checked": "warm requests, not client-bound, with our decode rate and the engine's own",
    "engine_timings_outside": (
        "of those, requests where |ours / engine's - 1| > ENGINE_TIMINGS_MARGIN + CLIENT_JITTER_S / engine span"
    ),
    "client_bound_requests": (
        "warm requests whose token 1 or token n came in one body read with more than "
        f"{CLIENT_BOUND_FRACTION:.0%} of their other timeline points (the client read that end late)"
    ),
    "engine_timings_ratio_p50": "median over checked requests of our decode tok/s / the engine's own",
    "engine_timings_ratio_max_dev": "largest |ours / engine's - 1| over checked requests",
    "output_tok_s": "sum(output_tokens from usage, measured ok requests) / window_s (prefill time included)",
    "request_s": "measured ok requests / window_s",
    "window_s": "last t_done - first t_sent over measured requests",
    "cold_ttft_s": "TTFT of the first request after the server started (kept out of the warm percentiles)",
    "prompt_tokens_mean": "mean usage.prompt_tokens over measured ok requests",
    "output_tokens_total": "sum of usage.completion_tokens over measured ok requests",
    "usage_mismatches": "measured requests with no usage, or more content chunks than usage.completion_tokens",
    **PAGING_DEFINITIONS,
}
"""Each CellResult metric field with its one-line formula, for reports to print beside the numbers."""

CLIENT_JITTER_S = 0.020
"""The client's timing jitter, absolute: how much the client's lag at token n may differ from its lag at
token 1 (SSE write, loopback, a scheduler that ran something else). Basis: ENGINE_TIMINGS_MARGIN's."""
ENGINE_TIMINGS_MARGIN = 0.03
"""Per request, |ours / the engine's decode rate - 1| may reach ENGINE_TIMINGS_MARGIN + CLIENT_JITTER_S /
the engine's span (token 1 -> token n) before the cell is flagged. Both figures time the same interval
on two clocks; the client reads token 1 and token n each a little after the engine (write, loopback,
parse), the two lags cancel but for their difference, an absolute jitter, which matters only on short
spans. Basis, measured on this 2-core CPU machine shared by 7 users (2026-12-02,
`python benchmarks/yardstick_agreement.py --out DIR`, tiny model, 32 and 128 tokens, c=1 and 2, 96
requests; benchmarks/results/yardstick_agreement.md): built-in server (spans 0.4-2.2 s) largest
deviation 2.35%, 0.82% for spans over 1 s; llama-server (spans 49-200 ms at 600-2,200 tok/s) 5.6% at
128 tokens and 30% at 32 tokens (49 ms spans); the span difference (jitter) never exceeded 16.6 ms
(CLIENT_JITTER_S = 20 ms), the relative part stayed under 1% wherever spans were long (3%: headroom).
At 36.7 tok/s and 128 tokens (llama.cpp on the H200) the tolerance is 3.6%; the bias this check exists
for (text-chunk timing, +12% to +40%) lies outside it. Client-bound requests are not checked."""
CLIENT_BEHIND_FRACTION = 0.05
"""More than this fraction of a cell's timeline gaps inside one body read: the client could not keep up."""

DEFAULT_MAX_ERROR_RATE = 0.0
"""Any failed measured request invalidates the cell unless the caller allows some."""


def percentile(values: Iterable[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation between order statistics (numpy's
    default, Hyndman-Fan type 7); None for no values, ValueError for q outside [0, 100]."""
    data = list(values)
    return float(np.percentile(data, q)) if data else None


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
    untimed = _untimed_fields(warm)
    reasons += _decode_reasons(warm, decode_rates, untimed["untimed_reason"])
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
        ttft_text_p50_s=percentile([t for t in map(ttft_text_s, warm) if t is not None], 50),
        itl_p50_s=percentile(itls, 50),
        itl_p99_s=percentile(itls, 99),
        **_chunk_fields(warm),
        tpot_p50_s=percentile(tpots, 50),
        decode_tok_s_p50=decode_p50,
        **untimed,
        **_decode_agg_fields(ok),
        **_engine_check_fields(warm),
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


def _decode_reasons(warm: Sequence[RequestRecord], decode_rates: list[float], untimed_why: str | None) -> list[str]:
    """Why no warm request gave a decode rate."""
    if warm and all(r.output_tokens is not None and r.output_tokens <= 1 for r in warm):
        return ["output_tokens <= 1 for all requests"]
    if warm and not decode_rates:
        if untimed_why is not None and all(token_timeline(r) is None for r in warm):
            return [f"no request has a token timeline to compute decode tok/s ({untimed_why})"]
        return ["no request has two token-timeline points and usage to compute decode tok/s"]
    return []


def _untimed_fields(warm: Sequence[RequestRecord]) -> dict[str, Any]:
    """How many warm requests have no token timeline, and the most frequent reason."""
    why = [w for w in map(untimed_reason, warm) if w is not None]
    # a first timed point that carried f > 1 tokens (e.g. token 1 was half a UTF-8 character the engine held
    # back): TTFT is then to token f, late by up to f - 1 decode steps; counted, never silently mixed in
    late = sum(1 for r in warm if (first_chunk_tokens(r) or 0) > 1)
    return {
        "untimed_requests": len(why),
        "untimed_reason": Counter(why).most_common(1)[0][0] if why else None,
        "ttft_late_requests": late,
    }


def _decode_agg_fields(ok: Sequence[RequestRecord]) -> dict[str, Any]:
    """decode_agg_tok_s and decode_window_s over measured ok requests (None when any is untimed)."""
    found = [decode_interval(r) for r in ok]
    spans = [s for s in found if s is not None]
    if not spans or len(spans) < len(found):
        return {"decode_agg_tok_s": None, "decode_window_s": None}
    window = union_s((a, b) for a, b, _ in spans)
    tokens = sum(n for _, _, n in spans)
    return {"decode_agg_tok_s": tokens / window if window > 0 and tokens > 0 else None, "decode_window_s": window}


def _engine_check_fields(warm: Sequence[RequestRecord]) -> dict[str, Any]:
    """Every warm request's decode rate against the engine's own, within its tolerance (engine_tolerance)."""
    checked = [(x, engine_tolerance(r)) for r in warm if (x := engine_ratio(r)) is not None]
    ratios = [x for x, _ in checked]
    return {
        "engine_timings_checked": len(ratios),
        "engine_timings_outside": sum(1 for x, tol in checked if abs(x - 1.0) > tol),
        "client_bound_requests": sum(1 for r in warm if client_bound(r)),
        "engine_timings_ratio_p50": percentile(ratios, 50),
        "engine_timings_ratio_max_dev": max((abs(x - 1.0) for x in ratios), default=None),
    }


def engine_tolerance(r: RequestRecord) -> float:
    """How far ours / the engine's may stray from 1 for this request: ENGINE_TIMINGS_MARGIN +
    CLIENT_JITTER_S / the engine's span (no span known: the margin alone)."""
    span = engine_span_s(r)
    return ENGINE_TIMINGS_MARGIN + (CLIENT_JITTER_S / span if span else 0.0)


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


def _decode_p50(warm: Sequence[RequestRecord], decode_rates: list[float]) -> tuple[float | None, str]:
    """The cell's decode tok/s p50 and its source. Streams that arrived (mostly) whole rank fastest, so the
    p50 over all requests is right while fewer than half of them are. Past that the client timed no decode
    the median could land on: the engine's own per-request figure stands in where it sends one, else a
    lower bound (a stream decoded within its latency, so each value is at most the truth, and so is their
    median). A client-bound stream short of that is overstated by its coalesced share (>5%): it counts,
    is not cross-checked, and `client_flag` says the client could not keep up."""
    whole = sum(1 for r in warm if mostly_whole(r) and decode_tok_s(r) is not None)
    if not decode_rates or 2 * whole < len(decode_rates):
        return percentile(decode_rates, 50), "client"
    why = (
        f"{whole} of {len(decode_rates)} streams arrived (mostly) whole: more than half of their tokens in the "
        "read of token 1 or of token n, so the client could not time their decode"
    )
    engine = [d for d in map(timings_decode_tok_s, warm) if d is not None]
    if engine:
        return percentile(engine, 50), f"engine timings ({why})"
    bounds = [
        _whole_stream_bound(r) if mostly_whole(r) else decode_tok_s(r) for r in warm if decode_tok_s(r) is not None
    ]
    return percentile(
        [b for b in bounds if b is not None], 50
    ), f"client lower bound ({why}: each decoded within its latency)"


def _whole_stream_bound(r: RequestRecord) -> float | None:
    """(n - f) / (t_tokenn - t_sent): any stream decoded no slower than this (it decoded within its latency)."""
    span = decode_interval(r)
    if span is None or span[1] <= r.t_sent_s:
        return None
    return span[2] / (span[1] - r.t_sent_s)


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
    """`client_flag` when the client could not keep up; `untimed_flag` when warm requests have no token
    timeline; `engine_timings_flag` when a request's decode rate disagrees with the engine's own."""
    flags: dict[str, str] = {}
    if gaps and result.coalesced_gaps > CLIENT_BEHIND_FRACTION * gaps:
        flags["client_flag"] = (
            f"client could not keep up: {result.coalesced_gaps} of {gaps} timeline gaps fell inside one body read "
            f"({result.whole_stream_reads} requests arrived whole in one read, {result.client_bound_requests} "
            f"client-bound); those gaps are parse times, so ITL is understated and decode tok/s of client-bound "
            f"requests overstated (they still count, ranked fastest; not cross-checked)"
        )
    if result.untimed_requests:
        flags["untimed_flag"] = (
            f"{result.untimed_requests} warm requests have no token timing (no TTFT, decode rate or ITL from them): "
            f"{result.untimed_reason}"
        )
    if result.engine_timings_outside:
        ratio, dev = result.engine_timings_ratio_p50, result.engine_timings_ratio_max_dev
        flags["engine_timings_flag"] = (
            f"decode tok/s disagrees with the engine's own timings: {result.engine_timings_outside} of "
            f"{result.engine_timings_checked} requests differ by more than {ENGINE_TIMINGS_MARGIN:.0%} + "
            f"{CLIENT_JITTER_S * 1e3:.0f} ms / their decode span (median ours/engine's {ratio:.3f}, largest "
            f"deviation {dev:.1%})"
        )
    return flags


def _window_s(measured: Sequence[RequestRecord]) -> float | None:
    done = [r.t_done_s for r in measured if r.t_done_s is not None]
    if not measured or not done:
        return None
    span_s = max(done) - min(r.t_sent_s for r in measured)
    return span_s if span_s > 0 else None
