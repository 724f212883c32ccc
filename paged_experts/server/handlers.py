"""The generation endpoints of the built-in server: `POST /v1/completions` and
`POST /v1/chat/completions`, streaming (SSE) and not, plus the shared server state and the error
middleware that turns every refused request into a JSON error naming the field.

Flow: body (size-limited) -> `protocol` (validated options) -> the model name (404 when not served)
-> `prepare` (prompt size limits, tokenization off the event loop, KV admission: 400 naming
`prompt`/`messages`/`max_tokens` if it can never fit) -> `engine.submit` -> `generation` (text
deltas, stop strings) -> `openai` shapes. The handler's `finally` aborts the engine
request, so a client that disconnects (aiohttp cancels the handler) frees its KV at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

from aiohttp import web

from paged_experts.server.engine import RequestStream
from paged_experts.server.generation import Delta, engine_timings, is_failure, text_deltas
from paged_experts.server.launch import Serving
from paged_experts.server.metrics import ServerMetrics
from paged_experts.server.openai import (
    SSE_DONE,
    LegacyLogprobs,
    ResponseHeader,
    Usage,
    chat_chunk,
    chat_logprob_entries,
    chat_response,
    completion_chunk,
    completion_response,
    sse,
    usage_chunk,
    vllm_prompt_logprobs,
)
from paged_experts.server.options import ServeOptions
from paged_experts.server.prepare import Prepared, Preparer
from paged_experts.server.protocol import (
    ApiError,
    ChatBody,
    CompletionBody,
    chat_options,
    completion_options,
    message_text,
    single_prompt,
    validate,
)
from paged_experts.server.text import ChatTurn, TextCodec

log = logging.getLogger("paged_experts.server")

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions
CHAT_DEFAULT_MAX_TOKENS = 256  # chat has no documented default; KV is reserved for it up front


class ServerState:
    """One server's mutable state: set by start-up (serve.py), read by every handler."""

    def __init__(self, config: ServeOptions) -> None:
        self.config = config
        self.metrics = ServerMetrics()
        self.started_s = int(time.time())
        self.serving: Serving | None = None
        self.load_error: str | None = None
        self.load_task: asyncio.Task[None] | None = None
        self.loaded: asyncio.Future[None] | None = None  # resolves when the model is ready
        self.engine_task: asyncio.Task[None] | None = None
        self.gc_frozen = False  # this server froze the process's heap once loaded (gc_pauses.freeze_heap)
        self._preparer: Preparer | None = None

    def ready(self) -> Serving:
        problem = self.not_ready_reason()
        if problem is not None:
            raise ApiError(503, None, problem)
        assert self.serving is not None
        return self.serving

    def preparer(self) -> Preparer:
        """The loaded server's request preparation (made on first use, closed by `close`)."""
        serving = self.ready()
        if self._preparer is None or self._preparer.serving is not serving:
            self._preparer = Preparer(serving)
        return self._preparer

    def close(self) -> None:
        if self._preparer is not None:
            self._preparer.close()
            self._preparer = None

    def not_ready_reason(self) -> str | None:
        """Why requests cannot be served now (loading, failed load, engine loop ended), or None."""
        if self.serving is None:
            return f"failed: {self.load_error}" if self.load_error else "loading: the model is still loading"
        task = self.engine_task
        if task is not None and task.done():
            failure = None if task.cancelled() else task.exception()
            return f"failed: the engine loop stopped ({failure!r})"
        return None

    def name_token(self, codec: TextCodec, as_ids: bool) -> Any:
        return (lambda t: f"token_id:{t}") if as_ids else codec.token_str


STATE_KEY = web.AppKey("state", ServerState)


def _error_response(err: ApiError) -> web.Response:
    return web.json_response(err.body(), status=err.status)


@web.middleware
async def error_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as err:
        return _error_response(err)
    except web.HTTPException:
        raise
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # the server keeps serving; the client learns what failed
        log.exception("unhandled error on %s", request.path)
        return _error_response(ApiError(500, None, f"internal error: {type(exc).__name__}: {exc}"))


