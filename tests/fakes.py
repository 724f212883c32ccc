"""A scripted fake OpenAI-compatible streaming server, for load-generator timing tests ONLY.

It is never an engine in a benchmark: it generates no text, it replays a `Script` (how many
tokens, how fast, how the stream is framed and how it fails). It speaks just enough HTTP/1.1
(keep-alive, chunked transfer encoding) on raw asyncio streams to be fast: one process can push
well over 20,000 SSE chunks/s, so the load generator's ceiling can be measured against it.

In-process (tests): `async with FakeServer(script) as server: server.url ...`; `script` is a
Script or a function (request body, arrival index) -> Script; `server.bodies` keeps every
request body received.

Separate process (benchmarks/loadgen_ceiling.py):
`python tests/fakes.py --port P [--workers W] [--itl-s S] [--ttft-s S] [--cpus 1,2]`
(workers share the port with SO_REUSEPORT; a request body's `fake_itl_s` / `fake_ttft_s`
override the pacing for that request).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Script:
    output_tokens: int | None = None  # None: the request's max_tokens
    ttft_s: float = 0.0  # delay before the first content chunk
    itl_s: float = 0.0  # delay between content chunks (paced on an absolute schedule)
    tokens_per_chunk: int = 1
    role_chunk: bool = False  # a role-only first chunk (chat streams always get one)
    usage: bool = True  # the usage-only final chunk
    usage_completion_tokens: int | None = None  # report this instead of the true token count
    prompt_tokens: int | None = None  # None: len(token ids) or the prompt's word count
    status: int = 200
    error_body: str = '{"error": {"message": "scripted failure"}}'
    reset_after_chunks: int | None = None  # abort the connection (RST) after this many chunks
    hang_after_chunks: int | None = None  # stop sending (keep the connection open) after this many
    error_event_after_chunks: int | None = None  # send data: {"error": ...} after this many
    done: bool = True  # send data: [DONE]
    finish: bool = True  # send a finish_reason chunk
    timings: dict[str, Any] | None = None  # llama.cpp-style timings on the finish chunk
    split_bytes: int | None = None  # deliver the SSE stream in writes of this many bytes
    crlf: bool = False  # end SSE lines with CRLF
    token_text: str = " tok"
    inject_after_first_chunk: str | None = None  # a raw SSE data payload sent after the first chunk
    one_write: bool = False  # the whole stream in one write (the client then reads it in one piece)
    usage_per_chunk: bool = False  # every content chunk carries the cumulative usage (continuous usage stats)
    timings_per_chunk: bool = False  # every chunk carries llama-server's timings.predicted_n (timings_per_token)
    empty_text_chunks: tuple[int, ...] = ()  # these chunks (0-based) carry empty text: tokens that spell nothing


ScriptFn = Callable[[dict[str, Any], int], Script]


@dataclass
class FakeServer:
    script: Script | ScriptFn = field(default_factory=Script)
    host: str = "127.0.0.1"
    port: int = 0
    metrics_text: str = ""
    reuse_port: bool = False
    bodies: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._server: asyncio.AbstractServer | None = None
        self._arrivals = 0
        self._handlers: set[asyncio.Task[None]] = set()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(
            self._serve, self.host, self.port, reuse_port=self.reuse_port or None, backlog=1024
        )
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for task in list(self._handlers):
                task.cancel()
            await asyncio.gather(*self._handlers, return_exceptions=True)
            await self._server.wait_closed()

    async def __aenter__(self) -> FakeServer:  # noqa: PYI034
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                request_line, *header_lines = head.decode("latin-1").split("\r\n")
                method, path, _ = request_line.split(" ", 2)
                headers = {}
                for line in header_lines:
                    if ":" in line:
                        name, value = line.split(":", 1)
                        headers[name.strip().lower()] = value.strip()
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                keep_open = await self._respond(method, path, body, writer)
                if not keep_open:
                    break
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            pass
        except asyncio.CancelledError:
            writer.transport.abort()
        finally:
            self._handlers.discard(task)
            if not writer.transport.is_closing():
                writer.close()

    async def _respond(self, method: str, path: str, body: bytes, writer: asyncio.StreamWriter) -> bool:
        if method == "GET" and path == "/health":
            _simple(writer, 200, b"ok", "text/plain")
            return True
        if method == "GET" and path == "/metrics":
            _simple(writer, 200, self.metrics_text.encode(), "text/plain; version=0.0.4")
            return True
        if method != "POST" or path not in ("/v1/completions", "/v1/chat/completions"):
            _simple(writer, 404, b'{"error": "not found"}', "application/json")
            return True
        request = json.loads(body)
        self.bodies.append(request)
        arrival = self._arrivals
        self._arrivals += 1
        script = self.script(request, arrival) if callable(self.script) else self.script
        if script.status != 200:
            _simple(writer, script.status, script.error_body.encode(), "application/json")
            return True
        return await _stream(writer, script, request, path.endswith("chat/completions"))


def _simple(writer: asyncio.StreamWriter, status: int, body: bytes, content_type: str) -> None:
    writer.write(
        f"HTTP/1.1 {status} X\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body
    )


def _chunked(payload: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(payload), payload)


# Over 80 lines on purpose: the scripted server's whole SSE timeline (chunks, usage, errors, stalls) in the
# order it goes on the wire, which the load generator's timing tests read against.
async def _stream(writer: asyncio.StreamWriter, script: Script, request: dict[str, Any], chat: bool) -> bool:
    """Stream one scripted response; return whether the connection may serve another request."""
    loop = asyncio.get_running_loop()
    eol = b"\r\n" if script.crlf else b"\n"
    n_tokens = script.output_tokens if script.output_tokens is not None else int(request["max_tokens"])
    prompt = request.get("prompt", request.get("messages", ""))
    prompt_tokens = script.prompt_tokens
    if prompt_tokens is None:
        prompt_tokens = len(prompt) if isinstance(prompt, list) and chat is False else len(str(prompt).split())
    kind = "chat.completion.chunk" if chat else "text_completion"

    def event(obj: dict[str, Any] | str) -> bytes:
        data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
        return b"data: " + data.encode() + eol + eol

    def choice(text: str | None, finish: str | None, role: bool = False) -> dict[str, Any]:
        base = {"id": "fake", "object": kind, "created": 0, "model": "fake"}
        if chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {"content": text}
            base["choices"] = [{"index": 0, "delta": delta, "finish_reason": finish}]
        else:
            base["choices"] = [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}]
        return base

    pending: list[bytes] = []

    async def send(data: bytes) -> None:
        if script.one_write:
            pending.append(data)
            if data == b"":
                writer.write(_chunked(b"".join(pending)) + _chunked(b""))
                await writer.drain()
            return
        if script.split_bytes and data:
            for i in range(0, len(data), script.split_bytes):
                writer.write(_chunked(data[i : i + script.split_bytes]))
                await writer.drain()
                await asyncio.sleep(0.001)
        else:
            writer.write(_chunked(data))
            await writer.drain()

    writer.write(
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n"
    )
    if chat or script.role_chunk:
        await send(event(choice(None, None, role=True)))
    chunk_sizes = [script.tokens_per_chunk] * (n_tokens // script.tokens_per_chunk)
    if n_tokens % script.tokens_per_chunk:
        chunk_sizes.append(n_tokens % script.tokens_per_chunk)
    next_s = loop.time() + script.ttft_s
    for i, size in enumerate(chunk_sizes):
        if script.reset_after_chunks == i:
            writer.transport.abort()
            return False
        if script.hang_after_chunks == i:
            await asyncio.sleep(3600)
        if script.error_event_after_chunks == i:
            await send(event({"error": {"message": "scripted mid-stream failure", "code": 500}}))
            await send(b"")  # chunked terminator: the body ends cleanly after the error event
            return True
        delay_s = next_s - loop.time()
        if delay_s > 0:
            await asyncio.sleep(delay_s)
        next_s += script.itl_s
        body = choice("" if i in script.empty_text_chunks else script.token_text * size, None)
        sent = sum(chunk_sizes[: i + 1])
        if script.timings_per_chunk:
            body["timings"] = {"predicted_n": sent}
        if script.usage_per_chunk:
            body["usage"] = {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": sent,
                "total_tokens": prompt_tokens + sent,
            }
        data = event(body)
        if i == 0 and script.inject_after_first_chunk is not None:
            data += event(script.inject_after_first_chunk)
        if i == len(chunk_sizes) - 1:
            data += _trailer(script, event, choice, prompt_tokens, n_tokens)
        await send(data)
    if not chunk_sizes:
        await send(_trailer(script, event, choice, prompt_tokens, n_tokens))
    await send(b"")  # zero-length chunk ends the chunked body
    return True


def _trailer(script: Script, event: Any, choice: Any, prompt_tokens: int, n_tokens: int) -> bytes:
    """Finish chunk, usage-only chunk and [DONE], sent with the last content chunk in one write."""
    out = b""
    if script.finish:
        finish = choice("", "length")
        if script.timings is not None:
            finish["timings"] = script.timings
        out += event(finish)
    if script.usage:
        completion = script.usage_completion_tokens if script.usage_completion_tokens is not None else n_tokens
        out += event(
            {
                "id": "fake",
                "object": "text_completion",
                "created": 0,
                "model": "fake",
                "choices": [],
                "usage": {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": completion,
                    "total_tokens": prompt_tokens + completion,
                },
            }
        )
    if script.done:
        out += event("[DONE]")
    return out


async def _serve_forever(args: argparse.Namespace) -> None:
    def script(body: dict[str, Any], arrival: int) -> Script:
        # A request may override the pacing (`fake_itl_s`, `fake_ttft_s`), so one server process
        # serves every phase of a benchmark.
        return Script(
            itl_s=float(body.get("fake_itl_s", args.itl_s)),
            ttft_s=float(body.get("fake_ttft_s", args.ttft_s)),
            tokens_per_chunk=args.tokens_per_chunk,
        )

    server = FakeServer(script, host=args.host, port=args.port, reuse_port=args.workers > 1)
    await server.start()
    await asyncio.Event().wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--itl-s", type=float, default=0.0)
    parser.add_argument("--ttft-s", type=float, default=0.0)
    parser.add_argument("--tokens-per-chunk", type=int, default=1)
    parser.add_argument("--cpus", default="", help="comma-separated CPU ids to pin the workers to")
    args = parser.parse_args(argv)
    if args.cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})
    for _ in range(args.workers - 1):
        if os.fork() == 0:
            break  # children and the parent all serve the same port
    asyncio.run(_serve_forever(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
