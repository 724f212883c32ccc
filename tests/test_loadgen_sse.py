"""The incremental SSE parser gives the same events however the byte stream is split."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from benchsuite.load.sse import SseEvent, SseParser

STREAM = (
    b": keep-alive comment\n\n"
    b'data: {"choices":[{"text":"a"}]}\n\n'
    b'data:{"choices":[{"text":"b\\u00e9"}]}\r\n\r\n'
    b"event: error\n"
    b'data: {"error":"x"}\n\n'
    b"id: 7\n"
    b"data: line one\n"
    b"data: line two\n\n"
    b"data: [DONE]\n\n"
)
EXPECTED = [
    SseEvent(b'{"choices":[{"text":"a"}]}'),
    SseEvent(b'{"choices":[{"text":"b\\u00e9"}]}'),
    SseEvent(b'{"error":"x"}', b"error"),
    SseEvent(b"line one\nline two"),
    SseEvent(b"[DONE]"),
]


def _parse_in_pieces(data: bytes, cuts: list[int]) -> list[SseEvent]:
    parser = SseParser()
    events: list[SseEvent] = []
    edges = [0, *sorted(set(cuts)), len(data)]
    for start, end in itertools.pairwise(edges):
        events += parser.feed(data[start:end])
    return events + parser.close()


def test_whole_stream_parses_to_expected_events() -> None:
    assert _parse_in_pieces(STREAM, []) == EXPECTED


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=len(STREAM)), max_size=40))
def test_any_split_gives_the_same_events(cuts: list[int]) -> None:
    assert _parse_in_pieces(STREAM, cuts) == EXPECTED


def test_byte_by_byte() -> None:
    assert _parse_in_pieces(STREAM, list(range(len(STREAM)))) == EXPECTED


def test_final_event_without_blank_line_is_returned_by_close() -> None:
    parser = SseParser()
    assert parser.feed(b"data: [DONE]") == []
    assert parser.close() == [SseEvent(b"[DONE]")]
    assert parser.close() == []
