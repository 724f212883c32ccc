"""The DMA proxy (residency/dma_proxy.py, native/dma_proxy.c) on a machine without a GPU: its host thread
with the `host` backend (memcpy for the copies, host memory for `done`):
- records written as the ring kernel writes them (ticket last) are served in ticket order: exactly the
  planned rows of the masked tensors land in their slots, padding entries copy nothing, `done` gets each
  ticket, over several laps of the ring and several tables;
- a record naming an unknown table stops the thread with a one-line reason `check` raises;
- the ring and wait kernels, in Triton's interpreter (a child process), drive the same thread end to end
  through `DmaProxy.ring` / `wait`, and a wait with no proxy behind it gives up and is reported;
- the library builds from the package's source, and a missing compiler is a one-line error."""

from __future__ import annotations

import time

import pytest
import torch
from interpreted import run_interpreted

from paged_experts.residency import dma_proxy
from paged_experts.residency.dma_proxy import DmaProxy, DmaProxyError
from paged_experts.residency.store import ExpertTensors

E, K, H, INTER = 9, 4, 8, 6


def _filled(n: int, seed: int, is_fp8: bool = False) -> ExpertTensors:
    return random_bytes(ExpertTensors.empty(n, H, INTER, torch.float32, torch.device("cpu"), is_fp8=is_fp8), seed)


