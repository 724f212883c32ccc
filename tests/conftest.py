"""Shared fixtures. Keep this small: a fixture belongs here only when several test modules need it."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A freshly generated `tiny` checkpoint (HF layout + tokenizer), once per test session."""
    from paged_experts.weights.synth import write_checkpoint

    return write_checkpoint("tiny", tmp_path_factory.mktemp("tiny") / "ckpt")


@pytest.fixture(scope="module")
def torch_one_thread():
    """Tiny matmuls on a shared 2-core box run ~30x faster single-threaded than contended.
    Use with `pytestmark = pytest.mark.usefixtures("torch_one_thread")`."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


async def wait_healthy(url: str, timeout_s: float = 30.0) -> None:
    """Poll `url`/health until it answers 200 (the built-in server loads its model after binding)."""
    import asyncio

    import aiohttp

    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    async with aiohttp.ClientSession() as session:
        while loop.time() < deadline:
            async with session.get(f"{url}/health") as resp:
                if resp.status == 200:
                    return
            await asyncio.sleep(0.05)
    raise AssertionError(f"{url} never became healthy within {timeout_s} s")


@pytest.fixture(scope="session")
def healthy():
    """The `wait_healthy` coroutine function, for tests that start servers in-process."""
    return wait_healthy
