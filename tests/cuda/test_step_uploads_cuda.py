"""CUDA checks of the host tensors a model step sends to the device (paged_experts/upload.py):
- the causal mask built on the device equals the one built on the host, value for value;
- a paged prefill step with a synthetic router (ids known on the host) issues no copy from pageable host memory
  (torch's profiler names each copy's source), where it issued nine a step before (the rope tables, the token ids,
  the KV rows, the logits index, the mask, the router's request and position ids): such a copy can block the
  issuing thread, and a paged prefill's host is its bound; the control, one pageable `.to()`, must be seen.

Plain functions, so the module also runs as a script: `python tests/cuda/test_step_uploads_cuda.py`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from paged_experts.attention import causal_mask
from paged_experts.kv import KvPool
from paged_experts.model import MoeCausalLM, SeqChunk
from paged_experts.routing.sources import make_router
from paged_experts.runtime import RuntimeConfig

try:
    import pytest

    pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
except ImportError:  # script mode
    pass

QWEN2 = "synth:qwen3-30b-a3b-shape?layers=2&seed=0"
PROMPT = [(37 * i + 11) % 1000 for i in range(600)]


def pageable_uploads(run: Callable[[], object]) -> int:
    """How many host-to-device copies from pageable memory `run` issues (torch's profiler's memcpy events)."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    return sum(e.count for e in prof.key_averages() if "Pageable -> Device" in e.key)


def test_the_causal_mask_built_on_the_device_equals_the_hosts() -> None:
    for start, n in ((0, 1), (0, 600), (37, 5), (1024, 2048)):
        for dtype in (torch.bfloat16, torch.float32):
            host = causal_mask(start, n, dtype)
            device = causal_mask(start, n, dtype, torch.device("cuda"))
            assert device.device.type == "cuda" and torch.equal(device.cpu(), host), (start, n, dtype)


def test_a_paged_prefill_step_uploads_nothing_from_pageable_memory() -> None:
    model = MoeCausalLM.from_pretrained(
        QWEN2, RuntimeConfig(device="cuda", dtype="bfloat16", mode="paged", resident_experts=32)
    )
    model.router_override = make_router("qwen3-30b-a3b", model.config, seed=1)
    pool = KvPool.for_model(model, capacity_tokens=2048)

    def prefill() -> None:
        model.forward([SeqChunk(pool.new_sequence(), PROMPT, 0)])

    prefill()  # warm-up: kernels compiled, allocator blocks made
    assert pageable_uploads(lambda: torch.arange(1024).to("cuda")) >= 1  # control: the profiler sees one
    assert pageable_uploads(prefill) == 0


if __name__ == "__main__":
    from _script import run_tests

    raise SystemExit(run_tests(globals()))