async def _sse_start(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    return resp


# ---- completions -----------------------------------------------------------------------------


async def completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE_KEY]
    serving, preparer = state.ready(), state.preparer()
    body: CompletionBody = validate(CompletionBody, await preparer.body(request))
    opts = completion_options(body)
    preparer.check_model(body.model)
    prep = await preparer.prepare(single_prompt(body.prompt), opts, COMPLETIONS_DEFAULT_MAX_TOKENS, "prompt", True)
    header = ResponseHeader.new(f"cmpl-{uuid.uuid4().hex}", serving.config.model_name)
    name = state.name_token(serving.codec, opts.tokens_as_ids)
    echo_text = prep.prompt_text if body.echo else ""
    stream = preparer.submit(header.response_id, prep)
    try:
        if opts.stream:
            return await _stream_completion(request, serving, stream, prep, header, name, echo_text)
        return await _full_completion(serving, stream, prep, header, name, echo_text)
    finally:
        stream.abort()


def _legacy_lp(codec: TextCodec, name: Any, prep: Prepared, delta: Delta, echo_text: str,
               with_prompt: bool) -> LegacyLogprobs | None:  # fmt: skip
    if prep.options.logprobs is None:
        return None
    lp = LegacyLogprobs.empty()
    if with_prompt and echo_text and delta.prompt_logprobs is not None:
        # echo: the prompt's tokens come first, offsets within the prompt text
        offset = 0
        for token_id, entry in zip(prep.prompt_ids, delta.prompt_logprobs):
            lp.add(name, token_id, entry, offset)
            offset += len(codec.token_str(token_id))
    for token_id, entry in zip(delta.token_ids, delta.logprobs):
        lp.add(name, token_id, entry, len(echo_text) + delta.text_offset)
    return lp


def _vllm_prompt_lps(name: Any, body_echo: bool, prep: Prepared, delta: Delta) -> Any:
    if prep.options.prompt_logprobs is None or delta.prompt_logprobs is None or body_echo:
        return None
    return vllm_prompt_logprobs(name, delta.prompt_logprobs)


async def _full_completion(serving: Serving, stream: RequestStream, prep: Prepared, header: ResponseHeader,
                           name: Any, echo_text: str) -> web.Response:  # fmt: skip
    text, reason, tokens = "", None, 0
    merged = LegacyLogprobs.empty() if prep.options.logprobs is not None else None
    prompt_lps = None
    async for delta in text_deltas(stream, serving.codec, prep.options.stop_strings):
        lp = _legacy_lp(serving.codec, name, prep, delta, echo_text, with_prompt=delta.prompt_logprobs is not None)
        if merged is not None and lp is not None:
            for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                getattr(merged, key).extend(getattr(lp, key))
        prompt_lps = prompt_lps or _vllm_prompt_lps(name, bool(echo_text), prep, delta)
        text += delta.text
        reason, tokens = delta.finish_reason, delta.completion_tokens
        if is_failure(reason):
            raise ApiError(500, None, f"generation failed: {delta.error or reason}")
    usage = Usage(len(prep.prompt_ids), tokens)
    return web.json_response(completion_response(header, echo_text + text, reason, usage, merged, prompt_lps))


async def _stream_completion(request: web.Request, serving: Serving, stream: RequestStream, prep: Prepared,
                             header: ResponseHeader, name: Any, echo_text: str) -> web.StreamResponse:  # fmt: skip
    resp = await _sse_start(request)
    tokens = 0
    first = True
    continuous = prep.options.continuous_usage
    async for delta in text_deltas(stream, serving.codec, prep.options.stop_strings):
        tokens = delta.completion_tokens
        if is_failure(delta.finish_reason):
            await resp.write(
                sse(ApiError(500, None, f"generation failed: {delta.error or delta.finish_reason}").body())
            )
            break
        text = (echo_text if first else "") + delta.text
        lp = _legacy_lp(serving.codec, name, prep, delta, echo_text, with_prompt=first)
        prompt_lps = _vllm_prompt_lps(name, bool(echo_text), prep, delta)
        # with continuous usage every token gets its chunk, an empty-text one included: the client times it
        wanted = text or delta.finish_reason is not None or (lp is not None and lp.tokens) or prompt_lps is not None
        if continuous or wanted:
            chunk = completion_chunk(header, text, delta.finish_reason, lp, prompt_lps)
            _add_counts(chunk, stream, prep, delta, continuous)
            await resp.write(sse(chunk))
            first = False
    if prep.options.include_usage:
        await resp.write(sse(usage_chunk(header, "text_completion", Usage(len(prep.prompt_ids), tokens))))
    await resp.write(SSE_DONE)
    await resp.write_eof()
    return resp


