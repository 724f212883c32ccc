"""One model for every engine, through each engine's own server: llama-server (the CPU build) on the
GGUF `gguf_synth` writes for the tiny preset, with F32 tensors, and the built-in server (CPU,
float32) on the weightless directory of the same preset and seed produce the same greedy tokens
through `/v1/completions` (token-id prompts, temperature 0), and every generated token is text.

Agreement of a prompt = the length of the common prefix of the two continuations / tokens
generated (after a first difference the contexts differ, so later tokens say nothing). The two
engines hold the same fp32 weights bit for bit (tests/test_weightgen.py) and differ only in the
order of fp32 sums (ggml's SIMD dot products, its softmax, RoPE tables) and in llama.cpp's f16 KV
cache: a divergence is rounding only where both engines' top two logits are within a rounding
margin of each other there, which the test checks at every first divergence (MAX_TIE_MARGIN).
Measured 2026-12-02 (CPU llama-server of llama-cpp-python 0.3.36): agreement 1.000 over 8 prompts
x 64 tokens; the smallest top-2 gap met was 0.026 nats, and where both engines saw the same
context their gaps differed by at most 0.023 nats (gaps under 8 nats; past that llama-server's
float32 probabilities no longer resolve the second token): the rounding scale MAX_TIE_MARGIN allows.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from real_servers import TEXT_PROMPTS, builtin_server
from tokenizers import Tokenizer

from benchsuite.engines.base import Fairness, ServerSpec
from benchsuite.engines.llamacpp.adapter import LlamaCppAdapter, LlamaCppOptions, find_binary
from benchsuite.engines.llamacpp.gguf_synth import write_synthetic_gguf
from benchsuite.run.process import EngineProcess, free_port
from paged_experts.weights import weightgen
from paged_experts.weights.synth_memory import write_weightless

NEW_TOKENS = 16
AGREEMENT_FLOOR = 0.9
# Logprob gap between the top two tokens under which fp32 sums in another order (and an f16 KV
# cache) may swap them: logits here are ~16 wide, rounding moves them by ~1e-3 of that.
MAX_TIE_MARGIN = 0.05

needs_llama = [
    pytest.mark.llamacpp,
    pytest.mark.skipif(find_binary() is None, reason="no llama-server: run `benchsuite install llama-server`"),
]


def agreement(a: list[list[int]], b: list[list[int]]) -> tuple[float, list[int | None]]:
    """(common-prefix share of all tokens, the first divergence per prompt or None)."""
    matched = total = 0
    firsts: list[int | None] = []
    for x, y in zip(a, b, strict=True):
        first = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), None)
        matched += min(len(x), len(y)) if first is None else first
        total += max(len(x), len(y))
        firsts.append(first)
    return matched / total, firsts


def test_agreement_counts_the_common_prefix() -> None:
    assert agreement([[1, 2, 3], [4, 5, 6]], [[1, 2, 9], [4, 5, 6]]) == (5 / 6, [2, None])


async def _complete(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> dict[str, Any]:
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def _builtin(url: str, prompts: list[list[int]]) -> list[tuple[list[int], list[float], str]]:
    """Per prompt: generated ids, the top-2 logprob gap at each step, the text."""
    out = []
    async with aiohttp.ClientSession() as session:
        for ids in prompts:
            body = {"prompt": ids, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True,
                    "logprobs": 2, "return_tokens_as_token_ids": True}  # fmt: skip
            choice = (await _complete(session, url, body))["choices"][0]
            lp = choice["logprobs"]
            tokens = [int(t.removeprefix("token_id:")) for t in lp["tokens"]]
            gaps = [_gap(list(top.values())) for top in lp["top_logprobs"]]
            out.append((tokens, gaps, choice["text"]))
    return out


async def _llama(url: str, prompts: list[list[int]]) -> list[tuple[list[int], list[float], str]]:
    out = []
    # force_close: a pooled keep-alive connection to llama-server can be closed under it
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
        for ids in prompts:
            body = {"prompt": ids, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True,
                    "n_probs": 2, "cache_prompt": False}  # fmt: skip
            choice = (await _complete(session, url, body))["choices"][0]
            content = choice["logprobs"]["content"]
            tokens = [int(c["id"]) for c in content]
            gaps = [_gap([t["logprob"] for t in c["top_logprobs"]]) for c in content]
            out.append((tokens, gaps, choice["text"]))
    return out


def _gap(logprobs: list[float]) -> float:
    top = sorted(logprobs, reverse=True)
    return top[0] - top[1] if len(top) > 1 else float("inf")


@pytest.fixture(scope="module")
def one_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("one-model")
    hf_dir = write_weightless("tiny", root / "tiny", seed=0)
    g = write_synthetic_gguf(root / "tiny-f32.gguf", "tiny", seed=0, expert_type="f32", dense_type="f32", workers=1)
    return hf_dir, g.path


@needs_llama[0]
@needs_llama[1]
def test_llama_server_and_builtin_server_agree_on_one_model(one_model: tuple[Path, Path], tmp_path: Path) -> None:
    hf_dir, gguf_path = one_model
    tok = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    prompts = [tok.encode(p).ids for p in TEXT_PROMPTS]
    with builtin_server(hf_dir, tmp_path, "--device", "cpu", "--dtype", "float32") as url:
        ours = asyncio.run(_builtin(url, prompts))
    llama = asyncio.run(_run_llama(gguf_path, tmp_path, prompts))

    rate, firsts = agreement([o[0] for o in ours], [g[0] for g in llama])
    report = [f"greedy agreement (common prefix), built-in vs llama-server, one model: {rate:.3f} "
              f"over {len(prompts)} prompts x {NEW_TOKENS} tokens"]  # fmt: skip
    for i, first in enumerate(firsts):
        if first is None:
            continue
        a, b = ours[i][1][first], llama[i][1][first]
        report.append(
            f"prompt {i}: first divergence at token {first}: top-2 logprob gap built-in {a:.4f}, llama {b:.4f}"
        )
        assert min(a, b) < MAX_TIE_MARGIN, "\n".join(report)  # a divergence that is no near-tie is a bug
    # The rounding scale: where both engines saw the same context, how far their top-2 gaps differ.
    same_context = [
        (a, b)
        for o, g, first in zip(ours, llama, firsts, strict=True)
        for a, b in list(zip(o[1], g[1], strict=True))[: NEW_TOKENS if first is None else first + 1]
    ]
    # Gaps past ~8 nats are not resolved by llama-server's float32 probabilities (the top one rounds
    # to 1): the rounding scale is read where both gaps are under 8.
    resolved = [(a, b) for a, b in same_context if max(a, b) < 8]
    smallest = min(min(p) for p in same_context)
    largest = max(abs(a - b) for a, b in resolved)
    report.append(
        f"top-2 logprob gaps over {len(same_context)} same-context steps: smallest {smallest:.4f}; "
        f"largest difference between the engines' gaps (gaps < 8, {len(resolved)} steps) {largest:.5f}"
    )
    print("\n".join(report))
    assert rate >= AGREEMENT_FLOOR, "\n".join(report)

    _assert_visible(tok, [*ours, *llama])


def _assert_visible(tok: Tokenizer, outputs: list[tuple[list[int], list[float], str]]) -> None:
    silent = set(weightgen.silent_token_ids(tok))
    for tokens, _, text in outputs:
        assert len(tokens) == NEW_TOKENS
        assert not silent & set(tokens), "a generated token has no visible text"
        pieces = [tok.decode([t]) for t in tokens]
        assert all(p and "\ufffd" not in p for p in pieces), pieces  # each token alone is text
        assert text == tok.decode(tokens)


def test_builtin_server_streams_one_text_chunk_per_token(one_model: tuple[Path, Path], tmp_path: Path) -> None:
    """Without llama-server too: every greedy token of the generated model is visible text, so a
    stream's text chunks count its tokens (timing by text chunks and by tokens agree)."""
    hf_dir, _ = one_model
    tok = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    prompts = [tok.encode(p).ids for p in TEXT_PROMPTS]
    with builtin_server(hf_dir, tmp_path, "--device", "cpu", "--dtype", "float32") as url:
        ours = asyncio.run(_builtin(url, prompts))
        chunks = asyncio.run(_stream_text_chunks(url, prompts[0]))
    _assert_visible(tok, ours)
    assert len(chunks) == NEW_TOKENS and all(chunks), chunks
    assert "".join(chunks) == ours[0][2]


async def _stream_text_chunks(url: str, ids: list[int]) -> list[str]:
    body = {"prompt": ids, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True}
    texts = []
    async with aiohttp.ClientSession() as session, session.post(f"{url}/v1/completions", json=body) as resp:
        assert resp.status == 200
        async for raw in resp.content:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                choices = json.loads(line[len("data: ") :])["choices"]
                if choices and choices[0].get("text"):
                    texts.append(choices[0]["text"])
    return texts


async def _run_llama(
    gguf_path: Path, tmp_path: Path, prompts: list[list[int]]
) -> list[tuple[list[int], list[float], str]]:
    spec = ServerSpec("one", "llamacpp", LlamaCppOptions(model=str(gguf_path), threads=2),
                      Fairness(1024), 1, "one")  # fmt: skip
    port = free_port()
    plan = LlamaCppAdapter().launch_plan(spec, port)
    async with EngineProcess(plan.argv, plan.env, tmp_path / "llama.log", f"http://127.0.0.1:{port}/health", 120):
        return await _llama(f"http://127.0.0.1:{port}", prompts)
