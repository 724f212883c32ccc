"""A small non-streaming OpenAI-completions client shared by the accuracy and canary checks.

The load generator (benchsuite.load.loadgen, benchsuite.load.stream_client) owns streaming and timing; these
checks only need the final text, tokens and logprobs of greedy completions, so they use plain JSON requests.
A server that cannot be reached, times out or answers something that is not a completion is a
RunError naming the URL (one line on stderr, never a traceback or a made-up result).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp

from benchsuite.errors import RunError


@dataclass(frozen=True)
class Completion:
    text: str
    tokens: tuple[str, ...]  # generated tokens as the engine spells them (empty without logprobs)
    token_logprobs: tuple[float, ...]  # logprob of each generated token, same order
    prompt_tokens: int | None
    completion_tokens: int | None


@asynccontextmanager
async def _transport_errors(url: str) -> AsyncIterator[None]:
    try:
        yield
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        detail = str(exc) or type(exc).__name__
        raise RunError(f"{url}: {detail}") from None
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
        raise RunError(f"{url}: not an OpenAI-style answer ({type(exc).__name__}: {exc})") from None


async def model_name(session: aiohttp.ClientSession, base_url: str) -> str:
    """The first model id the server lists (what requests must name)."""
    url = f"{base_url}/v1/models"
    async with _transport_errors(url):
        async with session.get(url) as resp:
            if resp.status != 200:
                raise RunError(f"{url} answered HTTP {resp.status}")
            body = json.loads(await resp.text())
        data = body.get("data") or []
        if not data:
            raise RunError(f"{url} lists no model")
        return str(data[0]["id"])


def parse_logprobs(lp: dict[str, Any]) -> tuple[tuple[str, ...], tuple[float, ...]]:
    """Generated tokens and their logprobs from a completion choice's `logprobs`, in either shape:
    legacy completions (`tokens` + `token_logprobs`: the built-in engine, vLLM, SGLang) or a list
    of entries under `content` (`token` + `logprob`: llama-server's /v1/completions, chat style)."""
    if lp.get("content") is not None:
        entries = lp["content"]
        return tuple(str(e["token"]) for e in entries), tuple(float(e["logprob"]) for e in entries)
    return tuple(str(t) for t in lp.get("tokens") or ()), tuple(float(x) for x in lp.get("token_logprobs") or ())


async def complete(
    session: aiohttp.ClientSession,
    base_url: str,
    model: str,
    prompt: str | list[int],
    max_tokens: int,
    *,
    logprobs: bool = False,
    extras: dict[str, Any] | None = None,
) -> Completion:
    """One greedy, non-streaming /v1/completions request; RunError names the failure."""
    payload: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": False,
    }
    if logprobs:
        payload["logprobs"] = 1
    payload.update(extras or {})
    url = f"{base_url}/v1/completions"
    async with _transport_errors(url):
        async with session.post(url, json=payload) as resp:
            body_text = await resp.text()
            if resp.status != 200:
                raise RunError(f"{url} answered HTTP {resp.status}: {body_text[:200]}")
        body = json.loads(body_text)
        choice = body["choices"][0]
        usage = body.get("usage") or {}
        tokens, token_logprobs = parse_logprobs(choice.get("logprobs") or {})
    if logprobs and len(tokens) != len(token_logprobs):
        raise RunError(f"{base_url}: {len(tokens)} tokens but {len(token_logprobs)} logprobs in one response")
    if logprobs and not tokens and usage.get("completion_tokens"):
        raise RunError(f"{url}: logprobs were asked for but the answer carries none (the engine ignores `logprobs`)")
    return Completion(
        text=str(choice.get("text", "")),
        tokens=tokens,
        token_logprobs=token_logprobs,
        prompt_tokens=usage.get("prompt_tokens"),
        completion_tokens=usage.get("completion_tokens"),
    )