def _add_counts(chunk: dict[str, Any], stream: RequestStream, prep: Prepared, delta: Delta, continuous: bool) -> None:
    """Continuous usage: the tokens generated so far on every chunk. The finish chunk carries the
    engine's own timings of the request (llama-server's `timings` keys), so every request can be
    checked against the engine's clock."""
    if continuous:
        chunk["usage"] = Usage(len(prep.prompt_ids), delta.completion_tokens).to_dict()
    if delta.finish_reason is not None:
        chunk["timings"] = engine_timings(stream, len(prep.prompt_ids))


# ---- chat completions ------------------------------------------------------------------------


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE_KEY]
    serving, preparer = state.ready(), state.preparer()
    body: ChatBody = validate(ChatBody, await preparer.body(request))
    opts = chat_options(body)
    preparer.check_model(body.model)
    turns = [ChatTurn(m.role, message_text(m)) for m in body.messages]
    try:
        prompt = serving.codec.render_chat(turns, body.add_generation_prompt)
    except Exception as exc:  # template errors are the request's fault (e.g. a role it refuses)
        raise ApiError(400, "messages", f"messages: {exc}") from exc
    # the template already spells every special token
    sent = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    prep = await preparer.prepare(prompt, opts, CHAT_DEFAULT_MAX_TOKENS, "messages", False, max_tokens_field=sent)
    header = ResponseHeader.new(f"chatcmpl-{uuid.uuid4().hex}", serving.config.model_name)
    name = state.name_token(serving.codec, opts.tokens_as_ids)
    stream = preparer.submit(header.response_id, prep)
    try:
        if opts.stream:
            return await _stream_chat(request, serving, stream, prep, header, name)
        return await _full_chat(serving, stream, prep, header, name)
    finally:
        stream.abort()


async def _full_chat(serving: Serving, stream: RequestStream, prep: Prepared, header: ResponseHeader,
                     name: Any) -> web.Response:  # fmt: skip
    text, reason, tokens = "", None, 0
    entries: list[dict[str, Any]] | None = [] if prep.options.logprobs is not None else None
    prompt_lps = None
    async for delta in text_deltas(stream, serving.codec, prep.options.stop_strings):
        if entries is not None:
            entries.extend(chat_logprob_entries(name, delta.logprobs))
        prompt_lps = prompt_lps or _vllm_prompt_lps(name, False, prep, delta)
        text += delta.text
        reason, tokens = delta.finish_reason, delta.completion_tokens
        if is_failure(reason):
            raise ApiError(500, None, f"generation failed: {delta.error or reason}")
    usage = Usage(len(prep.prompt_ids), tokens)
    return web.json_response(chat_response(header, text, reason, usage, entries, prompt_lps))


async def _stream_chat(request: web.Request, serving: Serving, stream: RequestStream, prep: Prepared,
                       header: ResponseHeader, name: Any) -> web.StreamResponse:  # fmt: skip
    resp = await _sse_start(request)
    continuous = prep.options.continuous_usage
    role = chat_chunk(header, {"role": "assistant", "content": ""}, None, None)
    if continuous:
        role["usage"] = Usage(len(prep.prompt_ids), 0).to_dict()
    await resp.write(sse(role))
    tokens = 0
    async for delta in text_deltas(stream, serving.codec, prep.options.stop_strings):
        tokens = delta.completion_tokens
        if is_failure(delta.finish_reason):
            await resp.write(
                sse(ApiError(500, None, f"generation failed: {delta.error or delta.finish_reason}").body())
            )
            break
        entries = chat_logprob_entries(name, delta.logprobs) if prep.options.logprobs is not None else None
        if continuous or delta.text or delta.finish_reason is not None or entries:
            chunk = chat_chunk(header, {"content": delta.text} if delta.text else {}, delta.finish_reason, entries)
            prompt_lps = _vllm_prompt_lps(name, False, prep, delta)
            if prompt_lps is not None:
                chunk["prompt_logprobs"] = prompt_lps
            _add_counts(chunk, stream, prep, delta, continuous)
            await resp.write(sse(chunk))
    if prep.options.include_usage:
        await resp.write(sse(usage_chunk(header, "chat.completion.chunk", Usage(len(prep.prompt_ids), tokens))))
    await resp.write(SSE_DONE)
    await resp.write_eof()
    return resp
