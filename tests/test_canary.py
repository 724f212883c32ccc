"""`benchsuite canary` over real HTTP: the built-in server passes; a deliberately leaking endpoint
(it answers each request with the previous request's prompt, like stale KV served with HTTP 200)
fails, through the library and through the CLI's exit status."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from benchsuite.checks import canary
from benchsuite.cli import main as cli_main
from benchsuite.engines.base import Fairness
from benchsuite.engines.llamacpp.adapter import find_binary
from paged_experts.server.app import create_app
from paged_experts.server.options import ServeOptions


async def start(app: web.Application) -> tuple[TestServer, str]:
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    return server, str(server.make_url("")).rstrip("/")


def leaking_app() -> web.Application:
    """An OpenAI-style endpoint whose answer to each request is the prompt of the one before."""
    previous = {"prompt": "nothing yet"}

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "leaky", "object": "model"}]})

    async def completions(request: web.Request) -> web.Response:
        body = await request.json()
        text, previous["prompt"] = previous["prompt"], str(body["prompt"])
        usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
        return web.json_response(
            {
                "object": "text_completion",
                "choices": [{"index": 0, "text": text, "finish_reason": "length"}],
                "usage": usage,
            }
        )

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    return app


@pytest.fixture
async def builtin_url(tiny_model_dir: Path, healthy) -> AsyncIterator[str]:
    config = ServeOptions(
        model_path=str(tiny_model_dir), mode="paged", resident_experts=8, max_total_tokens=1024, max_running_requests=8
    )
    server, url = await start(create_app(config))
    await healthy(url)
    yield url
    await server.close()


async def test_the_builtin_server_passes_sequential_and_concurrent(builtin_url: str, tmp_path: Path) -> None:
    report = await canary.run_canary(builtin_url, rounds=1, concurrency=4, max_tokens=8)
    assert report.passed, canary.format_report(report)
    # 8 solo + 8 sequential after the plant + 3 concurrent beside it
    assert report.requests_checked == 8 + 8 + 3
    assert report.leaks == () and report.interference == ()  # greedy output does not change with batching
    out = tmp_path / "canary.json"
    argv = [
        "canary",
        "--url",
        builtin_url,
        "--rounds",
        "1",
        "--concurrency",
        "2",
        "--max-tokens",
        "4",
        "--json-out",
        str(out),
    ]
    assert await asyncio.to_thread(cli_main, argv) == 0
    assert json.loads(out.read_text())["passed"] is True


async def test_an_endpoint_that_serves_the_previous_prompt_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server, url = await start(leaking_app())
    try:
        report = await canary.run_canary(url, rounds=1, concurrency=4, max_tokens=8, seed_marker="CANARY-00c0ffee0042")
        assert not report.passed
        assert any("sequential" in leak and "00c0ffee0042" in leak for leak in report.leaks)
        assert "FAIL (marker leaked)" in canary.format_report(report)
        out = tmp_path / "canary.json"
        argv = ["canary", "--url", url, "--rounds", "1", "--concurrency", "2", "--json-out", str(out)]
        assert await asyncio.to_thread(cli_main, argv) == 1
        assert json.loads(out.read_text())["leaks"]
        assert "result: FAIL" in capsys.readouterr().out
    finally:
        await server.close()


async def test_an_unreachable_endpoint_is_an_error_not_a_pass(capsys: pytest.CaptureFixture[str]) -> None:
    from benchsuite.run.process import free_port

    code = await asyncio.to_thread(cli_main, ["canary", "--url", f"http://127.0.0.1:{free_port()}", "--rounds", "1"])
    captured = capsys.readouterr()
    assert code == 1 and captured.err.startswith("benchsuite: error:") and "PASS" not in captured.out


@pytest.mark.llamacpp
@pytest.mark.skipif(
    find_binary() is None, reason="no llama-server on PATH or in the cache: run `benchsuite install llama-server`"
)
async def test_llama_server_passes(tmp_path: Path) -> None:
    from benchsuite.engines.base import ServerSpec
    from benchsuite.engines.llamacpp.adapter import LlamaCppAdapter, LlamaCppOptions
    from benchsuite.run.process import EngineProcess, free_port

    gguf = await asyncio.to_thread(
        LlamaCppAdapter().model_path,
        ServerSpec("c", "llamacpp", LlamaCppOptions(model="tiny"), Fairness(10240), 1, "c"),
    )
    port = free_port()
    argv = [
        str(find_binary()),
        "-m",
        str(gguf),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-t",
        "1",
        "-c",
        "2048",
        "-np",
        "4",
    ]
    async with EngineProcess(argv, {}, tmp_path / "llama.log", f"http://127.0.0.1:{port}/health", 120.0):
        report = await canary.run_canary(f"http://127.0.0.1:{port}", rounds=1, concurrency=4, max_tokens=8)
    assert report.passed and report.requests_checked == 8 + 8 + 3, canary.format_report(report)


@pytest.mark.slow
def test_a_run_with_canary_true_stores_the_verdict_per_server(tiny_model_dir: Path, tmp_path: Path) -> None:
    import yaml

    body = {
        "name": "canary-run",
        "output_root": str(tmp_path / "results"),
        "canary": True,
        "fairness": {"kv_capacity_tokens": 1024},
        "engines": {
            "paged": {
                "kind": "builtin",
                "options": {"model": str(tiny_model_dir), "mode": "paged", "resident_experts": 8},
            }
        },
        "workloads": {"w": {"output_tokens": 4, "concurrency": [2], "num_requests": 2, "warmup_requests": 0}},
    }
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump(body))
    assert cli_main(["run", str(path), "--quiet", "--no-report"]) == 0
    (run_dir,) = (tmp_path / "results").iterdir()
    (server,) = json.loads((run_dir / "manifest.json").read_text())["servers"].values()
    verdict = server["canary"]
    assert verdict["passed"] is True and verdict["leaks"] == [] and verdict["requests_checked"] > 8, verdict