def random_bytes(t: ExpertTensors, seed: int) -> ExpertTensors:
    """t with random bytes in every tensor of its rows (the same bytes for either layout at one seed)."""
    g = torch.Generator().manual_seed(seed)
    for name in t.names():
        raw = t.get(name).view(torch.uint8)
        raw.copy_(torch.randint(1, 250, raw.shape, generator=g, dtype=torch.uint8))
    return t


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Byte equality (random bytes make NaNs, which no value comparison finds equal)."""
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _write_record(proxy: DmaProxy, ticket: int, table: int, experts: list[int], slots: list[int], mask: int) -> None:
    """What the ring kernel writes, ticket last."""
    w, p = proxy.record_words, proxy.max_pairs
    rec = proxy.ring_words[(ticket % proxy.ring_slots) * w : (ticket % proxy.ring_slots + 1) * w]
    rec[1], rec[2], rec[3] = table, len(experts), mask
    rec[4 : 4 + len(experts)] = torch.tensor(experts)
    rec[4 + p : 4 + p + len(slots)] = torch.tensor(slots)
    rec[0] = ticket


def _served(proxy: DmaProxy, ticket: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while proxy.stats()["tickets"] < ticket:
        proxy.check()
        assert time.monotonic() < deadline, f"ticket {ticket} not served: {proxy.stats()}"
        time.sleep(0.001)


@pytest.fixture
def proxy(tmp_path):
    p = DmaProxy(torch.device("cpu"), max_pairs=6, backend="host", ring_slots=4, cache_dir=tmp_path)
    yield p
    p.close()


@pytest.mark.parametrize("is_fp8", [False, True])
def test_records_copy_exactly_the_planned_rows_of_the_masked_tensors(proxy, is_fp8):
    host, slots = _filled(E, 1, is_fp8), _filled(K + 1, 2, is_fp8)
    before = {n: slots.get(n).clone() for n in slots.names()}
    table = proxy.table(host, slots)
    assert proxy.table(host, slots) == table  # registered once
    names = ("gate", "up", "gate_scale", "up_scale") if is_fp8 else ("gate", "up")
    mask = DmaProxy.mask(host, names)
    _write_record(proxy, 1, table, [7, E, 2, E], [0, K, 3, K], mask)  # two planned, two padding
    _served(proxy, 1)
    for name in slots.names():
        want = before[name].clone()
        if name in names:
            want[0], want[3] = host.get(name)[7], host.get(name)[2]
        assert _same(slots.get(name), want), name
    assert int(proxy.done[1]) == 1
    stats = proxy.stats()
    assert stats["copies"] == 2 * len(names)
    assert stats["bytes"] == sum(2 * host.get(n)[0].numel() * host.get(n).element_size() for n in names)


def test_tickets_are_served_in_order_over_laps_of_the_ring_and_tables(proxy):
    layers = [(_filled(E, 10 + i), _filled(K + 1, 20 + i)) for i in range(3)]
    tables = [proxy.table(h, s) for h, s in layers]
    assert len(set(tables)) == 3
    want = [s.gate.clone() for _, s in layers]
    for ticket in range(1, 4 * proxy.ring_slots + 2):  # several laps, one record in flight at a time
        layer = ticket % 3
        host, _ = layers[layer]
        expert, slot = ticket % E, ticket % K
        _write_record(proxy, ticket, tables[layer], [expert], [slot], DmaProxy.mask(host, None))
        _served(proxy, ticket)
        want[layer][slot] = host.gate[expert]
        assert int(proxy.done[ticket % proxy.ring_slots]) == ticket
    for (_, s), w in zip(layers, want):
        assert _same(s.gate, w)


def test_a_drain_returns_once_the_thread_has_queued_every_ring_counted(proxy):
    """`drain` waits for the host's count of rings (eager rings and replays): 0 once they are served, 1 at once
    when the thread stopped, and it never waits past its limit for a ring the GPU has not run."""
    host, slots = _filled(E, 1), _filled(K + 1, 2)
    table = proxy.table(host, slots)
    assert proxy.drain() == 0  # nothing rung
    proxy.replayed(2, drain=False)  # a graph that rings twice was launched; its records are written later
    _write_record(proxy, 1, table, [3], [1], 1)
    _write_record(proxy, 2, table, [4], [2], 1)
    assert proxy.drain() == 0
    assert proxy.stats()["tickets"] == proxy.rung == 2
    proxy.rung += 1  # a ring the "GPU" never runs: the drain gives up at its limit (shortened here)
    saved = dma_proxy.DRAIN_NS
    dma_proxy.DRAIN_NS = 50_000_000
    try:
        t0 = time.monotonic()
        assert proxy.drain() == 3
        assert 0.04 < time.monotonic() - t0 < 5
    finally:
        dma_proxy.DRAIN_NS = saved
    proxy.err[0] = 3  # a wait gave up: the drain returns at once
    assert proxy.drain() == 2
    proxy.err[0] = 0
    _write_record(proxy, 3, 7, [1], [0], 1)  # an unknown table stops the thread
    _fails_with(proxy, "a record named a table")
    proxy.rung += 1
    assert proxy.drain() == 1


def test_captures_count_their_rings_and_replays_add_them():
    """The module's per-device counts: what a capture rang (`rings_since`), added by each replay (`replayed`)."""
    saved = dict(dma_proxy._PROXIES)
    dma_proxy._PROXIES.clear()

    class Counted:
        captured, rung, drained = 0, 0, 0

        def replayed(self, rings: int, drain: bool = True) -> None:
            self.rung += rings
            self.drained += drain

    try:
        a, b = Counted(), Counted()
        dma_proxy._PROXIES.update({0: a, 1: b})  # type: ignore[dict-item]
        before = dma_proxy.captured_rings()
        a.captured += 5  # a capture on device 0 rang 5 times
        rings = dma_proxy.rings_since(before)
        assert rings == {0: 5}
        dma_proxy.replayed(rings)
        dma_proxy.replayed(rings, drain=False)
        assert (a.rung, a.drained, b.rung, b.drained) == (10, 1, 0, 0)
    finally:
        dma_proxy._PROXIES.clear()
        dma_proxy._PROXIES.update(saved)


def test_an_unknown_table_stops_the_thread_with_its_reason(proxy):
    _write_record(proxy, 1, 5, [1], [0], 1)
    deadline = time.monotonic() + 10
    with pytest.raises(DmaProxyError, match="at ticket 1: a record named a table the proxy does not have"):
        while time.monotonic() < deadline:
            proxy.check()
            time.sleep(0.001)
    proxy.close()
    proxy.close()  # idempotent


