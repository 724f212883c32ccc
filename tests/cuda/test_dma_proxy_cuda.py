"""CUDA checks of the DMA proxy (residency/dma_proxy.py, RuntimeConfig.overlap_copies='dma'):
- rung from a captured CUDA graph, its host thread copies exactly the planned FP8 rows (weights and scales)
  into their slots with the copy engine, replay after replay with new plans, and the graph's wait sees them;
- overlapped paged decode with the proxy's copies equals resident bit for bit (eager steps, triton experts,
  1 and 2 groups), and graphed equals eager (tests/graph_check.py);
- a graph whose proxy has stopped does not hang: its wait gives up and `check` says so.

Plain functions, so the module also runs as a script: `python tests/cuda/test_dma_proxy_cuda.py`.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import torch
from test_device_paging_cuda import QWEN2, check_graphed_paged, decode, rt

from paged_experts.model import MoeCausalLM
from paged_experts.residency.dma_proxy import DmaProxy, DmaProxyError
from paged_experts.residency.store import ExpertTensors

try:
    import pytest

    pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
except ImportError:  # script mode
    pass

E, K, H, INTER = 12, 6, 256, 384  # FP8 rows with 128x128 block scales


def _fp8_layer() -> tuple[ExpertTensors, ExpertTensors]:
    host = ExpertTensors.empty(E, H, INTER, torch.bfloat16, torch.device("cpu"), pin=True, is_fp8=True)
    slots = ExpertTensors.empty(K + 1, H, INTER, torch.bfloat16, torch.device("cuda"), is_fp8=True)
    g = torch.Generator().manual_seed(3)
    for name in host.names():
        raw = host.get(name).view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, generator=g, dtype=torch.uint8))
        slots.get(name).view(torch.uint8).fill_(7)
    return host, slots


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8).cpu()


def test_proxy_copies_planned_rows_from_a_captured_graph() -> None:
    host, slots = _fp8_layer()
    proxy = DmaProxy(torch.device("cuda"), max_pairs=8)
    try:
        table = proxy.table(host, slots)
        experts = torch.full((8,), E, dtype=torch.long, device="cuda")  # static plan, padded with E
        slot_ids = torch.full((8,), K, dtype=torch.long, device="cuda")
        names = ("gate", "up", "gate_scale", "up_scale")

        seen = {n: torch.empty_like(slots.get(n).view(torch.uint8)) for n in slots.names()}

        def step() -> None:
            first = proxy.ring(table, experts, slot_ids, DmaProxy.mask(host, names))
            last = proxy.ring(table, experts, slot_ids, DmaProxy.mask(host, ("down", "down_scale")))
            proxy.wait(first)
            proxy.wait(last)
            for n in slots.names():  # what the graph's own stream reads after its waits
                seen[n].copy_(slots.get(n).view(torch.uint8))

        step()  # eager: compiles the kernels (nothing planned: padding only)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        want = {n: _bytes(slots.get(n)) for n in slots.names()}
        plans = [([3, 11, E, 0], [0, 5, K, 2]), ([7, E, E, E], [1, K, K, K]), ([1, 2, 4, 9], [3, 4, 0, 5])]
        for planned_experts, planned_slots in plans:
            experts[:4].copy_(torch.tensor(planned_experts))
            slot_ids[:4].copy_(torch.tensor(planned_slots))
            graph.replay()
            proxy.replayed(2)  # the host's count of tickets: the captured step rings twice
            torch.cuda.synchronize()
            proxy.check()
            for e, s in zip(planned_experts, planned_slots):
                if e < E:
                    for n in slots.names():
                        want[n][s] = _bytes(host.get(n))[e]
            for n in slots.names():
                assert torch.equal(_bytes(slots.get(n)), want[n]), n
                assert torch.equal(seen[n].cpu(), want[n]), f"{n}: the graph read its slots before they landed"
        stats = proxy.stats()
        assert stats["tickets"] == 2 + 2 * len(plans) == proxy.rung, (stats, proxy.rung)
        assert stats["copies"] == 6 * (3 + 1 + 4), stats  # six tensors of each planned row
    finally:
        proxy.close()


def test_a_wait_nothing_serves_or_a_failed_proxy_does_not_hang_the_gpu() -> None:
    """A wait for a ticket nobody rang gives up after its limit, the next at once; a thread stopped by a record it
    cannot serve makes its waits give up within 256 polls; `check` says which, after the step."""
    host, slots = _fp8_layer()
    proxy = DmaProxy(torch.device("cuda"), max_pairs=4, wait_limit=20_000)
    try:
        proxy.tick[9] = 10**6  # a ticket nobody rang
        proxy.wait(9)  # gives up after its 20,000 polls
        torch.cuda.synchronize()
        proxy.wait_limit = 10**7  # ~5 s of polls: the next wait must not spend them
        t0 = time.perf_counter()
        proxy.wait(9)  # gives up at once: an earlier wait gave up
        torch.cuda.synchronize()
        assert time.perf_counter() - t0 < 0.5
        with pytest.raises(DmaProxyError, match="gave up waiting for its page-ins"):
            proxy.check()
    finally:
        proxy.close()
    failed = DmaProxy(torch.device("cuda"), max_pairs=4, wait_limit=10**7)
    try:
        table = failed.table(host, slots)
        entry = failed.ring(
            table + 3, torch.tensor([1, E, E, E], device="cuda"), torch.tensor([0, K, K, K], device="cuda"), 1
        )
        t0 = time.perf_counter()
        failed.wait(entry)
        torch.cuda.synchronize()
        assert time.perf_counter() - t0 < 1.0  # within 256 polls of the failure, not the ~5 s limit
        with pytest.raises(DmaProxyError, match="a record named a table the proxy does not have"):
            failed.check()
    finally:
        failed.close()


HOLD_CYCLES = 40_000_000  # ~20 ms of GPU clock: the ring runs after the host issued what follows it


def _barriers() -> dict[str, Callable[[], object]]:
    """Host calls CUDA documents as implicit synchronization (nothing issued after runs beside what was issued
    before), each set up so that the call itself does what it is named for."""
    a, b = torch.zeros(1 << 20, device="cuda"), torch.ones(1 << 20, device="cuda")
    torch.cuda.empty_cache()  # so the allocation below asks the driver
    return {
        "device-to-device copy": lambda: a.copy_(b),
        "device allocation": lambda: torch.empty(256 << 20, dtype=torch.uint8, device="cuda"),
        "pinned host allocation": lambda: torch.empty(1 << 20, dtype=torch.uint8, pin_memory=True),
    }


def _first_launches() -> dict[str, Callable[[], object]]:
    """Host calls that load a kernel into the context for the first time, issued while the GPU's wait already
    spins (`_ring_then(after_wait=True)`). Why: CUDA loads modules lazily by default since 12.2
    (CUDA_MODULE_LOADING=LAZY), and its programming guide's Lazy Loading section warns that loading a kernel may
    need a context synchronization, so a kernel that spins until another party acts can deadlock against it. An
    eager decode step's first launch of a kernel, issued while its wait spun for the proxy, would block until the
    wait gave up, and the thread's copies behind it would land late: call 1's give-up on the H100 (2026-12-06,
    benchmarks/results/h200/2026-12-06-h100-dmaproxy). The control: the same script under CUDA_MODULE_LOADING=EAGER.
    It failed the hypothesis (2026-12-06, benchmarks/results/h200/2026-12-06-h100-packed-cd): under EAGER both torch
    first launches gave up too. Both are jiterator kernels, compiled and loaded by their first call in either mode;
    the already-loaded control and a Triton kernel's first launch (what an eager step's first call launches) tell a
    module load apart from any launch behind the spinning wait."""
    x = torch.rand(1 << 10, device="cuda") + 0.5
    y = x.mul(3.0)  # launched here once: the control below launches a kernel the context already holds
    torch.cuda.synchronize()
    return {
        # the control: if this gives up too, launching anything behind the wait does, and the harness is at fault
        "a launch of a kernel already loaded (mul, the control)": lambda: x.mul(3.0),
        # torch kernels this process never launched before (each is loaded on its first launch under LAZY; both
        # are jiterator kernels, compiled by NVRTC and loaded on their first call under either loading mode)
        "first launch of a torch kernel (special.i1e)": lambda: torch.special.i1e(x),
        "first launch of a torch kernel (special.ndtri)": lambda: torch.special.ndtri(x.clamp(0.01, 0.99)),
        # what an eager decode step launches for the first time: a Triton kernel, compiled (or read from Triton's
        # disk cache) and loaded into the context by the call itself
        "first launch of a Triton kernel": lambda: _triton_first_launch(y),
    }


def _triton_first_launch(x: torch.Tensor) -> torch.Tensor:
    """A Triton kernel new to this process (a constexpr no other call uses), launched once over x."""
    import triton
    import triton.language as tl

    @triton.jit
    def _scale(src, dst, n, FACTOR: tl.constexpr, BLOCK: tl.constexpr):  # noqa: N803 (Triton's constexpr style)
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        keep = offs < n
        tl.store(dst + offs, tl.load(src + offs, mask=keep) * FACTOR, mask=keep)

    out = torch.empty_like(x)
    _scale[(triton.cdiv(x.numel(), 256),)](x, out, x.numel(), FACTOR=time.time_ns() % 997 + 2, BLOCK=256)
    return out


def _ring_then(
    barrier: Callable[[], object], drain: bool, after_wait: bool = False
) -> tuple[DmaProxy, ExpertTensors, ExpertTensors]:
    """The GPU sleeps, then rings and waits, while the host issues `barrier` before the ring has run (or, with
    `after_wait`, after the wait kernel's launch: the GPU spins on it when the barrier's own work is issued): without
    a drain the thread queues its copies after the barrier; with one it has queued them before the host goes on."""
    host, slots = _fp8_layer()
    proxy = DmaProxy(torch.device("cuda"), max_pairs=4, wait_limit=400_000)  # ~0.2 s
    if not drain:
        proxy.drain = lambda: 0  # type: ignore[method-assign]
    table = proxy.table(host, slots)
    experts = torch.tensor([2, 9, E, E], device="cuda")
    slot_ids = torch.tensor([1, 4, K, K], device="cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(HOLD_CYCLES)
    entry = proxy.ring(table, experts, slot_ids, DmaProxy.mask(host, None))
    kept = None if after_wait else barrier()
    proxy.wait(entry)
    if after_wait:
        kept = barrier()
    torch.cuda.synchronize()
    del kept
    return proxy, host, slots


def test_rows_land_when_the_host_issues_implicitly_synchronizing_calls_before_the_ring_runs() -> None:
    """The host issues each of CUDA's implicitly synchronizing calls while the GPU has yet to ring (`ring` drains
    first): the wait sees its rows and does not give up. On an H100 (driver 580) they landed without the drain
    too (`hazards`): this checks the rows, not that the drain is needed."""
    for name, barrier in _barriers().items():
        proxy, host, slots = _ring_then(barrier, drain=True)
        try:
            proxy.check()
            for n in slots.names():
                for expert, slot in ((2, 1), (9, 4)):
                    assert torch.equal(_bytes(slots.get(n))[slot], _bytes(host.get(n))[expert]), (name, n)
        finally:
            proxy.close()


def hazards() -> None:
    """Script mode (`python tests/cuda/test_dma_proxy_cuda.py hazards`): which of those calls make an undrained
    wait give up on this machine (none of `_barriers` on an H100, driver 580, 2026-12-06), then the first launches
    of `_first_launches` issued while the wait spins, drained and not (the drain cannot help there: the wait
    already spins when the host launches). CUDA_MODULE_LOADING=EAGER was the lazy-loading hypothesis's control (it gave
    up too, 2026-12-06); the already-loaded launch is the harness's."""
    import os

    print(f"CUDA_MODULE_LOADING={os.environ.get('CUDA_MODULE_LOADING', '(unset: LAZY since CUDA 12.2)')}")
    cases = [(f"{name}, before the ring runs", b, False) for name, b in _barriers().items()]
    cases += [(f"{name}, while the wait spins", b, True) for name, b in _first_launches().items()]
    for name, barrier, after_wait in cases:
        started = time.perf_counter()
        proxy, _, _ = _ring_then(barrier, drain=False, after_wait=after_wait)
        took_ms = (time.perf_counter() - started) * 1e3
        try:
            proxy.check()
            print(f"{name}: the wait saw its rows ({took_ms:.0f} ms)")
        except DmaProxyError as e:
            print(f"{name}: {e} ({took_ms:.0f} ms)")
        finally:
            proxy.close()


