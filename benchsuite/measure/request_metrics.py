"""The per-request formulas of benchsuite.measure.metrics on a request's token timeline (the definitions,
with the rule that decides which timeline a request has, are benchsuite.measure.metrics' docstring; callers
import these names from there). Pure functions of one RequestRecord; None where a figure is undefined.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass

from benchsuite.records import RequestRecord

# ---- the token timeline ------------------------------------------------------------------------


@dataclass(frozen=True)
class TokenTimeline:
    """When the stream's cumulative token count first reached each value: counts[i] tokens at times_s[i]."""

    times_s: tuple[float, ...]
    counts: tuple[int, ...]  # strictly increasing, the first >= 1
    reads: tuple[int, ...]  # body read of each point
    source: str  # "counts" (the engine's per-chunk counts) or "text chunks" (one token each)


def token_timeline(r: RequestRecord) -> TokenTimeline | None:
    """The request's token timeline, or None (untimed_reason says why)."""
    return _timeline(r)[0]


def untimed_reason(r: RequestRecord) -> str | None:
    """Why the request has no token timeline; None when it has one."""
    return _timeline(r)[1]


def _timeline(r: RequestRecord) -> tuple[TokenTimeline | None, str | None]:
    if r.count_tokens and r.uncounted_chunks == 0:
        # reads unknown (an older record): each point its own read, so nothing reads as coalesced
        reads = r.count_reads if len(r.count_reads) == len(r.count_tokens) else list(range(len(r.count_tokens)))
        times: list[float] = []
        counts: list[int] = []
        kept: list[int] = []
        for t_s, n, read in zip(r.count_times_s, r.count_tokens, reads):
            if n >= 1 and (not counts or n > counts[-1]):  # a repeated count (the final chunk) adds no token
                times.append(t_s)
                counts.append(n)
                kept.append(read)
        if counts:
            return TokenTimeline(tuple(times), tuple(counts), tuple(kept), "counts"), None
        return None, "the engine's per-chunk token counts never reached 1"
    chunks, tokens = len(r.chunk_times_s), r.output_tokens
    if tokens is None:
        return None, "no usage: the token count is unknown"
    if chunks == 0:
        return None, "no text chunk and no per-chunk token counts"
    if tokens != chunks:
        why = (
            f"{r.uncounted_chunks} text chunks carried no token count"
            if r.count_tokens
            else "the engine sent no per-chunk token counts"
        )
        return None, f"{why} and usage says {tokens} tokens over {chunks} text chunks: when each token came is unknown"
    reads = r.chunk_reads if len(r.chunk_reads) == chunks else list(range(chunks))
    return TokenTimeline(tuple(r.chunk_times_s), tuple(range(1, chunks + 1)), tuple(reads), "text chunks"), None


# ---- per-request metrics ---------------------------------------------------------------------


def ttft_s(r: RequestRecord) -> float | None:
    line = token_timeline(r)
    return None if line is None else line.times_s[0] - r.t_sent_s


def ttft_text_s(r: RequestRecord) -> float | None:
    """Time to the first visible text (not token 1: tokens may precede it with no text)."""
    first = r.t_first_text_s if r.t_first_text_s is not None else (r.chunk_times_s[0] if r.chunk_times_s else None)
    return None if first is None else first - r.t_sent_s


def latency_s(r: RequestRecord) -> float | None:
    if r.t_done_s is None:
        return None
    return r.t_done_s - r.t_sent_s


def itls_s(r: RequestRecord) -> list[float]:
    line = token_timeline(r)
    return [] if line is None else [b - a for a, b in itertools.pairwise(line.times_s)]


def tpot_s(r: RequestRecord) -> float | None:
    ttft, latency = ttft_s(r), latency_s(r)
    if ttft is None or latency is None or r.output_tokens is None or r.output_tokens < 2:
        return None
    return (latency - ttft) / (r.output_tokens - 1)


def first_chunk_tokens(r: RequestRecord) -> int | None:
    """f: the tokens of the timeline's first point (1 unless a chunk carried several); None when untimed."""
    line = token_timeline(r)
    return None if line is None else line.counts[0]


def decode_tok_s(r: RequestRecord) -> float | None:
    line = token_timeline(r)
    if line is None or len(line.counts) < 2:
        return None
    span_s = line.times_s[-1] - line.times_s[0]
    if span_s <= 0:  # only a scripted clock gives two points one reading
        return None
    return (line.counts[-1] - line.counts[0]) / span_s