def _fails_with(proxy: DmaProxy, reason: str) -> None:
    deadline = time.monotonic() + 10
    with pytest.raises(DmaProxyError, match=reason):
        while time.monotonic() < deadline:
            proxy.check()
            time.sleep(0.001)


def test_a_lapped_ring_stops_the_thread_before_it_serves_an_overwritten_record(proxy):
    host, slots = _filled(E, 1), _filled(K + 1, 2)
    before = slots.gate.clone()
    table = proxy.table(host, slots)
    _write_record(proxy, 1 + proxy.ring_slots, table, [3], [0], 1)  # ticket 1's place, a lap later
    _fails_with(proxy, "at ticket 1: the ring lapped the proxy")
    assert _same(slots.gate, before)  # nothing copied


def test_a_slot_out_of_range_stops_the_thread(proxy):
    host, slots = _filled(E, 1), _filled(K + 1, 2)
    _write_record(proxy, 1, proxy.table(host, slots), [3], [K + 1], 1)  # K + 1 rows: K + 1 is past them
    _fails_with(proxy, "at ticket 1: a record named a slot out of range")


def test_a_closed_proxy_refuses_to_ring_or_register(proxy):
    host, slots = _filled(E, 1), _filled(K + 1, 2)
    table = proxy.table(host, slots)
    proxy.close()
    with pytest.raises(DmaProxyError, match="the DMA proxy is closed"):
        proxy.ring(table, torch.tensor([1]), torch.tensor([0]), 1)
    with pytest.raises(DmaProxyError, match="the DMA proxy is closed"):
        proxy.table(_filled(E, 3), _filled(K + 1, 4))


def test_a_row_that_differs_in_size_is_refused(proxy):
    host, slots = _filled(E, 1), ExpertTensors.empty(K + 1, H, INTER + 2, torch.float32, torch.device("cpu"))
    with pytest.raises(DmaProxyError, match="differ in size"):
        proxy.table(host, slots)


def test_a_missing_compiler_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    with pytest.raises(DmaProxyError, match="building the DMA proxy with /nonexistent/cc failed") as err:
        dma_proxy.library_path(tmp_path / "other")
    assert "\n" not in str(err.value)


def test_a_cuda_backend_needs_a_cuda_device(tmp_path):
    with pytest.raises(DmaProxyError, match="needs a CUDA device"):
        DmaProxy(torch.device("cpu"), max_pairs=4, backend="cuda", cache_dir=tmp_path)


# ---- the kernels, in Triton's interpreter --------------------------------------------------------------


def _reports(proxy: DmaProxy, text: str) -> None:
    """`check` raises, saying `text`."""
    with pytest.raises(DmaProxyError) as err:
        proxy.check()
    assert text in str(err.value), err.value