def test_the_proxy_refuses_to_start_inside_a_capture() -> None:
    """Its counters are zeroed when it starts: inside a capture that would be a memset every replay."""
    from paged_experts.residency import dma_proxy

    saved = dict(dma_proxy._PROXIES)
    dma_proxy._PROXIES.clear()
    try:
        graph = torch.cuda.CUDAGraph()
        with pytest.raises(DmaProxyError, match="must start before a CUDA graph capture"):
            with torch.cuda.graph(graph):
                dma_proxy.for_device(torch.device("cuda"), 8)
    finally:
        dma_proxy._PROXIES.update(saved)


def test_overlapped_decode_with_dma_copies_equals_resident() -> None:
    prompts = [[5, 17, 300, 41, 9, 77, 3, 8], [800, 2, 64]]
    resident_rt = rt("bfloat16", mode="resident", kernel_backend="triton")
    resident = decode(MoeCausalLM.from_pretrained(QWEN2, resident_rt), prompts, steps=6)
    for groups in (1, 2):
        runtime = rt(
            "bfloat16", mode="paged", resident_experts=16, overlap_page_in=True, overlap_groups=groups,
            overlap_copies="dma", kernel_backend="triton",
        )  # fmt: skip
        model = MoeCausalLM.from_pretrained(QWEN2, runtime)
        for i, (a, b) in enumerate(zip(decode(model, prompts, steps=6), resident)):
            assert torch.equal(a, b), f"G={groups}: output {i} differs by {(a - b).abs().max().item()}"
        assert model.counters.snapshot().total.misses > 0


def test_graphed_decode_with_dma_copies_matches_eager() -> None:
    check_graphed_paged(overlap=True, backend="triton", copies="dma")
    check_graphed_paged(overlap=True, groups=3, backend="triton", compile_layers=True, copies="dma")


if __name__ == "__main__":
    if sys.argv[1:] == ["hazards"]:
        hazards()
        sys.exit(0)
    for name, fn in list(globals().items()):
        if name.startswith("test_") and callable(fn):
            print(name)
            fn()
    sys.exit(0)