def tokens_per_chunk(r: RequestRecord) -> float | None:
    """Tokens each timeline point after the first added, on average."""
    line = token_timeline(r)
    if line is None or len(line.counts) < 2:
        return None
    return (line.counts[-1] - line.counts[0]) / (len(line.counts) - 1)


def per_token_latencies_s(r: RequestRecord) -> list[float]:
    """Each timeline gap divided by the tokens its later point added, once per token."""
    line = token_timeline(r)
    if line is None:
        return []
    out: list[float] = []
    for (t0, c0), (t1, c1) in itertools.pairwise(zip(line.times_s, line.counts)):
        out.extend([(t1 - t0) / (c1 - c0)] * (c1 - c0))
    return out


def coalesced_gaps(r: RequestRecord) -> int:
    """Timeline gaps inside one body read (no read between the two points)."""
    line = token_timeline(r)
    return 0 if line is None else sum(1 for a, b in itertools.pairwise(line.reads) if a == b)


def whole_stream(r: RequestRecord) -> bool:
    """Every timeline point of the request came in one body read: the client saw no decode timing."""
    line = token_timeline(r)
    return line is not None and len(line.reads) >= 2 and len(set(line.reads)) == 1


def mostly_whole(r: RequestRecord) -> bool:
    """More than half of the request's timeline points came in the read of token 1 or in that of token n:
    the client timed less than half of its decode (a whole stream is the extreme case)."""
    line = token_timeline(r)
    if line is None or len(line.reads) < 2:
        return False
    ends = max(sum(1 for x in line.reads if x == line.reads[0]), sum(1 for x in line.reads if x == line.reads[-1]))
    return 2 * ends > len(line.reads)


CLIENT_BOUND_FRACTION = 0.05
"""A request whose token 1 or token n came in one body read with more than this fraction of its other
timeline points is client-bound (see client_bound)."""


def client_bound(r: RequestRecord) -> bool:
    """Token 1 (or token n) was read together with more than CLIENT_BOUND_FRACTION of the request's other
    timeline points: the client read that end at least that many token gaps late (it was busy or not
    scheduled), so the span it timed is its own, not the engine's. A whole stream is the extreme case.
    Coalescing in the middle of a stream does not matter: only the two ends make the span."""
    line = token_timeline(r)
    if line is None or len(line.reads) < 2:
        return False
    with_first = sum(1 for x in line.reads if x == line.reads[0]) - 1
    with_last = sum(1 for x in line.reads if x == line.reads[-1]) - 1
    return max(with_first, with_last) > CLIENT_BOUND_FRACTION * (len(line.reads) - 1)


def timings_decode_tok_s(r: RequestRecord) -> float | None:
    """The engine's own decode rate for this request (timings.predicted_per_second: llama-server, built-in)."""
    value = (r.engine_timings or {}).get("predicted_per_second")
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 else None


def engine_span_s(r: RequestRecord) -> float | None:
    """Token 1 -> token n on the engine's clock: timings.predicted_ms, else (predicted_n - 1) / its rate."""
    timings = r.engine_timings or {}
    ms = timings.get("predicted_ms")
    if isinstance(ms, (int, float)) and not isinstance(ms, bool) and ms > 0:
        return float(ms) / 1e3
    rate, n = timings_decode_tok_s(r), timings.get("predicted_n")
    return (n - 1) / rate if rate is not None and isinstance(n, int) and n >= 2 else None


def engine_ratio(r: RequestRecord) -> float | None:
    """Our decode tok/s / the engine's own for this request; None without both, or for a client-bound stream."""
    ours, theirs = decode_tok_s(r), timings_decode_tok_s(r)
    if ours is None or theirs is None or client_bound(r):
        return None
    return ours / theirs


def decode_interval(r: RequestRecord) -> tuple[float, float, int] | None:
    """(t_token1, t_tokenn, n - f) of a timed request; None when untimed."""
    line = token_timeline(r)
    if line is None:
        return None
    return line.times_s[0], line.times_s[-1], line.counts[-1] - line.counts[0]


def union_s(intervals: Iterable[tuple[float, float]]) -> float:
    """The measure of the union of closed intervals [a, b]."""
    total, end = 0.0, -math.inf
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total