def check_ring_and_wait() -> None:
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        proxy = DmaProxy(torch.device("cpu"), max_pairs=8, backend="host", ring_slots=4, cache_dir=Path(tmp))
        try:
            host, slots = _filled(E, 3, True), _filled(K + 1, 4, True)
            before = {n: slots.get(n).clone() for n in slots.names()}
            table = proxy.table(host, slots)
            plans = [
                ([5, 1, E, E, E, E, E, E], [2, 0, K, K, K, K, K, K]),
                ([8, E, 3, E, E, E, E, E], [1, K, 3, K, K, K, K, K]),
            ]
            up_mask = DmaProxy.mask(host, ("gate", "up", "gate_scale", "up_scale"))
            down_mask = DmaProxy.mask(host, ("down", "down_scale"))
            for _lap in range(3):  # 6 records through a ring of 4
                for experts, slot_ids in plans:
                    entry_up = proxy.ring(table, torch.tensor(experts), torch.tensor(slot_ids), up_mask)
                    entry_down = proxy.ring(table, torch.tensor(experts), torch.tensor(slot_ids), down_mask)
                    proxy.wait(entry_up)
                    proxy.wait(entry_down)
                    proxy.check()
            want = {n: before[n].clone() for n in slots.names()}
            for experts, slot_ids in plans:
                for e, s in zip(experts, slot_ids):
                    if e < E:
                        for n in slots.names():
                            want[n][s] = host.get(n)[e]
            for n in slots.names():
                assert _same(slots.get(n), want[n]), n
            assert proxy.stats()["tickets"] == 12 and int(proxy.counter) == 12
        finally:
            proxy.close()
        # a wait for a ticket nobody serves (its site's ticket set by hand) gives up after its limit, says so
        cpu = torch.device("cpu")
        dead = DmaProxy(cpu, max_pairs=2, backend="host", ring_slots=4, cache_dir=Path(tmp), wait_limit=50)
        host, slots = _filled(E, 5), _filled(K + 1, 6)
        entry = 7
        dead.tick[entry] = 1
        dead.wait(entry)
        _reports(dead, "gave up waiting for its page-ins (ticket 1")
        dead.wait_limit = 10**9  # after one gave up, the next gives up at once (else this never returns)
        dead.wait(entry)
        assert int(dead.err) == 1  # the first ticket that did not land stays the one reported
        dead.close()
        # a failed thread: its waits give up within 256 polls, whatever their limit
        failed = DmaProxy(cpu, max_pairs=2, backend="host", ring_slots=4, cache_dir=Path(tmp), wait_limit=10**9)
        table = failed.table(host, slots)
        entry = failed.ring(table + 7, torch.tensor([1, E]), torch.tensor([0, K]), 1)  # no such table
        failed.wait(entry)
        _reports(failed, "a record named a table the proxy does not have")
        assert int(failed.err) == 1
        failed.close()
        # a closed proxy (its thread stopped): a wait gives up within 256 polls too
        closed = DmaProxy(cpu, max_pairs=2, backend="host", ring_slots=4, cache_dir=Path(tmp), wait_limit=10**9)
        closed.close()
        closed.tick[3] = 2
        closed.wait(3)
        assert int(closed.err) == 2 and int(closed.gave_up) == 2
        # a record with nothing planned completes its own ticket: its wait returns though no thread serves it
        alone = DmaProxy(cpu, max_pairs=2, backend="host", ring_slots=4, cache_dir=Path(tmp), wait_limit=10**9)
        table = alone.table(host, slots)
        alone.ring(table + 7, torch.tensor([1, E]), torch.tensor([0, K]), 1)  # no such table: the thread stops
        deadline = time.monotonic() + 10
        while int(alone.status[0]) != -1:  # ST_STATE: failed, serving nothing from here on
            assert time.monotonic() < deadline
            time.sleep(0.001)
        entry = alone.ring(table, torch.tensor([E, E]), torch.tensor([K, K]), 1)  # ticket 2: padding only
        alone.wait(entry)
        assert int(alone.done[2]) == 2 and int(alone.err) == 0 and int(alone.gave_up) == 0
        # ... and a planned one still waits for the thread (here: gives up, the thread having failed)
        entry = alone.ring(table, torch.tensor([3, E]), torch.tensor([0, K]), 1)  # ticket 3
        alone.wait(entry)
        assert int(alone.done[3]) == 0 and int(alone.err) == 3
        alone.close()
    print("ok")


def test_ring_and_wait_kernels_in_the_interpreter():
    assert run_interpreted("test_dma_proxy", "check_ring_and_wait").strip().endswith("ok")


