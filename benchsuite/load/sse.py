"""Incremental Server-Sent Events parser for OpenAI-compatible streams.

Feed it the raw bytes of a response body as they arrive, in pieces of any size; it returns the
data payload of every event completed so far. Follows the SSE rules the LLM servers rely on:
lines end in LF or CRLF, `data:` lines (one optional space after the colon) accumulate into one
event joined by LF, a blank line dispatches the event, `:` lines are comments, `event:` names the
next event (servers use `event: error`), other fields are ignored. A final event without its
blank line is returned by `close()`.
"""

from __future__ import annotations

from typing import NamedTuple


class SseEvent(NamedTuple):
    """One dispatched event (a tuple: cheap to build once per streamed chunk)."""

    data: bytes
    event: bytes = b"message"


class SseParser:
    __slots__ = ("_buffer", "_data", "_event")

    def __init__(self) -> None:
        self._buffer = b""
        self._data: list[bytes] = []
        self._event = b"message"

    def feed(self, chunk: bytes) -> list[SseEvent]:
        if (
            not self._buffer
            and not self._data
            and chunk.startswith(b"data:")
            and chunk.endswith(b"\n\n")
            and chunk.count(b"\n") == 2
            and b"\r" not in chunk
        ):
            # Fast path: the common read that holds exactly one single-line event.
            value = chunk[5:-2]
            return [SseEvent(value[1:] if value.startswith(b" ") else value, self._event)]
        buffer = self._buffer + chunk if self._buffer else chunk
        lines = buffer.split(b"\n")
        self._buffer = lines.pop()  # the unterminated rest, possibly b""
        events: list[SseEvent] = []
        for line in lines:
            if line.endswith(b"\r"):
                line = line[:-1]
            if not line:
                if self._data:
                    events.append(SseEvent(b"\n".join(self._data), self._event))
                    self._data = []
                self._event = b"message"
            elif line.startswith(b"data:"):
                value = line[5:]
                self._data.append(value[1:] if value.startswith(b" ") else value)
            elif line.startswith(b"event:"):
                self._event = line[6:].strip()
            # comments (":...") and other fields (id:, retry:) carry nothing we use
        return events

    def close(self) -> list[SseEvent]:
        """Events left when the stream ends without a final blank line."""
        events = self.feed(b"\n\n") if (self._buffer or self._data) else []
        self._buffer = b""
        return events
