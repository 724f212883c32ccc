"""The streaming client of one request: an OpenAI-compatible streaming request sent, its SSE stream
read and timed, and turned into one `RequestRecord` (benchsuite.load.loadgen decides when each is sent).

One `RequestRecord` per request sent, warmups and failures included, with raw clock readings:
`t_sent_s` just before the request goes out, one reading per SSE event as it is parsed (events that
arrive in one body read get their own readings, never one shared timestamp), `t_done_s` = the event
`data: [DONE]` (or the moment the stream ended or failed). Two timelines are kept:

- *count points* (`count_times_s`, `count_tokens`, `count_reads`): every streamed choice that
  carried a cumulative generated-token count, whether it had text or not. The count is
  `usage.completion_tokens` where the chunk has usage (`stream_options.continuous_usage_stats`,
  asked of every engine: SGLang and the built-in server send it), else `timings.predicted_n`
  (llama-server with `timings_per_token`: it sends one chunk per sampled token, the empty-text ones
  included, and holds back a token whose piece ends in an incomplete UTF-8 character, so the next
  chunk's count jumps by 2). The final
  usage-only chunk (`choices: []`) is not a count point: it says how many, not when.
- *content chunks* (`chunk_times_s`, `chunk_reads`, `chunk_tokens`): choices whose generated text is
  non-empty (`text` for /v1/completions; `delta.content` or `delta.reasoning_content` for chat).
  `streamed_chunks` counts them; `t_first_text_s` is the first (visible text).

`uncounted_chunks` = content chunks without a count: 0 (with count points) means every token is
placed in time. `t_first_token_s` = the first count point whose count is >= 1 when every content
chunk carried a count, else the first content chunk; `benchsuite.measure.metrics.token_timeline` decides
which timeline a metric may use.
`chunk_reads` / `count_reads` number the body read each chunk came in: two chunks in one read mean
the client did not read between them (it fell behind, or the server sent them together).

Token counts come only from the server (never from max_tokens). The usage rule: engines may put
several tokens in one chunk or hold a token back (a partial UTF-8 character), so fewer chunks than
tokens is normal; `usage_mismatch` is set when a request that streamed content has no usage, or
streamed MORE content chunks than usage.completion_tokens.

A request is `ok` when it got HTTP 200, streamed at least one content chunk or counted token, ended
with `[DONE]` or a finish_reason, and raised no error. Everything else keeps its record with `error`
set (HTTP status and body head, connection reset, timeout, error event, "no tokens").
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Callable
from typing import Any

import aiohttp

from benchsuite.load.sse import SseParser
from benchsuite.records import LoadRequest, RequestRecord

_json_loads: Callable[[bytes | str], Any]
try:  # orjson parses the per-chunk JSON several times faster; the stdlib is the fallback
    from orjson import loads as _json_loads
except ImportError:  # pragma: no cover - depends on the environment
    _json_loads = json.loads

Clock = Callable[[], float]
Progress = Callable[[RequestRecord], None]

_ERROR_BODY_CHARS = 300


def endpoint_url(base_url: str, chat: bool) -> str:
    """base_url may be the server root or end in /v1."""
    root = base_url.rstrip("/")
    root = root.removesuffix("/v1")
    return f"{root}/v1/chat/completions" if chat else f"{root}/v1/completions"


def request_body(request: LoadRequest, model_name: str, extras: dict[str, Any]) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model_name,
        "max_tokens": request.max_tokens,
        "temperature": 0,
        "stream": True,
        # continuous_usage_stats (vLLM, SGLang, the built-in server; ignored where unknown, e.g. llama-server,
        # whose counts come with timings_per_token): usage on every chunk, so each token is timed
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "ignore_eos": True,
    }
    if request.chat:
        body["messages"] = [{"role": "user", "content": request.prompt}]
    else:
        body["prompt"] = request.prompt if isinstance(request.prompt, str) else list(request.prompt)
    body.update(extras)
    return body


class Sender:
    """Sends one streaming request and turns what came back into a RequestRecord."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        base_url: str,
        cell_id: str,
        model_name: str,
        extras: dict[str, Any],
        timeout_s: float,
        clock: Clock,
        progress: Progress | None,
    ) -> None:
        self.session = session
        self.base_url = base_url
        self.cell_id = cell_id
        self.model_name = model_name
        self.extras = extras
        self.timeout_s = timeout_s
        self.clock = clock
        self.progress = progress
        self.records: list[RequestRecord] = []
        self._index = itertools.count()

    async def send(self, request: LoadRequest, *, warmup: bool, cold: bool) -> None:
        url = endpoint_url(self.base_url, request.chat)
        payload = json.dumps(request_body(request, self.model_name, self.extras)).encode()
        stream = _StreamState(request.chat)
        index = next(self._index)
        t_sent_s = self.clock()
        try:
            async with asyncio.timeout(self.timeout_s):
                async with self.session.post(url, data=payload, headers={"Content-Type": "application/json"}) as resp:
                    stream.http_status = resp.status
                    if resp.status != 200:
                        body = (await resp.read()).decode("utf-8", "replace")
                        stream.fail(f"HTTP {resp.status}: {_one_line(body)}", self.clock())
                    else:
                        await self._read_stream(resp, stream)
        except TimeoutError:
            stream.fail(f"timeout after {self.timeout_s:g} s", self.clock())
        except aiohttp.ClientPayloadError as exc:
            stream.fail(f"connection: stream broken ({_describe(exc)})", self.clock())
        except aiohttp.ClientConnectionError as exc:
            stream.fail(f"connection: {_describe(exc)}", self.clock())
        except aiohttp.ClientError as exc:
            stream.fail(f"client: {_describe(exc)}", self.clock())
        except OSError as exc:
            stream.fail(f"connection: {_describe(exc)}", self.clock())
        record = stream.record(self.cell_id, index, warmup, cold, request, t_sent_s)
        self.records.append(record)
        if self.progress is not None:
            self.progress(record)

    async def _read_stream(self, resp: aiohttp.ClientResponse, stream: _StreamState) -> None:
        parser = SseParser()
        clock = self.clock
        read_index = 0
        async for data in resp.content.iter_any():
            read_index += 1
            for event in parser.feed(data):
                stream.on_event(event.data, event.event, clock(), read_index)  # each event timed as it is parsed
            if stream.error is not None:
                return
        for event in parser.close():
            stream.on_event(event.data, event.event, clock(), read_index + 1)
        stream.on_end(clock())


