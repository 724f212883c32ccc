"""OpenAI response shapes of the built-in server: completion and chat objects, their streaming
chunks, usage, and the three logprobs layouts (legacy completions, chat `content`, and vLLM's
`prompt_logprobs`). Pure functions from typed values to JSON-ready dicts.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from paged_experts.server.sampling import TokenLogprob

TokenNamer = Callable[[int], str]  # token id -> how the response spells it


@dataclass(frozen=True)
class ResponseHeader:
    response_id: str
    model: str
    created_s: int

    @classmethod
    def new(cls, response_id: str, model: str) -> ResponseHeader:
        return cls(response_id, model, int(time.time()))


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int

    def to_dict(self) -> dict[str, int]:
        total = self.prompt_tokens + self.completion_tokens
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens, "total_tokens": total}


@dataclass
class LegacyLogprobs:
    """Accumulates OpenAI completions `logprobs` (tokens, token_logprobs, top_logprobs, text_offset)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]

    @classmethod
    def empty(cls) -> LegacyLogprobs:
        return cls([], [], [], [])

    def add(self, name: TokenNamer, token_id: int, lp: TokenLogprob | None, offset: int) -> None:
        self.tokens.append(name(token_id))
        self.token_logprobs.append(None if lp is None else lp.logprob)
        self.top_logprobs.append(None if lp is None else {name(t): v for t, v in lp.top})
        self.text_offset.append(offset)

    def to_dict(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top_logprobs,
            "text_offset": self.text_offset,
        }


def chat_logprob_entries(name: TokenNamer, lps: Sequence[TokenLogprob]) -> list[dict[str, Any]]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = name(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in lps]


def vllm_prompt_logprobs(name: TokenNamer, lps: Sequence[TokenLogprob | None]) -> list[dict[str, Any] | None]:
    """vLLM's layout: per prompt token None (the first) or {token_id: {logprob, decoded_token}},
    holding the actual token and its top alternatives."""
    out: list[dict[str, Any] | None] = []
    for lp in lps:
        if lp is None:
            out.append(None)
            continue
        pairs = [(lp.token_id, lp.logprob), *lp.top]
        out.append({str(t): {"logprob": v, "decoded_token": name(t)} for t, v in pairs})
    return out


def completion_response(
    header: ResponseHeader,
    text: str,
    finish_reason: str | None,
    usage: Usage,
    logprobs: LegacyLogprobs | None,
    prompt_logprobs: list[dict[str, Any] | None] | None,
) -> dict[str, Any]:
    body = completion_chunk(header, text, finish_reason, logprobs, prompt_logprobs)
    body["usage"] = usage.to_dict()
    return body


def completion_chunk(
    header: ResponseHeader,
    text: str,
    finish_reason: str | None,
    logprobs: LegacyLogprobs | None,
    prompt_logprobs: list[dict[str, Any] | None] | None = None,
) -> dict[str, Any]:
    choice: dict[str, Any] = {
        "index": 0,
        "text": text,
        "logprobs": None if logprobs is None else logprobs.to_dict(),
        "finish_reason": finish_reason,
    }
    if prompt_logprobs is not None:
        choice["prompt_logprobs"] = prompt_logprobs
    return {
        "id": header.response_id,
        "object": "text_completion",
        "created": header.created_s,
        "model": header.model,
        "choices": [choice],
    }


def chat_response(
    header: ResponseHeader,
    text: str,
    finish_reason: str | None,
    usage: Usage,
    logprobs: list[dict[str, Any]] | None,
    prompt_logprobs: list[dict[str, Any] | None] | None,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": header.response_id,
        "object": "chat.completion",
        "created": header.created_s,
        "model": header.model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None if logprobs is None else {"content": logprobs},
                "finish_reason": finish_reason,
            }
        ],
        "usage": usage.to_dict(),
    }
    if prompt_logprobs is not None:
        body["prompt_logprobs"] = prompt_logprobs
    return body


def chat_chunk(
    header: ResponseHeader,
    delta: dict[str, Any],
    finish_reason: str | None,
    logprobs: list[dict[str, Any]] | None,
) -> dict[str, Any]:
    return {
        "id": header.response_id,
        "object": "chat.completion.chunk",
        "created": header.created_s,
        "model": header.model,
        "choices": [
            {
                "index": 0,
                "delta": delta,
                "logprobs": None if logprobs is None else {"content": logprobs},
                "finish_reason": finish_reason,
            }
        ],
    }


def usage_chunk(header: ResponseHeader, obj: str, usage: Usage) -> dict[str, Any]:
    return {
        "id": header.response_id,
        "object": obj,
        "created": header.created_s,
        "model": header.model,
        "choices": [],
        "usage": usage.to_dict(),
    }


def sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


SSE_DONE = sse("[DONE]")
