"""Metric definitions: formulas on scripted timestamps, invariants, invalid-not-zero."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from benchsuite.measure.metrics import (
    DEFINITIONS,
    decode_tok_s,
    itls_s,
    latency_s,
    per_token_latencies_s,
    percentile,
    summarize,
    token_timeline,
    tpot_s,
    ttft_s,
    ttft_text_s,
    union_s,
    untimed_reason,
)
from benchsuite.measure.paging import paging_delta
from benchsuite.records import CellResult, RequestRecord
from benchsuite.tools.scrape import parse_prometheus


def _base(status: str = "ok") -> CellResult:
    return CellResult(
        cell_id="c1",
        run_id="r1",
        engine="e",
        engine_kind="builtin",
        mode="paged",
        server_id="s1",
        params={},
        workload="w",
        prompt_class="short",
        concurrency=2,
        repeat=0,
        status=status,  # type: ignore[arg-type]
    )


def _rec(
    index: int,
    t_sent: float,
    chunks: list[float],
    *,
    tokens: int | None = None,
    t_done: float | None = None,
    warmup: bool = False,
    cold: bool = False,
    ok: bool = True,
    prompt_tokens: int | None = 10,
    counts: list[int] | None = None,
) -> RequestRecord:
    """A request whose text chunks came at `chunks`; `counts`: the token count each chunk carried."""
    return RequestRecord(
        cell_id="c1",
        request_index=index,
        warmup=warmup,
        cold=cold,
        prompt_id=f"p{index}",
        prompt_class="short",
        max_tokens=16,
        t_sent_s=t_sent,
        t_first_token_s=chunks[0] if chunks else None,
        t_done_s=t_done if t_done is not None else (chunks[-1] if chunks else t_sent + 1),
        chunk_times_s=list(chunks),
        prompt_tokens=prompt_tokens,
        output_tokens=len(chunks) if tokens is None else tokens,
        streamed_chunks=len(chunks),
        ok=ok,
        error=None if ok else "stream produced no tokens",
        count_times_s=list(chunks) if counts else [],
        count_tokens=list(counts or []),
        count_reads=list(range(len(chunks))) if counts else [],
        chunk_reads=list(range(len(chunks))),
        t_first_text_s=chunks[0] if chunks else None,
    )


@settings(max_examples=100, deadline=None)
@given(
    st.floats(min_value=0, max_value=1e4, allow_nan=False),
    st.lists(st.floats(min_value=0, max_value=10, allow_nan=False), min_size=2, max_size=50),
)
def test_latency_minus_ttft_equals_sum_of_itl_when_done_with_last_chunk(t_sent: float, gaps: list[float]) -> None:
    first = t_sent + 0.5
    chunks = [first]
    for gap in gaps:
        chunks.append(chunks[-1] + gap)
    r = _rec(0, t_sent, chunks)
    ttft, latency = ttft_s(r), latency_s(r)
    assert ttft is not None and latency is not None
    assert math.isclose(latency - ttft, sum(itls_s(r)), rel_tol=1e-9, abs_tol=1e-6)
    assert len(itls_s(r)) == len(chunks) - 1


def test_per_request_formulas_on_scripted_times() -> None:
    # sent at 10, first token at 10.5, chunks every 0.1 s, 4 chunks carrying 7 tokens, done at 11.0
    r = _rec(0, 10.0, [10.5, 10.6, 10.7, 10.8], tokens=7, t_done=11.0, counts=[1, 3, 5, 7])
    assert ttft_s(r) == pytest.approx(0.5)
    assert latency_s(r) == pytest.approx(1.0)
    assert itls_s(r) == pytest.approx([0.1, 0.1, 0.1])
    assert tpot_s(r) == pytest.approx((1.0 - 0.5) / 6)
    assert decode_tok_s(r) == pytest.approx(6 / 0.3)
    assert per_token_latencies_s(r) == pytest.approx([0.05] * 6)  # each 0.1 s gap carried 2 tokens: once per token


def test_tokens_without_text_at_both_ends_get_the_true_rate_from_counts() -> None:
    # 10 tokens at 1.0, 1.1, ..., 1.9; tokens 1, 2 and 10 spell nothing: text chunks at 1.2 .. 1.8 only.
    # Text-chunk timing would give TTFT 0.2 s late and (10 - 1) / 0.6 = 15 tok/s: 35% high.
    times = [1.0 + 0.1 * k for k in range(10)]
    r = RequestRecord(
        "c1", 0, False, False, "p", "short", 10, 0.0, times[0], 2.0, chunk_times_s=times[2:9],
        output_tokens=10, streamed_chunks=7, ok=True, chunk_reads=list(range(2, 9)),
        count_times_s=[*times, 1.95], count_tokens=[*range(1, 11), 10], count_reads=list(range(11)),
        t_first_text_s=times[2],
    )  # fmt: skip
    assert ttft_s(r) == pytest.approx(1.0) and ttft_text_s(r) == pytest.approx(1.2)
    assert decode_tok_s(r) == pytest.approx(9 / 0.9)  # the repeated final count adds no token
    assert token_timeline(r).source == "counts" and untimed_reason(r) is None
    assert sum(itls_s(r)) == pytest.approx(0.9) and len(per_token_latencies_s(r)) == 9


def test_no_counts_and_more_tokens_than_text_chunks_is_untimed_with_the_reason() -> None:
    r = _rec(0, 0.0, [0.2, 0.3, 0.4], tokens=5)  # 5 tokens, 3 text chunks, no per-chunk counts
    assert token_timeline(r) is None
    assert decode_tok_s(r) is None and ttft_s(r) is None and itls_s(r) == [] and tpot_s(r) is None
    assert untimed_reason(r) == (
        "the engine sent no per-chunk token counts and usage says 5 tokens over 3 text chunks: "
        "when each token came is unknown"
    )
    assert ttft_text_s(r) == pytest.approx(0.2)  # visible text still timed, under its own name
    timed = _rec(1, 0.0, [0.2, 0.3, 0.4])  # one token per text chunk: the text chunks are the tokens
    cell = summarize([r, timed], base=_base())
    assert cell.status == "ok" and cell.untimed_requests == 1 and cell.decode_tok_s_p50 == pytest.approx(10.0)
    assert cell.extras["untimed_flag"].startswith("1 warm requests have no token timing")
    assert cell.decode_agg_tok_s is None  # a partial sum would understate it
    alone = summarize([r, _rec(1, 0.0, [0.1, 0.5], tokens=4)], base=_base())
    assert alone.status == "invalid" and alone.decode_tok_s_p50 is None
    assert "no request has a token timeline to compute decode tok/s (the engine sent no per-chunk" in alone.reason


def test_a_text_chunk_without_a_count_among_counted_ones_makes_the_counts_incomplete() -> None:
    r = _rec(0, 0.0, [0.2, 0.3, 0.4], tokens=5, counts=[2, 4, 5])
    r.uncounted_chunks = 1
    assert token_timeline(r) is None and untimed_reason(r).startswith("1 text chunks carried no token count")


def test_decode_aggregate_is_tokens_after_each_first_over_the_union_of_decode_intervals() -> None:
    # Two streams decoding [1, 2] and [1.5, 3] (union 2 s) and one [5, 6] (1 s): 3 s of decoding.
    a = _rec(0, 0.0, [1.0 + 0.25 * k for k in range(5)])  # 4 tokens after the first over [1, 2]
    b = _rec(1, 0.0, [1.5 + 0.5 * k for k in range(4)], tokens=7, counts=[2, 4, 6, 7])  # 5 after f=2
    c = _rec(2, 4.0, [5.0, 6.0])  # 1 after the first
    cell = summarize([a, b, c], base=_base())
    assert cell.decode_window_s == pytest.approx(3.0)
    assert cell.decode_agg_tok_s == pytest.approx((4 + 5 + 1) / 3.0)
    assert cell.output_tok_s == pytest.approx((5 + 7 + 2) / 6.0)  # its window includes the time to token 1
    one = summarize([a], base=_base())
    assert one.decode_agg_tok_s == pytest.approx(decode_tok_s(a))  # one stream: its own decode rate


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 100), st.floats(0, 10)), min_size=1, max_size=20))
def test_union_measure_is_at_most_the_sum_and_at_least_the_longest(spans: list[tuple[float, float]]) -> None:
    intervals = [(a, a + d) for a, d in spans]
    total = union_s(intervals)
    assert max(d for _, d in spans) - 1e-9 <= total <= sum(d for _, d in spans) + 1e-9
    assert total <= max(b for _, b in intervals) - min(a for a, _ in intervals) + 1e-9


def test_single_token_or_single_chunk_has_no_decode_rate() -> None:
    assert decode_tok_s(_rec(0, 0.0, [1.0], tokens=1)) is None
    assert tpot_s(_rec(0, 0.0, [1.0], tokens=1)) is None
    assert decode_tok_s(_rec(0, 0.0, [1.0], tokens=5)) is None  # all tokens in one chunk


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.floats(min_value=-1e6, max_value=1e6, allow_nan=False), min_size=1, max_size=60),
    st.floats(min_value=0, max_value=100),
)
def test_percentile_matches_numpy_linear(values: list[float], q: float) -> None:
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-9, abs=1e-6)


def test_percentile_of_nothing_is_none() -> None:
    assert percentile([], 50) is None


def test_percentile_against_cases_worked_by_hand() -> None:
    # rank = (n - 1) q / 100 between order statistics: [1, 2, 3, 4] at 90 -> rank 2.7 -> 3 + 0.7 x (4 - 3)
    assert percentile([4.0, 1.0, 3.0, 2.0], 90) == pytest.approx(3.7)
    assert percentile([10.0, 20.0], 25) == pytest.approx(12.5)  # rank 0.25
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0 and percentile([7.0], 99) == 7.0
    assert percentile(iter([0.2, 0.1]), 100) == 0.2  # any iterable, once
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_summarize_happy_path_numbers() -> None:
    records = [
        _rec(0, 0.0, [0.2, 0.3, 0.4], tokens=3),  # TTFT 0.2
        _rec(1, 0.0, [0.4, 0.6, 0.8, 1.0], tokens=4),  # TTFT 0.4, done at 1.0
    ]
    cell = summarize(records, base=_base())
    assert cell.status == "ok" and cell.reason is None
    assert cell.num_requests == 2 and cell.num_errors == 0 and cell.error_rate == 0
    assert cell.ttft_p50_s == pytest.approx(0.3)
    assert cell.window_s == pytest.approx(1.0)
    assert cell.output_tokens_total == 7
    assert cell.output_tok_s == pytest.approx(7.0)
    assert cell.request_s == pytest.approx(2.0)
    assert cell.itl_p50_s == pytest.approx(0.2)  # gaps pooled: 0.1, 0.1, 0.2, 0.2, 0.2
    assert cell.decode_tok_s_p50 == pytest.approx(float(np.percentile([2 / 0.2, 3 / 0.6], 50)))
    assert cell.prompt_tokens_mean == 10
    assert cell.cold_ttft_s is None


def test_warmup_is_excluded_from_every_metric() -> None:
    measured = [_rec(1, 5.0, [5.2, 5.3], tokens=2), _rec(2, 5.0, [5.2, 5.4], tokens=2)]
    warmup = _rec(0, 0.0, [4.0, 4.9], tokens=50, warmup=True)
    with_warmup = summarize([warmup, *measured], base=_base())
    without = summarize(measured, base=_base())
    assert with_warmup.to_row() == without.to_row()
    assert with_warmup.num_requests == 2


def test_cold_request_reported_apart_from_warm_ttft() -> None:
    cold = _rec(0, 0.0, [3.0, 3.1], tokens=2, cold=True)
    warm = [_rec(1, 3.2, [3.3, 3.4], tokens=2), _rec(2, 3.2, [3.3, 3.5], tokens=2)]
    cell = summarize([cold, *warm], base=_base())
    assert cell.cold_ttft_s == pytest.approx(3.0)
    assert cell.ttft_p99_s == pytest.approx(0.1)  # the cold 3 s never enters the warm distribution
    assert cell.num_requests == 3  # still a measured request: counted in throughput
    assert cell.output_tokens_total == 6


def test_cold_warmup_request_still_gives_cold_ttft() -> None:
    cold = _rec(0, 0.0, [2.0, 2.1], cold=True, warmup=True)
    cell = summarize([cold, _rec(1, 3.0, [3.1, 3.2])], base=_base())
    assert cell.cold_ttft_s == pytest.approx(2.0)
    assert cell.num_requests == 1


def test_stream_with_no_tokens_is_a_failure_and_invalidates() -> None:
    failed = _rec(1, 0.0, [], ok=False, tokens=None)
    failed.output_tokens = None
    cell = summarize([_rec(0, 0.0, [0.1, 0.2]), failed], base=_base())
    assert cell.num_errors == 1 and cell.error_rate == pytest.approx(0.5)
    assert cell.status == "invalid" and "error rate" in (cell.reason or "")
    assert cell.output_tokens_total == 2  # the failure is not counted as tokens
    allowed = summarize([_rec(0, 0.0, [0.1, 0.2]), failed], base=_base(), max_error_rate=0.5)
    assert allowed.status == "ok"


def test_no_successful_requests_gives_none_never_zero() -> None:
    failed = [_rec(i, 0.0, [], ok=False, tokens=None) for i in range(3)]
    cell = summarize(failed, base=_base())
    assert cell.status == "invalid" and "no successful requests" in (cell.reason or "")
    for name in ("ttft_p50_s", "itl_p50_s", "tpot_p50_s", "decode_tok_s_p50", "output_tok_s", "request_s"):
        assert getattr(cell, name) is None, name
    assert cell.error_rate == 1.0


def test_single_output_token_everywhere_is_invalid_with_reason() -> None:
    cell = summarize([_rec(0, 0.0, [0.1], tokens=1), _rec(1, 0.0, [0.2], tokens=1)], base=_base())
    assert cell.status == "invalid"
    assert "output_tokens <= 1 for all requests" in (cell.reason or "")
    assert cell.decode_tok_s_p50 is None


def test_missing_usage_leaves_throughput_unknown() -> None:
    r = _rec(0, 0.0, [0.1, 0.2, 0.3])
    r.output_tokens = None
    cell = summarize([r, _rec(1, 0.0, [0.1, 0.2])], base=_base())
    assert cell.output_tok_s is None and cell.output_tokens_total is None
    assert cell.status == "invalid" and "usage missing" in (cell.reason or "")


def test_failed_base_stays_failed() -> None:
    cell = summarize([_rec(0, 0.0, [0.1, 0.2])], base=_base(status="failed"))
    assert cell.status == "failed"


PROM = """
# HELP paged_experts:expert_hits_total Hits.
# TYPE paged_experts:expert_hits_total counter
paged_experts:expert_hits_total 900
paged_experts:expert_misses_total{layer="0"} 40
paged_experts:expert_misses_total{layer="1"} 60
paged_experts:expert_activations_total 1000
paged_experts:bytes_paged_total 2.5e9
paged_experts:bytes_h2d_total 3e9
paged_experts:waves_total 300
paged_experts:moe_steps_total 200
paged_experts:union_experts_total 5000
paged_experts:generation_tokens_total 100
paged_experts:experts_prefetched_total 40
paged_experts:experts_prefetch_used_total 30
sglang:time_to_first_token_seconds_bucket{le="+Inf",model_name="m"} 12
sglang:time_to_first_token_seconds_sum{model_name="m"} 3.5
sglang:time_to_first_token_seconds_count{model_name="m"} 12
weird_value NaN
"""


def test_parse_prometheus() -> None:
    samples = parse_prometheus(PROM)
    assert samples["paged_experts:expert_hits_total"] == 900
    assert samples['paged_experts:expert_misses_total{layer="1"}'] == 60
    assert samples["paged_experts:bytes_paged_total"] == 2.5e9
    assert samples['sglang:time_to_first_token_seconds_bucket{le="+Inf",model_name="m"}'] == 12
    assert samples['sglang:time_to_first_token_seconds_sum{model_name="m"}'] == 3.5
    assert math.isnan(samples["weird_value"])
    assert not any(k.startswith("#") for k in samples)


def test_text_that_is_not_the_exposition_format_is_refused_not_half_read() -> None:
    with pytest.raises(ValueError):
        parse_prometheus(PROM + "paged_experts:expert_hits_total not-a-number\n")
    escaped = parse_prometheus('m{path="a\\"b"} 1\n')
    assert escaped == {'m{path="a\\"b"}': 1.0}  # label values keep their escapes in the key


def test_paging_delta_maps_counter_deltas_to_cell_fields() -> None:
    after = parse_prometheus(PROM)
    before = {k: 0.0 for k in after}
    before["paged_experts:expert_hits_total"] = 100
    delta = paging_delta(before, after)
    assert delta["expert_hits"] == 800
    assert delta["expert_misses"] == 100  # labelled series summed
    assert delta["miss_rate"] == pytest.approx(100 / 900)
    assert delta["bytes_paged"] == 2_500_000_000
    assert delta["bytes_paged_per_token"] == pytest.approx(2.5e9 / 100)
    assert delta["bytes_h2d_per_token"] == pytest.approx(3e9 / 100)  # offload's streaming counts here too
    assert delta["waves_per_step"] == pytest.approx(1.5)
    assert delta["union_mean"] == pytest.approx(25.0)
    assert delta["experts_prefetched"] == 40 and delta["prefetch_accuracy"] == pytest.approx(0.75)
    assert set(delta) <= set(CellResult.__dataclass_fields__)
    assert delta["prefill_chunks"] is None and delta["prefill_bytes_per_chunk"] is None  # no prefill series scraped


def test_paging_delta_prefill_fields() -> None:
    p = "paged_experts:"
    before = {p + "expert_hits_total": 0.0, p + "expert_misses_total": 0.0, p + "prefill_chunks_total": 1.0,
              p + "prefill_layer_steps_total": 48.0, p + "prefill_expert_hits_total": 10.0,
              p + "prefill_expert_misses_total": 90.0, p + "prefill_bytes_paged_total": 1e9,
              p + "prefill_copy_seconds_total": 0.02, p + "prefill_span_seconds_total": 0.03,
              p + "prefill_waves_total": 300.0, p + "prefill_router_seconds_total": 1.0,
              p + "prefill_staged_unused_total": 4.0, p + "prefill_idle_before_layer_seconds_total": 0.01,
              p + "prefill_idle_between_waves_seconds_total": 0.002, p + "gc_pause_seconds_total": 0.5,
              p + "gc_full_collections_total": 3.0, p + "prefill_host_wait_seconds_total": 0.1,
              p + "prefill_host_plan_seconds_total": 0.2}  # fmt: skip
    after = {p + "expert_hits_total": 1000.0, p + "expert_misses_total": 5000.0, p + "prefill_chunks_total": 3.0,
             p + "prefill_layer_steps_total": 144.0, p + "prefill_expert_hits_total": 110.0,
             p + "prefill_expert_misses_total": 4890.0, p + "prefill_bytes_paged_total": 9.2e9,
             p + "prefill_copy_seconds_total": 0.32, p + "prefill_span_seconds_total": 0.43,
             p + "prefill_waves_total": 900.0, p + "prefill_router_seconds_total": 1.5,
             p + "prefill_staged_unused_total": 52.0, p + "prefill_idle_before_layer_seconds_total": 0.298,
             p + "prefill_idle_between_waves_seconds_total": 0.05, p + "gc_pause_seconds_total": 0.625,
             p + "gc_full_collections_total": 5.0, p + "prefill_host_wait_seconds_total": 0.196,
             p + "prefill_host_plan_seconds_total": 0.872}  # fmt: skip
    delta = paging_delta(before, after)
    assert delta["prefill_chunks"] == 2
    assert delta["prefill_bytes_per_chunk"] == pytest.approx(4.1e9)
    assert delta["prefill_router_s_per_chunk"] == pytest.approx(0.25)
    assert delta["prefill_copy_s_per_chunk"] == pytest.approx(0.15)
    assert delta["prefill_span_s_per_chunk"] == pytest.approx(0.2)
    assert delta["prefill_copy_busy"] == pytest.approx(0.75) and delta["prefill_waves_per_layer"] == pytest.approx(6.25)
    assert delta["prefill_staged_unused_per_layer"] == pytest.approx(0.5)  # 48 over 96 layer-steps
    assert delta["prefill_idle_before_layer_s"] == pytest.approx(0.003)  # 0.288 s over 96 layer-steps
    assert delta["prefill_idle_between_waves_s"] == pytest.approx(0.0005)  # 0.048 s over 96
    assert delta["prefill_host_wait_s"] == pytest.approx(0.001)  # 0.096 s over 96 layer-steps
    assert delta["prefill_host_plan_s"] == pytest.approx(0.007)  # 0.672 s over 96
    assert delta["gc_pause_s"] == pytest.approx(0.125) and delta["gc_full_collections"] == 2
    # decode: 900 hits and 200 misses outside the prefill steps
    assert delta["decode_miss_rate"] == pytest.approx(200 / 1100)
    assert delta["experts_prefetched"] is None and delta["prefetch_accuracy"] is None  # no prefetch series scraped
    assert delta["decode_bytes_per_token"] is None  # no bytes_paged or decode tokens scraped
    more = {p + "bytes_paged_total": 2e9, p + "engine_decode_tokens_total": 0.0}
    done = {p + "bytes_paged_total": 13.2e9, p + "engine_decode_tokens_total": 40.0}
    delta = paging_delta({**before, **more}, {**after, **done})
    # 11.2 GB paged, 8.2 GB of it in prefill steps: 3 GB over 40 decode tokens (a step's tokens share
    # experts, so not decode_miss_rate x top_k x layers x expert bytes)
    assert delta["decode_bytes_per_token"] == pytest.approx(3e9 / 40)
    assert set(delta) <= set(CellResult.__dataclass_fields__)


def test_paging_delta_missing_or_reset_counters_are_none() -> None:
    assert all(v is None for v in paging_delta({}, {}).values())
    before = {"paged_experts:expert_hits_total": 50.0, "paged_experts:expert_misses_total": 5.0}
    after = {"paged_experts:expert_hits_total": 10.0, "paged_experts:expert_misses_total": 8.0}
    delta = paging_delta(before, after)
    assert delta["expert_hits"] is None  # went down: the server restarted
    assert delta["expert_misses"] == 3
    assert delta["miss_rate"] is None


def test_every_filled_metric_field_has_a_definition() -> None:
    before = _base()
    after = summarize([_rec(0, 0.0, [0.1, 0.2, 0.3]), _rec(1, 0.0, [0.2, 0.3])], base=before)
    filled = {k for k, v in after.to_row().items() if v != before.to_row()[k]} - {
        "status",
        "reason",
        "extras",
    }  # extras: flags, not metrics
    paging = set(paging_delta({}, {})) - {"expert_activations", "expert_hits", "expert_misses", "bytes_paged"}
    assert filled | paging <= set(DEFINITIONS)
    assert set(DEFINITIONS) <= set(CellResult.__dataclass_fields__)


def test_a_request_whose_token_1_was_read_with_others_is_client_bound_and_not_cross_checked() -> None:
    from benchsuite.measure.metrics import CLIENT_JITTER_S, ENGINE_TIMINGS_MARGIN, client_bound, engine_tolerance

    times = [1.0 + 0.1 * k for k in range(21)]  # 21 tokens, 100 ms apart: 10 tok/s
    late_start = _rec(0, 0.0, times, counts=list(range(1, 22)))
    late_start.count_reads = [0, 0, 0, *range(1, 19)]  # token 1 read with tokens 2 and 3: 2 of 20 gaps > 5%
    middle = _rec(1, 0.0, times, counts=list(range(1, 22)))
    middle.count_reads = [0, 1, 2, 3, 3, 3, 3, 3, *range(4, 17)]  # coalesced in the middle only: the span holds
    assert client_bound(late_start) and not client_bound(middle)
    for r in (late_start, middle):
        r.engine_timings = {"predicted_n": 21, "predicted_ms": 2000.0, "predicted_per_second": 10.0}
    assert engine_tolerance(middle) == pytest.approx(ENGINE_TIMINGS_MARGIN + CLIENT_JITTER_S / 2.0)
    cell = summarize([late_start, middle], base=_base())
    assert cell.client_bound_requests == 1 and cell.engine_timings_checked == 1 and cell.engine_timings_outside == 0
    short = _rec(2, 0.0, [1.0, 1.02, 1.04], counts=[1, 2, 3])  # a 40 ms span: the jitter allowance dominates
    short.engine_timings = {"predicted_n": 3, "predicted_ms": 50.0, "predicted_per_second": 40.0}  # ours 50: +25%
    assert engine_tolerance(short) == pytest.approx(ENGINE_TIMINGS_MARGIN + CLIENT_JITTER_S / 0.05)
    assert summarize([short, middle], base=_base()).engine_timings_outside == 0


def test_streams_read_mostly_whole_hand_the_p50_to_the_engines_own_figure() -> None:
    # llama-server at ~2,000 tok/s on a busy machine: token 1 read with 8 of the next 9 tokens, then the rest
    times = [1.0 + 0.001 * k for k in range(11)]
    records = []
    for i in range(3):
        r = _rec(i, 0.0, times, counts=list(range(1, 12)))
        r.count_reads = [0] * 9 + [1, 1]  # ours: 10 tokens over 10 ms of parse time
        r.engine_timings = {"predicted_n": 11, "predicted_ms": 50.0, "predicted_per_second": 200.0}
        records.append(r)
    cell = summarize(records, base=_base())
    assert cell.whole_stream_reads == 0 and cell.client_bound_requests == 3 and cell.engine_timings_checked == 0
    assert cell.decode_tok_s_p50 == 200.0 and cell.extras["decode_source"].startswith("engine timings (3 of 3")
    assert "client_flag" in cell.extras


def test_a_first_point_that_carried_two_tokens_is_counted_as_a_late_ttft() -> None:
    # Token 1 was half a UTF-8 character: the engine sent nothing until token 2 completed it, one chunk
    # with count 2. TTFT is then to token 2, late by up to one decode step: counted, not silent.
    on_time = _rec(1, 0.0, [0.5, 0.6, 0.7], counts=[1, 2, 3])
    late = _rec(2, 1.0, [1.6, 1.7], tokens=3, counts=[2, 3])
    cell = summarize([on_time, late], base=_base())
    assert cell.ttft_late_requests == 1
    assert summarize([on_time], base=_base()).ttft_late_requests == 0
