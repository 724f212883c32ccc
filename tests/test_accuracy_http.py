"""`benchsuite accuracy` over real HTTP against built-in servers on the tiny checkpoint.

Paged (K = top_k, so every step pages and runs several waves) against resident must pass; the
same comparison with a fault injected into the paged side must fail. The fault is the one
DESIGN.md section 4 names: a per-expert tensor that page-in forgets, so paged experts run with
another expert's values. It is injected through the server's loader seam
(`serve.create_app(config, loader)`) and `paged_experts.residency.store.EXPERT_TENSORS` (the tuple page-in
walks), so no production code carries a fault flag.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from conftest import wait_healthy  # tests/ is on sys.path under pytest

import paged_experts.residency.store
from benchsuite.checks import accuracy
from benchsuite.cli import main as cli_main
from benchsuite.engines.base import Fairness
from benchsuite.engines.llamacpp.adapter import find_binary
from benchsuite.errors import RunError
from benchsuite.load.datasets import bundled_prompts
from paged_experts.server.app import create_app
from paged_experts.server.launch import Serving, load_serving
from paged_experts.server.options import ServeOptions

PROMPTS = [(p.prompt_id, p.text) for p in bundled_prompts()[:4]]
MAX_TOKENS = 12


async def serve(config: ServeOptions, loader: Callable[..., Serving] = load_serving) -> tuple[TestServer, str]:
    server = TestServer(create_app(config, loader), host="127.0.0.1")
    await server.start_server()
    url = str(server.make_url("")).rstrip("/")
    await wait_healthy(url)
    return server, url


@pytest.fixture
async def resident_url(tiny_model_dir: Path) -> AsyncIterator[str]:
    server, url = await serve(ServeOptions(model_path=str(tiny_model_dir), max_total_tokens=512))
    yield url
    await server.close()


async def test_paged_equals_resident_over_http_and_the_cli_passes(
    tiny_model_dir: Path, resident_url: str, tmp_path: Path
) -> None:
    paged, paged_url = await serve(
        ServeOptions(model_path=str(tiny_model_dir), mode="paged", resident_experts=4, max_total_tokens=512)
    )
    try:
        report = await accuracy.run_accuracy(resident_url, paged_url, PROMPTS, max_tokens=MAX_TOKENS)
        assert report.passed, accuracy.format_report(report)
        assert report.token_agreement == 1.0 and report.first_divergences == (None,) * len(PROMPTS)
        assert all(c.tokens_a == c.tokens_b == MAX_TOKENS for c in report.comparisons)
        assert report.max_logprob_diff_nats is not None and report.max_logprob_diff_nats < 1e-3
        out = tmp_path / "accuracy.json"
        argv = [
            "accuracy",
            "--a",
            resident_url,
            "--b",
            paged_url + "/",
            "--prompts",
            "2",
            "--max-tokens",
            "6",
            "--json-out",
            str(out),
        ]
        assert await asyncio.to_thread(cli_main, argv) == 0
        saved = json.loads(out.read_text())
        assert saved["passed"] is True and len(saved["comparisons"]) == 2
    finally:
        await paged.close()


async def test_a_page_in_that_skips_one_expert_tensor_fails_the_check(
    tiny_model_dir: Path, resident_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every page-in in this process now copies gate and up but not down: slots keep the evicted
    # expert's down projection. The resident server never pages, so only the paged side is wrong.
    monkeypatch.setattr(paged_experts.residency.store, "EXPERT_TENSORS", ("gate", "up"))
    faulty, faulty_url = await serve(
        ServeOptions(model_path=str(tiny_model_dir), mode="paged", resident_experts=4, max_total_tokens=512)
    )
    try:
        report = await accuracy.run_accuracy(resident_url, faulty_url, PROMPTS, max_tokens=MAX_TOKENS)
        assert not report.passed, accuracy.format_report(report)
        # no crash, HTTP 200 everywhere: only the comparison shows it
        diverged = [d for d in report.first_divergences if d is not None]
        assert report.token_agreement < 0.5 and len(diverged) >= len(PROMPTS) // 2
        out = tmp_path / "accuracy.json"
        argv = [
            "accuracy",
            "--a",
            resident_url,
            "--b",
            faulty_url,
            "--prompts",
            "2",
            "--max-tokens",
            "6",
            "--json-out",
            str(out),
        ]
        assert await asyncio.to_thread(cli_main, argv) == 1
        assert json.loads(out.read_text())["passed"] is False
    finally:
        await faulty.close()


async def test_an_unreachable_engine_is_an_error_not_a_result(
    resident_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from benchsuite.run.process import free_port

    dead = f"http://127.0.0.1:{free_port()}"
    code = await asyncio.to_thread(cli_main, ["accuracy", "--a", resident_url, "--b", dead, "--prompts", "1"])
    err = capsys.readouterr().err
    assert code != 0 and "PASS" not in err and "Traceback" not in err


def fake_engine(logprobs: dict[str, Any] | None) -> web.Application:
    """An endpoint answering every completion with the same two tokens and `logprobs` as given."""

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake"}]})

    async def completions(request: web.Request) -> web.Response:
        choice: dict[str, Any] = {"index": 0, "text": "ab", "finish_reason": "length"}
        if logprobs is not None:
            choice["logprobs"] = logprobs
        usage = {"prompt_tokens": 3, "completion_tokens": 2}
        return web.json_response({"object": "text_completion", "choices": [choice], "usage": usage})

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    return app


async def test_llama_server_shaped_logprobs_compare_with_legacy_ones() -> None:
    legacy = {"tokens": ["a", "b"], "token_logprobs": [-0.5, -0.25]}
    content = {"content": [{"id": 1, "token": "a", "logprob": -0.5}, {"id": 2, "token": "b", "logprob": -0.25}]}
    a, b = TestServer(fake_engine(legacy), host="127.0.0.1"), TestServer(fake_engine(content), host="127.0.0.1")
    await a.start_server()
    await b.start_server()
    try:
        url_a, url_b = str(a.make_url("")).rstrip("/"), str(b.make_url("")).rstrip("/")
        report = await accuracy.run_accuracy(url_a, url_b, PROMPTS[:2], max_tokens=2)
        assert report.passed and report.token_agreement == 1.0 and report.max_logprob_diff_nats == 0.0
    finally:
        await a.close()
        await b.close()


async def test_an_engine_that_ignores_logprobs_is_an_error_not_a_fail_or_pass() -> None:
    server = TestServer(fake_engine(None), host="127.0.0.1")
    await server.start_server()
    try:
        url = str(server.make_url("")).rstrip("/")
        with pytest.raises(RunError, match="carries none"):
            await accuracy.run_accuracy(url, url, PROMPTS[:1], max_tokens=2)
    finally:
        await server.close()


@pytest.mark.llamacpp
@pytest.mark.skipif(
    find_binary() is None, reason="no llama-server on PATH or in the cache: run `benchsuite install llama-server`"
)
async def test_llama_server_against_itself_passes_through_the_cli(tmp_path: Path) -> None:
    from benchsuite.engines.base import ServerSpec
    from benchsuite.engines.llamacpp.adapter import LlamaCppAdapter, LlamaCppOptions
    from benchsuite.run.process import EngineProcess, free_port

    gguf = await asyncio.to_thread(
        LlamaCppAdapter().model_path,
        ServerSpec("a", "llamacpp", LlamaCppOptions(model="tiny"), Fairness(10240), 1, "a"),
    )
    port = free_port()
    argv = [str(find_binary()), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", "1", "-c", "1024"]
    async with EngineProcess(argv, {}, tmp_path / "llama.log", f"http://127.0.0.1:{port}/health", 120.0):
        url = f"http://127.0.0.1:{port}"
        out = tmp_path / "accuracy.json"
        argv_cli = ["accuracy", "--a", url, "--b", url, "--prompts", "3", "--max-tokens", "8", "--json-out", str(out)]
        assert await asyncio.to_thread(cli_main, argv_cli) == 0
        saved = json.loads(out.read_text())
    assert saved["passed"] and saved["token_agreement"] == 1.0
    assert all(c["matched"] > 0 for c in saved["comparisons"])  # logprobs were read, not an empty pass