class _StreamState:
    """What one response has streamed so far."""

    __slots__ = (
        "chat",
        "chunk_reads",
        "chunk_times_s",
        "chunk_tokens",
        "completion_tokens",
        "count_reads",
        "count_times_s",
        "count_tokens",
        "done",
        "error",
        "finished",
        "http_status",
        "prompt_tokens",
        "t_done_s",
        "texts",
        "timings",
        "uncounted_chunks",
        "usage_seen",
    )

    def __init__(self, chat: bool) -> None:
        self.chat = chat
        self.http_status: int | None = None
        self.chunk_times_s: list[float] = []
        self.chunk_reads: list[int] = []
        self.chunk_tokens: list[int | None] = []
        self.count_times_s: list[float] = []
        self.count_tokens: list[int] = []
        self.count_reads: list[int] = []
        self.uncounted_chunks = 0
        self.texts: list[str] = []
        self.prompt_tokens: int | None = None
        self.completion_tokens: int | None = None
        self.usage_seen = False
        self.finished = False  # a choice carried a finish_reason
        self.done = False  # data: [DONE] seen
        self.t_done_s: float | None = None
        self.error: str | None = None
        self.timings: dict[str, Any] | None = None

    def fail(self, reason: str, t_s: float) -> None:
        if self.error is None:
            self.error = reason
        if self.t_done_s is None:
            self.t_done_s = t_s

    def on_event(self, data: bytes, event: bytes, t_s: float, read_index: int = 0) -> None:
        if self.done or self.error is not None:
            return
        if data == b"[DONE]":
            self.done = True
            self.t_done_s = t_s
            return
        try:
            obj = _json_loads(data)
        except ValueError:
            self.fail(f"bad SSE payload: {_one_line(data.decode('utf-8', 'replace'))}", t_s)
            return
        if not isinstance(obj, dict):
            self.fail(f"bad SSE payload: {_one_line(data.decode('utf-8', 'replace'))}", t_s)
            return
        if event == b"error" or obj.get("error") is not None:
            self.fail(f"server error event: {_one_line(json.dumps(obj.get('error', obj)))}", t_s)
            return
        try:
            self._on_chunk(obj, t_s, read_index)
        except (AttributeError, TypeError, KeyError, IndexError):
            self.fail(f"bad SSE payload: {_one_line(data.decode('utf-8', 'replace'))}", t_s)

    def _on_chunk(self, obj: dict[str, Any], t_s: float, read_index: int) -> None:
        choices = obj.get("choices")
        usage = obj.get("usage")
        timings = obj.get("timings")
        if choices:
            choice = choices[0]
            if self.chat:
                delta = choice.get("delta") or {}
                text = delta.get("content") or delta.get("reasoning_content")
            else:
                text = choice.get("text")
            if text is not None and not isinstance(text, str):
                raise TypeError("generated text is not a string")
            count = _chunk_count(usage, timings)
            if count is not None:
                self.count_times_s.append(t_s)
                self.count_tokens.append(count)
                self.count_reads.append(read_index)
            if text:
                self.chunk_times_s.append(t_s)
                self.chunk_reads.append(read_index)
                self.chunk_tokens.append(_count(usage.get("completion_tokens")) if usage else None)
                self.texts.append(text)
                self.uncounted_chunks += count is None
            if choice.get("finish_reason"):
                self.finished = True
        if usage:
            self.usage_seen = True
            self.prompt_tokens = _count(usage.get("prompt_tokens"))
            self.completion_tokens = _count(usage.get("completion_tokens"))
        if isinstance(timings, dict):
            self.timings = timings

    def on_end(self, t_s: float) -> None:
        if self.t_done_s is None:
            self.t_done_s = t_s
        if self.error is None and not (self.done or self.finished):
            self.error = "connection: stream ended without [DONE] or a finish_reason"

    def record(
        self, cell_id: str, index: int, warmup: bool, cold: bool, request: LoadRequest, t_sent_s: float
    ) -> RequestRecord:
        chunks = len(self.chunk_times_s)
        error = self.error
        counted = max(self.count_tokens, default=0)
        if error is None and chunks == 0 and counted == 0:
            error = "stream produced no tokens"
        # counts place token 1 only when every text chunk carried one (a count on the final chunk alone says
        # how many, not when)
        counted_all = self.uncounted_chunks == 0
        token1 = next((t for t, n in zip(self.count_times_s, self.count_tokens) if n >= 1 and counted_all), None)
        mismatch = chunks > 0 and (self.completion_tokens is None or chunks > self.completion_tokens)
        return RequestRecord(
            cell_id=cell_id,
            request_index=index,
            warmup=warmup,
            cold=cold,
            prompt_id=request.prompt_id,
            prompt_class=request.prompt_class,
            max_tokens=request.max_tokens,
            t_sent_s=t_sent_s,
            t_first_token_s=token1 if token1 is not None else (self.chunk_times_s[0] if chunks else None),
            t_done_s=self.t_done_s,
            chunk_times_s=self.chunk_times_s,
            chunk_reads=self.chunk_reads,
            # per-chunk usage counts only when every content chunk carried one
            chunk_tokens=[t for t in self.chunk_tokens if t is not None] if None not in self.chunk_tokens else [],
            prompt_tokens=self.prompt_tokens,
            output_tokens=self.completion_tokens,
            streamed_chunks=chunks,
            usage_mismatch=mismatch,
            ok=error is None,
            error=error,
            http_status=self.http_status,
            output_text="".join(self.texts),
            engine_timings=self.timings,
            count_times_s=self.count_times_s,
            count_tokens=self.count_tokens,
            count_reads=self.count_reads,
            uncounted_chunks=self.uncounted_chunks,
            t_first_text_s=self.chunk_times_s[0] if chunks else None,
        )


def _count(value: Any) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"usage count is not an integer: {value!r}")
    return value


def _chunk_count(usage: Any, timings: Any) -> int | None:
    """The cumulative generated-token count a streamed choice carried: usage.completion_tokens (continuous
    usage stats), else llama-server's timings.predicted_n (timings_per_token); None when it carried neither."""
    if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
        return _count(usage["completion_tokens"])
    if isinstance(timings, dict) and timings.get("predicted_n") is not None:
        return _count(timings["predicted_n"])
    return None


def _one_line(text: str) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= _ERROR_BODY_CHARS else flat[:_ERROR_BODY_CHARS] + "..."


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return type(exc).__name__ if not text else f"{type(exc).__name__}: {_one_line(text)}"
