"""From a validated request to an engine submission: the served model's name, the prompt's size
limits, tokenization off the event loop, and KV admission errors that name the field at fault.

One request's cost stays its own. The checks run cheapest first, each before the work it guards:
1. the body's declared size (`Content-Length`) against `PromptLimits.max_body_bytes`, before the
   body is read (413);
2. a text prompt's UTF-8 size against `max_prompt_bytes` before it is tokenized, a token-id prompt's
   length against `max_prompt_tokens` before its ids are checked or decoded (400);
3. tokenization in a small thread pool of its own, through `tokenizers`' batch API, which releases
   the GIL (its single-text `encode` holds it: a 1 MB prompt froze the event loop for 0.4 s), so
   `/health`, new requests and other streams go on while a large prompt is encoded; the pool is not
   the default executor, so tokenizing never delays an engine step (`Engine.run` uses that one);
4. the token count against `max_prompt_tokens`, then KV admission (`Engine.check_admissible`).

`max_prompt_tokens` is what can ever run: KV capacity minus one generated token (and the model's
context length). `max_prompt_bytes` is that times the longest vocabulary entry in UTF-8 bytes
(`TextCodec.max_token_bytes`), an upper bound on the text such a prompt can spell with a byte-level
BPE tokenizer, so the byte check only refuses prompts the token check would refuse anyway.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from paged_experts.server.engine import AdmissionError, RequestStream, SamplingParams
from paged_experts.server.launch import Serving
from paged_experts.server.protocol import ApiError, GenerationOptions, parse_json

MIN_BODY_BYTES = 1 << 20  # a body limit never below 1 MiB: options, stop strings, several messages
BODY_BYTES_PER_PROMPT_BYTE = 6  # JSON escapes spell one byte as up to six (\u0000)
TOKENIZER_THREADS = 2


@dataclass(frozen=True)
class PromptLimits:
    max_prompt_tokens: int
    max_prompt_bytes: int
    max_body_bytes: int

    @classmethod
    def of(cls, serving: Serving) -> PromptLimits:
        engine = serving.engine
        tokens = engine.kv_capacity_tokens - 1  # at least one generated token must fit
        if engine.config.max_context_tokens is not None:
            tokens = min(tokens, engine.config.max_context_tokens - 1)
        tokens = max(tokens, 1)
        prompt_bytes = tokens * serving.codec.max_token_bytes
        return cls(tokens, prompt_bytes, max(MIN_BODY_BYTES, BODY_BYTES_PER_PROMPT_BYTE * prompt_bytes))


@dataclass(frozen=True)
class Prepared:
    """A validated request ready for the engine."""

    prompt_ids: list[int]
    prompt_text: str
    options: GenerationOptions
    max_tokens: int


class Preparer:
    """One server's request preparation (its thread pool and limits); `close()` at shutdown."""

    def __init__(self, serving: Serving) -> None:
        self.serving = serving
        self.limits = PromptLimits.of(serving)
        cfg = serving.config
        # OpenAI-compatible servers answer 404 for a model they do not serve; the path as given
        # is accepted too (vLLM's default served name).
        self.model_names = frozenset({cfg.model_name, cfg.model_path})
        self._pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="tokenize")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def body(self, request: web.Request) -> dict[str, Any]:
        limit = self.limits.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise ApiError(413, "body", f"body: {request.content_length} bytes exceed the limit of {limit} bytes")
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.content.iter_any():  # chunked bodies have no Content-Length
            size += len(chunk)
            if size > limit:
                raise ApiError(413, "body", f"body: more than {limit} bytes (the limit)")
            chunks.append(chunk)
        return parse_json(b"".join(chunks))

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_names:
            served = self.serving.config.model_name
            raise ApiError(404, "model", f"model: the model {model!r} does not exist; this server serves {served!r}")

    async def prepare(self, prompt: str | list[int], opts: GenerationOptions, default_max: int, field: str,
                      add_special_tokens: bool, max_tokens_field: str = "max_tokens") -> Prepared:  # fmt: skip
        """Prompt ids and admission; raises ApiError naming `field`, or `max_tokens_field` only when sent."""
        if isinstance(prompt, str):
            ids = await self._encode(prompt, field, add_special_tokens)
            text = prompt
        else:
            ids, text = await self._token_ids(prompt, field), ""
        if not ids:
            raise ApiError(400, field, f"{field}: encodes to zero tokens")
        if len(ids) > self.limits.max_prompt_tokens:
            raise ApiError(400, field, self._too_long(field, len(ids)))
        engine = self.serving.engine
        max_tokens = opts.max_tokens if opts.max_tokens is not None else default_max
        if opts.max_tokens is None:
            # an unspecified max_tokens shrinks to what the KV capacity leaves, rather than failing
            max_tokens = max(1, min(max_tokens, engine.kv_capacity_tokens - len(ids)))
        try:
            engine.check_admissible(len(ids), max_tokens, prompt_field=field, max_tokens_field=max_tokens_field
                                    if opts.max_tokens is not None else None)  # fmt: skip
        except AdmissionError as err:
            raise ApiError(400, err.field, str(err)) from err
        if not isinstance(prompt, str):
            text = await self._run(self.serving.codec.decode, ids)  # for echo; after the size checks
        return Prepared(ids, text, opts, max_tokens)

    async def _encode(self, text: str, field: str, add_special_tokens: bool) -> list[int]:
        limit = self.limits.max_prompt_bytes
        # len(text) <= bytes <= 4 * len(text): skip the UTF-8 copy when the answer is certain
        if len(text) > limit or (4 * len(text) > limit and len(text.encode("utf-8")) > limit):
            raise ApiError(
                400, field, f"{field}: {len(text.encode('utf-8'))} bytes of text exceed the limit of {limit} bytes "
                f"({self._limit_text()}, at most {self.serving.codec.max_token_bytes} bytes per token)"
            )  # fmt: skip
        return await self._run(self.serving.codec.encode, text, add_special_tokens)

    async def _token_ids(self, ids: list[int], field: str) -> list[int]:
        if len(ids) > self.limits.max_prompt_tokens:
            raise ApiError(400, field, self._too_long(field, len(ids)))
        vocab = self.serving.model.config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ApiError(400, field, f"{field}: token ids {bad[:5]} outside the vocabulary [0, {vocab})")
        return list(ids)

    def _too_long(self, field: str, n_tokens: int) -> str:
        return f"{field}: {n_tokens} tokens exceed the limit of {self._limit_text()}"

    def _limit_text(self) -> str:
        return (
            f"{self.limits.max_prompt_tokens} prompt tokens (KV capacity or context length, minus one generated token)"
        )

    async def _run(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def submit(self, request_id: str, prep: Prepared) -> RequestStream:
        """Queues the request under the response's id, so traces and responses name it alike."""
        o = prep.options
        params = SamplingParams(
            max_tokens=prep.max_tokens,
            temperature=o.temperature,
            top_p=o.top_p,
            seed=o.seed,
            ignore_eos=o.ignore_eos,
            stop_token_ids=o.stop_token_ids,
            logprobs=o.logprobs,
            prompt_logprobs=o.prompt_logprobs,
        )
        try:
            return self.serving.engine.submit(request_id, prep.prompt_ids, params)
        except AdmissionError as err:
            raise ApiError(400, err.field, str(err)) from err
