"""The SGLang adapter's HTTP side end to end, against the built-in server standing in for the
endpoint (`python -m paged_experts.server` on loopback): the Prometheus scrape, the request extras
through the real load generator, and the cache flush. SGLang itself is not run here."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio

from benchsuite.engines.base import Fairness, ServerSpec
from benchsuite.engines.sglang.adapter import SGLangAdapter, SGLangOptions, scrape_prometheus
from benchsuite.load import loadgen
from benchsuite.load.openai_http import model_name
from benchsuite.records import LoadRequest
from benchsuite.run.process import EngineProcess, free_port
from paged_experts.weights.synth import ensure_tiny

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

CAPTURE = ServerSpec(
    "sgl", "sglang", SGLangOptions(model_path="/m", mode="unpaged", return_routed_experts=True),
    Fairness(512, False), 2, "id",
)  # fmt: skip


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def base_url(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[str]:
    port = free_port()
    argv = [sys.executable, "-m", "paged_experts.server", "--model-path", str(ensure_tiny()), "--port", str(port),
            "--mode", "paged", "--paged-experts-num-resident", "4", "--max-total-tokens", "512",
            "--max-running-requests", "2"]  # fmt: skip
    log = Path(tmp_path_factory.mktemp("builtin")) / "server.log"
    async with EngineProcess(argv, {}, log, f"http://127.0.0.1:{port}/health", 240):
        yield f"http://127.0.0.1:{port}"


@pytest_asyncio.fixture(loop_scope="module")
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


async def test_scrape_and_extras_through_the_load_generator(base_url: str, session: aiohttp.ClientSession) -> None:
    adapter = SGLangAdapter()
    # A real Prometheus endpoint without sglang:* series reads as "no such series", not as None or 0.
    assert await adapter.scrape(session, base_url) == {}
    before = await scrape_prometheus(session, base_url, "paged_experts:")
    assert before is not None and "paged_experts:num_requests_total" in before
    requests = [LoadRequest(f"p{i}", "short", f"hello number {i}", max_tokens=5) for i in range(2)]
    records = await loadgen.run_load(
        base_url, requests, loadgen.LoadSpec(concurrency=2), cell_id="c", session=session,
        model_name=await model_name(session, base_url), extras=adapter.request_extras(CAPTURE), cold_first=False,
    )  # fmt: skip
    assert [r.ok for r in records] == [True, True], [r.error for r in records]
    after = await scrape_prometheus(session, base_url, "paged_experts:")
    assert after is not None
    assert after["paged_experts:num_requests_total"] - before["paged_experts:num_requests_total"] == 2
    generated = after["paged_experts:generation_tokens_total"] - before["paged_experts:generation_tokens_total"]
    assert generated == sum(r.output_tokens or 0 for r in records) == 10


async def test_flush_and_missing_metrics(base_url: str, session: aiohttp.ClientSession) -> None:
    async with session.post(base_url + SGLangAdapter.flush_cache_path) as resp:
        assert resp.status == 200
    # No /metrics there: the counters are absent (None), never zeros.
    assert await SGLangAdapter().scrape(session, base_url + "/no-such-prefix") is None
