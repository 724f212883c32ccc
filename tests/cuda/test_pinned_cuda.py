"""CUDA checks of the exact-size pinned store (paged_experts/residency/pinned.py) with the real driver calls:
- one registration of exactly the three tensors' bytes rounded to 4 KiB (torch would pin 2^k each);
- the views and their slices are pinned, and a `non_blocking` copy from them is asynchronous;
- non_blocking row copies and the Triton page-in kernel (`copy_kernel.copy_planned`, which reads
  the store through its host address) copy exactly the source rows;
- deleting the store unregisters it (the driver says success, the ledger returns to 0).

Plain functions, so the module also runs as a script: `python tests/cuda/test_pinned_cuda.py`.
"""

from __future__ import annotations

import gc
import time

import torch
from _script import check_copy_planned  # tests/cuda is on sys.path (pytest's rootdir import, or script mode)

from paged_experts.residency import pinned
from paged_experts.residency.store import ExpertTensors

try:
    import pytest

    pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
except ImportError:  # script mode
    pass

E, H, INTER = 16, 2048, 768  # Qwen3-30B-A3B expert shapes, 16 experts: 48 MiB per tensor, not a power of two


class RecordingDriver(pinned.CudaDriver):
    """The real driver calls, with the codes cuMemHostUnregister answered."""

    def __init__(self) -> None:
        super().__init__()
        self.unregister_codes: list[int] = []

    def unregister(self, ptr: int) -> int:
        code = super().unregister(ptr)
        self.unregister_codes.append(code)
        return code


def filled_store(driver: pinned.CudaDriver | None = None) -> ExpertTensors:
    if driver is None:
        store = ExpertTensors.empty(E, H, INTER, torch.bfloat16, torch.device("cpu"), pin=True)
    else:
        gate, up, down = pinned.empty_pinned([(E, INTER, H), (E, INTER, H), (E, H, INTER)], torch.bfloat16, driver)
        store = ExpertTensors(gate=gate, up=up, down=down)
    gen = torch.Generator().manual_seed(0)
    for name in ("gate", "up", "down"):
        t = store.get(name)
        t.copy_(torch.randn(t.shape, generator=gen).to(torch.bfloat16))
    return store


def test_store_is_registered_at_its_exact_size() -> None:
    assert pinned.method() == "register", f"{pinned.ENV} selects torch's allocator"
    before = pinned.stats()
    store = filled_store()
    after = pinned.stats()
    assert after.fallback_reasons == (), f"fell back to torch's allocator: {after.fallback_reasons}"
    exact = 3 * E * H * INTER * 2  # 3 x 48 MiB, already a multiple of 4 KiB
    assert (
        after.registered_bytes - before.registered_bytes
        == exact
        == pinned.plan([(E, INTER, H), (E, INTER, H), (E, H, INTER)], torch.bfloat16).total_bytes
    )
    assert after.torch_rounded_bytes == before.torch_rounded_bytes  # nothing through torch's allocator
    for name in ("gate", "up", "down"):
        assert store.get(name).is_pinned(), name
        assert store.get(name)[3:5].is_pinned(), f"slice of {name}"


def test_non_blocking_copies_are_asynchronous_and_exact() -> None:
    store = filled_store()
    dev = ExpertTensors.empty(4, H, INTER, torch.bfloat16, torch.device("cuda"))
    torch.cuda.synchronize()
    torch.cuda._sleep(400_000_000)  # ~0.2 s of GPU clocks queued before the copies
    t0 = time.perf_counter()
    for name in ("gate", "up", "down"):
        dev.get(name)[1:4].copy_(store.get(name)[9:12], non_blocking=True)
    enqueue_s = time.perf_counter() - t0
    done = torch.cuda.Event()
    done.record()
    # A copy from pageable memory first waits for the stream's earlier work (the sleep).
    assert enqueue_s < 0.05 and not done.query(), f"the host waited for the copies: enqueue took {enqueue_s:.3f} s"
    torch.cuda.synchronize()
    for name in ("gate", "up", "down"):
        assert torch.equal(dev.get(name)[1:4].cpu(), store.get(name)[9:12]), name


def test_page_in_kernel_reads_the_registered_store() -> None:
    check_copy_planned(filled_store(), 13, 2)


def test_deleting_the_store_unregisters_it() -> None:
    gc.collect()
    before = pinned.stats()
    driver = RecordingDriver()
    store = filled_store(driver)
    want = store.down[5].clone()
    torch.cuda._sleep(200_000_000)  # so the copy below is still queued when the store goes
    row = store.down[5:6].to("cuda", non_blocking=True)  # [1, H, I]
    assert pinned.stats().registered_blocks == before.registered_blocks + 1
    del store
    gc.collect()
    assert driver.unregister_codes == [0]
    after = pinned.stats()
    assert (after.registered_bytes, after.registered_blocks) == (before.registered_bytes, before.registered_blocks)
    assert torch.equal(row[0].cpu(), want)  # the release waited for the copy before unmapping


if __name__ == "__main__":
    from _script import run_tests

    raise SystemExit(run_tests(globals()))
