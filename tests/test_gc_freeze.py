"""The built-in server freezes its heap for the garbage collector once loaded (gc_pauses.freeze_heap): a started
server has frozen objects, shown by `/metrics` gc_frozen_objects, none with --disable-gc-freeze, and gives them
back when it stops. Servers run in this process (a module of their own: the freeze is the process's)."""

from __future__ import annotations

import gc
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from paged_experts.server.app import create_app
from paged_experts.server.options import ServeOptions
from paged_experts.weights.synth import ensure_tiny

pytestmark = pytest.mark.asyncio(loop_scope="module")


@asynccontextmanager
async def started(healthy, **options: object) -> AsyncIterator[str]:
    config = ServeOptions(model_path=str(ensure_tiny()), max_total_tokens=64, **options)  # type: ignore[arg-type]
    server = TestServer(create_app(config), host="127.0.0.1")
    await server.start_server()
    try:
        url = str(server.make_url("")).rstrip("/")
        await healthy(url)
        yield url
    finally:
        await server.close()


async def frozen_gauge(url: str) -> float:
    async with aiohttp.ClientSession() as http, http.get(f"{url}/metrics") as resp:
        text = await resp.text()
    (line,) = [ln for ln in text.splitlines() if ln.startswith("paged_experts:gc_frozen_objects ")]
    return float(line.split()[1])


def walked(obj: object) -> bool:
    """Whether a collection walks `obj` (gc.get_objects lists the generations, not the frozen objects)."""
    return any(o is obj for o in gc.get_objects())


async def test_a_started_server_has_frozen_its_heap_and_gives_it_back_when_it_stops(healthy) -> None:
    gc.unfreeze()  # a server another module leaked would hold a freeze of its own
    before_load = [object()]  # a tracked object from before the server loads
    assert walked(before_load)
    async with started(healthy) as url:
        gauge = await frozen_gauge(url)
        assert gauge > 0 and gc.get_freeze_count() > 0
        assert not walked(before_load)  # frozen: full collections skip it
        async with aiohttp.ClientSession() as http:
            body = {"prompt": "one two three", "max_tokens": 3, "temperature": 0, "ignore_eos": True}
            async with http.post(f"{url}/v1/completions", json=body) as resp:
                assert resp.status == 200  # it serves once frozen
    assert gc.get_freeze_count() == 0 and walked(before_load)  # stopped: given back to the collector


async def test_with_the_freeze_off_nothing_is_frozen(healthy) -> None:
    gc.unfreeze()
    async with started(healthy, gc_freeze=False) as url:
        assert await frozen_gauge(url) == 0 and gc.get_freeze_count() == 0