def check_overlapped_pass_with_proxy_copies() -> None:
    """moe/overlap.py's pass with `ProxyCopies` (the host backend's thread, the kernels interpreted): the
    misses' rows land through the proxy in the poisoned slots, and the output equals the plain pass over the
    landed slots and resident's over the host store, fp32 and FP8, 1 to 3 groups."""
    import tempfile
    from pathlib import Path

    from test_overlap_page_in import grouped_reference, planned_step, poison, tables

    from paged_experts.moe.overlap import ProxyCopies, overlapped_pass
    from paged_experts.residency.device import DeviceResidency

    e, k, top_k, h, inter = 16, 8, 4, 256, 128
    with tempfile.TemporaryDirectory() as tmp:
        proxy = DmaProxy(torch.device("cpu"), max_pairs=16, backend="host", ring_slots=8, cache_dir=Path(tmp))
        try:
            for quantized in (False, True):
                for tokens, groups in ((1, 1), (2, 2), (2, 3)):
                    gen = torch.Generator().manual_seed(7)
                    residency = DeviceResidency(e, k, torch.device("cpu"))
                    host, slots = tables(e, k, h, inter, quantized, seed=1)
                    for _ in range(3):
                        x, weights, plan, landed, want = planned_step(
                            gen, residency, host, slots, tokens, top_k, grouped_reference
                        )
                        poison(slots, plan)
                        got = overlapped_pass(x, weights, host, slots, plan, top_k, groups, ProxyCopies(proxy), False)
                        proxy.check()
                        assert not got.isnan().any(), (quantized, tokens, groups)
                        assert torch.equal(got, want), (quantized, tokens, groups)
                        slots = landed
                    print("ok", quantized, tokens, groups)
        finally:
            proxy.close()


def test_overlapped_pass_with_proxy_copies_in_the_interpreter():
    out = run_interpreted("test_dma_proxy", "check_overlapped_pass_with_proxy_copies", timeout_s=900)
    assert out.count("ok ") == 6, out


def test_the_ring_and_wait_kernels_compile_for_the_h200() -> None:
    """The real compiler (sm_90, no GPU needed): the ring publishes its ticket with a system-scope release after
    its record's stores, the wait polls `done` with volatile loads in a loop, and neither kernel specializes on
    its per-call integers."""
    import os

    triton = pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the interpreter compiles nothing")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from paged_experts.residency import dma_ring

    target = GPUTarget("cuda", 90, 32)
    ring_fn = dma_ring._ring
    ptrs = {"counter": "*i64", "ring": "*i64", "tick": "*i64", "done": "*i64", "experts": "*i64", "slots": "*i64"}
    consts = {"R": 64, "W": 4 + 2 * 512, "P": 512, "BLOCK": 64}
    sig = {a: ptrs.get(a, "constexpr" if a in consts else "i32") for a in ring_fn.arg_names}
    ptx = triton.compile(ASTSource(ring_fn, sig, consts), target=target, options={"num_warps": 1}).asm["ptx"]
    assert "atom.global.gpu.acq_rel.add" in ptx  # the ticket
    publish = ptx.index("atom.global.sys.release.exch")  # published at system scope ...
    assert "bar.sync" in ptx[ptx.rindex("st.global", 0, publish) : publish]  # ... after every thread's stores
    assert "st.global" in ptx[publish:]  # a record with nothing planned completes its ticket after publishing it
    wait_fn = dma_ring._wait
    wptrs = {"done": "*i64", "tick": "*i64", "err": "*i64", "gave_up": "*i64", "state": "*i64"}
    wsig = {a: wptrs.get(a, "constexpr" if a == "R" else "i32") for a in wait_fn.arg_names}
    wptx = triton.compile(ASTSource(wait_fn, wsig, {"R": 64}), target=target, options={"num_warps": 1}).asm["ptx"]
    assert "ld.volatile.global" in wptx  # each poll reads memory, not a register
    for fn, args in ((ring_fn, {"entry", "table", "mask", "n", "rows"}), (wait_fn, {"entry", "limit"})):
        assert {fn.arg_names[i] if isinstance(i, int) else i for i in fn.do_not_specialize} == args
