"""The load generator against the scripted fake server on loopback: timings, usage, failures,
warmup/cold handling and schedules."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from typing import Any

import pytest

from benchsuite.errors import UserError
from benchsuite.load.loadgen import LoadSpec, poisson_arrivals_s, run_load
from benchsuite.load.stream_client import endpoint_url
from benchsuite.measure.metrics import itls_s, latency_s, ttft_s
from benchsuite.records import CellResult, LoadRequest, RequestRecord

try:  # tests/ as a package or as a plain directory on sys.path (pytest's default prepend mode)
    from fakes import FakeServer, Script
except ImportError:
    from fakes import FakeServer, Script  # type: ignore[no-redef]


def _requests(n: int, max_tokens: int = 5, chat: bool = False) -> list[LoadRequest]:
    return [LoadRequest(f"p{i}", "short", f"prompt number {i}", max_tokens, chat) for i in range(n)]


async def _run(
    script: Script | Callable[[dict[str, Any], int], Script],
    requests: list[LoadRequest],
    spec: LoadSpec | None = None,
    *,
    cold_first: bool = False,
    extras: dict[str, Any] | None = None,
    **kwargs: Any,
) -> tuple[list[RequestRecord], FakeServer]:
    async with FakeServer(script) as server:
        records = await run_load(
            server.url,
            requests,
            spec or LoadSpec(concurrency=2),
            cell_id="cell",
            model_name="fake-model",
            extras=extras or {},
            cold_first=cold_first,
            **kwargs,
        )
    return records, server


async def test_completions_stream_records_every_chunk_and_usage() -> None:
    records, server = await _run(Script(itl_s=0.002, prompt_tokens=17), _requests(4), extras={"cache_prompt": False})
    assert [r.request_index for r in records] == [0, 1, 2, 3]
    for r in records:
        assert r.ok and r.error is None and r.http_status == 200
        assert r.output_tokens == 5 and r.prompt_tokens == 17 and r.streamed_chunks == 5
        assert not r.usage_mismatch and not r.warmup and not r.cold
        assert r.output_text == " tok" * 5
        assert r.t_first_token_s is not None and r.t_done_s is not None
        times = [r.t_sent_s, *r.chunk_times_s, r.t_done_s]
        assert times == sorted(times) and r.t_sent_s < r.t_first_token_s
    body = server.bodies[0]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert body["temperature"] == 0 and body["ignore_eos"] is True and body["max_tokens"] == 5
    assert body["model"] == "fake-model" and body["cache_prompt"] is False
    assert body["prompt"].startswith("prompt number")


async def test_scripted_clock_pins_latency_minus_ttft_equals_sum_itl() -> None:
    # A counter clock: every reading is the next integer, so times are exact.
    counter = itertools.count()
    records, _ = await _run(
        Script(itl_s=0.01), _requests(1, max_tokens=4), LoadSpec(concurrency=1), clock=lambda: float(next(counter))
    )
    (r,) = records
    assert r.ok and len(r.chunk_times_s) == 4
    # the last token, the finish chunk, usage and [DONE] arrive in one read, and each event gets its own reading
    assert r.t_done_s == r.chunk_times_s[-1] + 3
    assert latency_s(r) - ttft_s(r) == sum(itls_s(r)) + (r.t_done_s - r.chunk_times_s[-1])  # type: ignore[operator]
    assert all(gap >= 1 for gap in itls_s(r))


async def test_chat_ttft_ignores_role_only_chunk() -> None:
    records, server = await _run(Script(ttft_s=0.05), _requests(1, chat=True), LoadSpec(concurrency=1))
    (r,) = records
    assert r.ok and r.streamed_chunks == 5
    assert ttft_s(r) >= 0.045  # the role-only chunk came at once; TTFT waits for text
    assert server.bodies[0]["messages"] == [{"role": "user", "content": "prompt number 0"}]
    assert "prompt" not in server.bodies[0]


async def test_token_id_prompts_are_sent_as_lists() -> None:
    request = LoadRequest("ids", "2048", (5, 6, 7), 3)
    records, server = await _run(Script(), [request])
    assert server.bodies[0]["prompt"] == [5, 6, 7]
    assert records[0].prompt_tokens == 3


async def test_partial_lines_and_crlf_are_reassembled() -> None:
    records, _ = await _run(Script(split_bytes=7, crlf=True, role_chunk=True), _requests(2, max_tokens=3))
    assert all(r.ok and r.streamed_chunks == 3 and r.output_tokens == 3 for r in records)


async def test_several_tokens_per_chunk_is_not_a_mismatch() -> None:
    records, _ = await _run(Script(tokens_per_chunk=4), _requests(1, max_tokens=10))
    (r,) = records
    assert r.ok and r.streamed_chunks == 3 and r.output_tokens == 10 and not r.usage_mismatch


async def test_more_chunks_than_usage_tokens_is_a_mismatch() -> None:
    records, _ = await _run(Script(usage_completion_tokens=2), _requests(1))
    (r,) = records
    assert r.ok and r.usage_mismatch and r.output_tokens == 2 and r.streamed_chunks == 5


async def test_missing_usage_is_a_mismatch_and_never_guessed_from_max_tokens() -> None:
    records, _ = await _run(Script(usage=False), _requests(1))
    (r,) = records
    assert r.ok and r.usage_mismatch and r.output_tokens is None and r.prompt_tokens is None


async def test_llamacpp_timings_are_captured() -> None:
    timings = {"prompt_n": 4, "predicted_n": 5, "predicted_per_second": 41.5}
    records, _ = await _run(Script(timings=timings), _requests(1))
    assert records[0].engine_timings == timings


@pytest.mark.parametrize(
    "script, reason",
    [
        (Script(status=503), 'HTTP 503: {"error": {"message": "scripted failure"}}'),
        (Script(reset_after_chunks=2), "connection:"),
        (Script(output_tokens=0), "stream produced no tokens"),
        (Script(error_event_after_chunks=1), "server error event:"),
        (Script(done=False, finish=False), "connection: stream ended without [DONE]"),
        (Script(hang_after_chunks=1), "timeout after 0.5 s"),
        (Script(inject_after_first_chunk='{"choices": [null]}'), "bad SSE payload:"),
        (Script(inject_after_first_chunk="not json"), "bad SSE payload: not json"),
        (Script(inject_after_first_chunk='{"choices": [{"text": 7}]}'), "bad SSE payload:"),
        (Script(inject_after_first_chunk='{"choices": [], "usage": {"completion_tokens": "5"}}'), "bad SSE payload:"),
    ],
)
async def test_failures_are_recorded_with_reason_never_dropped(script: Script, reason: str) -> None:
    records, _ = await _run(script, _requests(2), LoadSpec(concurrency=2, timeout_s=0.5))
    assert len(records) == 2
    for r in records:
        assert not r.ok and r.error is not None and r.error.startswith(reason), r.error
        assert r.t_done_s is not None and r.t_done_s >= r.t_sent_s


async def test_unreachable_server_is_a_connection_failure() -> None:
    from benchsuite.run.process import free_port

    records = await run_load(
        f"http://127.0.0.1:{free_port()}",
        _requests(2),
        LoadSpec(concurrency=1),
        cell_id="c",
        model_name="m",
        extras={},
        cold_first=False,
    )
    assert [r.ok for r in records] == [False, False]
    assert all((r.error or "").startswith("connection:") and r.http_status is None for r in records)


async def test_only_some_requests_fail() -> None:
    def script(body: dict[str, Any], arrival: int) -> Script:
        return Script(status=500) if arrival == 1 else Script()

    records, _ = await _run(script, _requests(3), LoadSpec(concurrency=1))
    assert [r.ok for r in records] == [True, False, True]
    assert records[1].http_status == 500


async def test_warmup_first_cold_alone_then_measured() -> None:
    seen: list[RequestRecord] = []
    records, _ = await _run(
        Script(itl_s=0.002),
        _requests(6),
        LoadSpec(concurrency=3, warmup=2),
        cold_first=True,
        progress=seen.append,
    )
    assert len(records) == 8 and len(seen) == 8
    assert [r.warmup for r in records] == [True, True] + [False] * 6
    assert [r.cold for r in records] == [True] + [False] * 7
    cold, warmups, measured = records[0], records[:2], records[2:]
    assert all(cold.t_done_s <= r.t_sent_s for r in records[1:])  # type: ignore[operator]
    assert max(r.t_done_s for r in warmups) <= min(r.t_sent_s for r in measured)  # type: ignore[type-var]
    assert [r.prompt_id for r in measured] == [f"p{i}" for i in range(6)]


async def test_cold_without_warmup_is_the_first_measured_request() -> None:
    records, _ = await _run(Script(), _requests(3), LoadSpec(concurrency=2), cold_first=True)
    assert [(r.cold, r.warmup) for r in records] == [(True, False), (False, False), (False, False)]


def _max_overlap(records: list[RequestRecord]) -> int:
    events = sorted([(r.t_sent_s, 1) for r in records] + [(r.t_done_s, -1) for r in records])  # type: ignore[misc]
    depth = peak = 0
    for _, step in events:
        depth += step
        peak = max(peak, depth)
    return peak


async def test_closed_loop_keeps_exactly_concurrency_in_flight() -> None:
    records, _ = await _run(Script(itl_s=0.005), _requests(9, max_tokens=4), LoadSpec(concurrency=3))
    assert all(r.ok for r in records)
    assert _max_overlap(records) == 3


def test_poisson_arrivals_are_seeded_with_mean_gap_one_over_rate() -> None:
    a = poisson_arrivals_s(2000, rate_rps=50.0, seed=7)
    assert a == poisson_arrivals_s(2000, rate_rps=50.0, seed=7)
    assert a != poisson_arrivals_s(2000, rate_rps=50.0, seed=8)
    assert a == sorted(a)
    assert a[-1] / len(a) == pytest.approx(1 / 50.0, rel=0.1)


async def test_poisson_sends_no_earlier_than_schedule_and_caps_in_flight() -> None:
    loop = asyncio.get_running_loop()
    spec = LoadSpec(concurrency=2, arrival="poisson", rate_rps=200.0, seed=3)
    async with FakeServer(Script(itl_s=0.004)) as server:
        before_s = loop.time()  # the schedule starts no earlier than this (same clock as t_sent)
        records = await run_load(
            server.url,
            _requests(12, max_tokens=3),
            spec,
            cell_id="c",
            model_name="m",
            extras={},
            cold_first=False,
            clock=loop.time,
        )
    assert all(r.ok for r in records) and len(records) == 12
    schedule = poisson_arrivals_s(12, rate_rps=200.0, seed=3)
    for r, planned_s in zip(records, schedule, strict=True):
        assert r.t_sent_s >= before_s + planned_s - 1e-3
    assert _max_overlap(records) <= 2


def test_spec_and_request_validation() -> None:
    with pytest.raises(UserError):
        LoadSpec(concurrency=0)
    with pytest.raises(UserError):
        LoadSpec(concurrency=1, arrival="poisson")
    with pytest.raises(UserError):
        LoadRequest("x", "short", [1, 2], 4, chat=True)
    with pytest.raises(UserError):
        LoadRequest("x", "short", "hi", 0)


def test_endpoint_url_accepts_root_or_v1() -> None:
    assert endpoint_url("http://h:1", chat=False) == "http://h:1/v1/completions"
    assert endpoint_url("http://h:1/v1/", chat=True) == "http://h:1/v1/chat/completions"


async def test_events_of_one_read_are_timed_one_by_one_and_the_request_still_counts() -> None:
    from benchsuite.measure.metrics import decode_tok_s, summarize, whole_stream

    # One stream in four arrives whole in one read: one timestamp per read made its decode span 0 and
    # dropped it from decode p50 (the fastest request vanished; when all did, the cell went invalid).
    def script(body: dict[str, Any], arrival: int) -> Script:
        return Script(one_write=True, itl_s=0.002) if arrival == 0 else Script(itl_s=0.03)  # paced: read one by one

    records, _ = await _run(script, _requests(4, max_tokens=8), LoadSpec(concurrency=1))
    whole = [r for r in records if whole_stream(r)]
    assert len(whole) == 1 and len(set(whole[0].chunk_reads)) == 1
    assert all(b > a for a, b in itertools.pairwise(whole[0].chunk_times_s))  # parse order, no exact-zero gaps
    rates = {r.request_index: decode_tok_s(r) for r in records}
    assert None not in rates.values() and rates[whole[0].request_index] == max(
        rates.values()
    )  # counted, ranked fastest
    base = CellResult("c", "r", "e", "builtin", "m", "s", {}, "w", "short", 1, 0, "ok")
    cell = summarize(records, base=base)
    assert cell.status == "ok" and cell.extras["decode_source"] == "client" and cell.whole_stream_reads == 1
    assert cell.decode_tok_s_p50 == pytest.approx(sorted(rates.values())[1] / 2 + sorted(rates.values())[2] / 2)
    # the whole stream's 7 gaps at least (a busy machine may coalesce a paced gap too)
    assert cell.coalesced_gaps >= 7 and cell.extras["client_flag"].startswith(
        f"client could not keep up: {cell.coalesced_gaps} of 28 timeline gaps"
    )


async def test_streams_that_all_arrive_whole_take_the_engines_own_decode_rate_or_a_lower_bound() -> None:
    from benchsuite.measure.metrics import summarize

    base = CellResult("c", "r", "e", "builtin", "m", "s", {}, "w", "short", 1, 0, "ok")
    bare, _ = await _run(Script(one_write=True, itl_s=0.002), _requests(3, max_tokens=8), LoadSpec(concurrency=1))
    cell = summarize(bare, base=base)
    bounds = sorted(7 / (r.chunk_times_s[-1] - r.t_sent_s) for r in bare)  # 8 tokens, the first one excluded
    assert cell.status == "ok" and cell.decode_tok_s_p50 == pytest.approx(bounds[1])
    assert cell.decode_tok_s_p50 < 7 / 0.014  # the server took >= 7 x 2 ms: a lower bound, never the parse time
    assert cell.extras["decode_source"].startswith("client lower bound (3 of 3 streams arrived (mostly) whole")
    timed, _ = await _run(
        Script(one_write=True, itl_s=0.002, timings={"predicted_per_second": 480.0}),
        _requests(3, max_tokens=8),
        LoadSpec(concurrency=1),
    )
    cell = summarize(timed, base=base)
    assert cell.status == "ok" and cell.decode_tok_s_p50 == 480.0 == cell.timings_decode_tok_s_p50
    assert cell.extras["decode_source"].startswith("engine timings (3 of 3 streams arrived (mostly) whole")


async def test_a_paced_stream_is_read_chunk_by_chunk_and_not_flagged() -> None:
    from benchsuite.measure.metrics import summarize

    records, _ = await _run(Script(itl_s=0.01), _requests(3, max_tokens=6), LoadSpec(concurrency=1))
    assert all(len(set(r.chunk_reads)) == 6 for r in records)
    cell = summarize(records, base=CellResult("c", "r", "e", "builtin", "m", "s", {}, "w", "short", 1, 0, "ok"))
    assert cell.coalesced_gaps == 0 and "client_flag" not in cell.extras and cell.tokens_per_chunk_mean == 1.0


async def test_per_chunk_usage_counts_the_first_chunk_and_per_token_latency() -> None:
    from benchsuite.measure.metrics import decode_tok_s, first_chunk_tokens, per_token_latencies_s, tokens_per_chunk

    records, _ = await _run(
        Script(itl_s=0.01, tokens_per_chunk=3, usage_per_chunk=True),
        _requests(1, max_tokens=12),
        LoadSpec(concurrency=1),
    )
    (r,) = records
    assert r.chunk_tokens == [3, 6, 9, 12] and first_chunk_tokens(r) == 3 and tokens_per_chunk(r) == 3.0
    span = r.chunk_times_s[-1] - r.chunk_times_s[0]
    assert decode_tok_s(r) == pytest.approx(9 / span)  # not (12 - 1) / span: the first chunk held 3 tokens
    assert per_token_latencies_s(r) == pytest.approx([g / 3 for g in itls_s(r) for _ in range(3)])  # once per token
    without, _ = await _run(
        Script(itl_s=0.01, tokens_per_chunk=3), _requests(1, max_tokens=12), LoadSpec(concurrency=1)
    )
    assert without[0].chunk_tokens == [] and tokens_per_chunk(without[0]) is None  # 12 tokens, 4 chunks, no counts
    assert decode_tok_s(without[0]) is None


def test_engine_timings_are_a_cross_check_flagged_past_the_margin() -> None:
    from benchsuite.measure.metrics import ENGINE_TIMINGS_MARGIN, summarize

    def record(i: int, engine_rate: float) -> RequestRecord:
        chunks = [1.0 + 0.01 * k for k in range(11)]  # 10 tok over 0.1 s: 100 tok/s
        return RequestRecord(
            "c",
            i,
            False,
            False,
            f"p{i}",
            "short",
            11,
            0.0,
            1.0,
            1.2,
            chunks,
            5,
            11,
            11,
            ok=True,
            engine_timings={"predicted_per_second": engine_rate},
            chunk_reads=list(range(11)),
        )

    base = CellResult("c", "r", "e", "llamacpp", "m", "s", {}, "w", "short", 1, 0, "ok")
    inside = 100.0 / (1 + ENGINE_TIMINGS_MARGIN / 2)  # ours / engine's = 1 + margin/2
    close = summarize([record(i, inside) for i in range(3)], base=base)
    assert close.timings_decode_tok_s_p50 == pytest.approx(inside) and "engine_timings_flag" not in close.extras
    assert close.engine_timings_checked == 3 and close.engine_timings_outside == 0
    assert close.engine_timings_ratio_p50 == pytest.approx(1 + ENGINE_TIMINGS_MARGIN / 2)
    outside = 100.0 / (1 + 2 * ENGINE_TIMINGS_MARGIN)
    one_far = summarize([record(0, inside), record(1, inside), record(2, outside)], base=base)
    assert one_far.engine_timings_outside == 1  # every request is checked, not only the median
    assert one_far.extras["engine_timings_flag"].startswith(
        "decode tok/s disagrees with the engine's own timings: 1 of 3 requests differ by more than"
    )
    assert one_far.engine_timings_ratio_max_dev == pytest.approx(2 * ENGINE_TIMINGS_MARGIN)


async def test_empty_text_tokens_with_counts_are_timed_first_and_last_included() -> None:
    from benchsuite.measure.metrics import decode_tok_s, summarize, ttft_s, ttft_text_s

    # llama-server with timings_per_token: a chunk per token, tokens 1, 2 and 10 spell nothing, each carries
    # timings.predicted_n. Text-chunk timing would start at token 3 and stop at token 9.
    script = Script(ttft_s=0.05, itl_s=0.02, timings_per_chunk=True, empty_text_chunks=(0, 1, 9))
    records, _ = await _run(script, _requests(2, max_tokens=10), LoadSpec(concurrency=1))
    for r in records:
        assert r.count_tokens[:10] == list(range(1, 11)) and r.uncounted_chunks == 0 and r.streamed_chunks == 7
        assert r.t_first_token_s == r.count_times_s[0] < r.t_first_text_s == r.chunk_times_s[0]
        assert ttft_s(r) < ttft_text_s(r)
        span = r.count_times_s[9] - r.count_times_s[0]
        assert decode_tok_s(r) == pytest.approx(9 / span)
        assert 9 / span == pytest.approx(50.0, rel=0.3)  # the scripted 20 ms per token, within the machine's noise
        assert span > r.chunk_times_s[-1] - r.chunk_times_s[0]  # the text chunks span less time
    base = CellResult("c", "r", "e", "llamacpp", "m", "s", {}, "w", "short", 1, 0, "ok")
    cell = summarize(records, base=base)
    assert cell.status == "ok" and cell.untimed_requests == 0 and cell.ttft_text_p50_s > cell.ttft_p50_s


async def test_multi_token_chunks_with_counts_and_without() -> None:
    from benchsuite.measure.metrics import decode_tok_s, summarize, untimed_reason

    counted, _ = await _run(
        Script(itl_s=0.01, tokens_per_chunk=2, timings_per_chunk=True), _requests(1, max_tokens=8), LoadSpec(1)
    )
    (r,) = counted
    assert r.count_tokens[:4] == [2, 4, 6, 8]
    assert decode_tok_s(r) == pytest.approx(6 / (r.count_times_s[3] - r.count_times_s[0]))  # f = 2
    bare, _ = await _run(Script(itl_s=0.01, tokens_per_chunk=2), _requests(3, max_tokens=8), LoadSpec(1))
    assert all(decode_tok_s(b) is None for b in bare)
    assert untimed_reason(bare[0]) == (
        "the engine sent no per-chunk token counts and usage says 8 tokens over 4 text chunks: "
        "when each token came is unknown"
    )
    base = CellResult("c", "r", "e", "sglang", "m", "s", {}, "w", "short", 1, 0, "ok")
    cell = summarize(bare, base=base)
    assert cell.status == "invalid" and cell.untimed_requests == 3 and cell.decode_tok_s_p50 is None
    assert "no request has a token timeline" in cell.reason and "untimed_flag" in cell.extras


async def test_a_stream_of_empty_text_tokens_with_counts_is_ok_not_no_tokens() -> None:
    records, _ = await _run(
        Script(itl_s=0.002, timings_per_chunk=True, empty_text_chunks=(0, 1, 2, 3)),
        _requests(1, max_tokens=4),
        LoadSpec(1),
    )
    assert records[0].ok and records[0].streamed_chunks == 0 and records[0].count_tokens[:4] == [1, 2, 3, 4]


async def test_a_count_on_the_final_chunk_alone_does_not_place_token_1() -> None:
    from benchsuite.measure.metrics import token_timeline

    # llama-server without timings_per_token: `timings` (predicted_n) only on the finish chunk
    script = Script(itl_s=0.005, timings={"predicted_n": 6, "predicted_per_second": 200.0})
    records, _ = await _run(script, _requests(1, max_tokens=6), LoadSpec(1))
    (r,) = records
    assert r.count_tokens == [6] and r.uncounted_chunks == 6
    assert r.t_first_token_s == r.chunk_times_s[0]  # not the finish chunk's time
    assert token_timeline(r).source == "text chunks"  # 6 tokens over 6 text chunks: each chunk one token
