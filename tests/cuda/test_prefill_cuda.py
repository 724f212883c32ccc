"""CUDA checks of paged prefill with stream-ordered page-ins (moe/streaming.py):
- a long prompt, whole or in chunks beside a decoding sequence, then decode: paged == resident bit for
  bit at Qwen3-30B-A3B layer shapes (bf16, K = 16, 32, 64, both prefill residency policies) and for
  block-FP8 experts;
- slot integrity: with every wave's compute delayed on the compute stream (so copies run far ahead),
  paged still equals resident; the control, copies that do not wait for the wave that last read their
  slots, must differ (the test can see a race);
- a prefill with a synthetic router (ids known on the host) makes no host synchronization at all; with
  the model's router, exactly one per layer (the routed ids);
- the prefill counters: bytes, copy time within the span, waves;
- the same with page_in='kernel' (every page-in of a group as one copy-kernel launch): equality, slot
  integrity, no synchronization, counters; page_in='batch' (every page-in of a group as one cuMemcpyBatchAsync):
  equality, slot integrity, its copies byte for byte against an index copy, the default stream's fallback;
- prefill staging rows: equality (bf16, FP8, delayed compute), no synchronization, and a STAGING wave waits
  for its copies (with a control that must see the race);
- FP8 waves compute from the block tables laid out with the plan (none built a wave on the device);
- a wave waits for its own page-ins, which the host issues one wave early (with a control).

Plain functions, so the module also runs as a script: `python tests/cuda/test_prefill_cuda.py`.
"""

from __future__ import annotations

import time
import warnings
from typing import Any

import torch

import paged_experts.moe.waves as waves_module
from paged_experts.kv import KvPool
from paged_experts.model import MoeCausalLM, SeqChunk
from paged_experts.moe import StepContext
from paged_experts.moe.paged import PagedLayer
from paged_experts.moe.streaming import LayerCopies, mark
from paged_experts.residency.store import PageInEngine
from paged_experts.routing.sources import make_router
from paged_experts.runtime import RuntimeConfig

try:
    import pytest

    pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
except ImportError:  # script mode
    pass

QWEN2 = "synth:qwen3-30b-a3b-shape?layers=2&seed=0"  # 128 experts, top_k 8, bf16 experts of 9.4 MB
FP8 = "synth:qwen3-30b-a3b-fp8-shape?layers=2&seed=0"  # the same shapes, block-FP8 experts
PROMPT = [(37 * i + 11) % 1000 for i in range(600)]  # 600 tokens x 8: every layer routes to (nearly) every expert
SLEEP_CYCLES = 20_000_000  # ~10 ms of GPU time before each wave's compute in the integrity checks


def rt(**kw: object) -> RuntimeConfig:
    return RuntimeConfig(device="cuda", dtype="bfloat16", **kw)  # type: ignore[arg-type]


def long_prompt(model: MoeCausalLM, chunk: int, decode_steps: int = 3) -> list[torch.Tensor]:
    """A short prompt, then the long one in chunks of `chunk` tokens while the short one decodes in the
    same steps, then both decode: every logit row (fp32, CPU)."""
    pool = KvPool.for_model(model, capacity_tokens=1024)
    short, long = pool.new_sequence(), pool.new_sequence()
    out = model.forward([SeqChunk(short, [5, 17, 300, 41], 0, all_logits=True)])
    for i, start in enumerate(range(0, len(PROMPT), chunk)):
        piece = PROMPT[start : start + chunk]
        out += model.forward(
            [SeqChunk(short, [40 + i], short.num_tokens), SeqChunk(long, piece, start, all_logits=True)]
        )
    for step in range(decode_steps):
        out += model.forward(
            [SeqChunk(short, [60 + step], short.num_tokens), SeqChunk(long, [7 + step], long.num_tokens)]
        )
    return out


def assert_same(got: list[torch.Tensor], want: list[torch.Tensor], what: str) -> None:
    assert len(got) == len(want), what
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"{what}: output {i} differs by {(a - b).abs().max().item()}"


def test_streamed_prefill_equals_resident_qwen_shapes() -> None:
    resident = MoeCausalLM.from_pretrained(QWEN2, rt(mode="resident"))
    want = {chunk: long_prompt(resident, chunk) for chunk in (600, 256)}
    del resident
    for k in (16, 32, 64):
        for keep in ("recent", "lru"):
            model = MoeCausalLM.from_pretrained(QWEN2, rt(mode="paged", resident_experts=k, prefill_residency=keep))
            for chunk, ref in want.items():
                assert_same(long_prompt(model, chunk), ref, f"K={k} {keep} chunks of {chunk}")
            prefill = model.counters.snapshot().prefill
            assert prefill.misses > 0 and prefill.waves > prefill.layer_steps  # several waves per layer


def test_streamed_prefill_equals_resident_fp8() -> None:
    want = long_prompt(MoeCausalLM.from_pretrained(FP8, rt(mode="resident")), 256)
    for k in (16, 48):
        assert_same(
            long_prompt(MoeCausalLM.from_pretrained(FP8, rt(mode="paged", resident_experts=k)), 256), want, f"FP8 K={k}"
        )


def test_fp8_waves_run_on_the_block_tables_laid_out_with_the_plan() -> None:
    """Every host-planned FP8 wave computes from the block table `plan_waves` laid out on the host (no
    block-table launch a wave), and paged still equals resident bit for bit, with and without staging rows,
    with the wave's rows read and written through the layout (waves.ROWS_IN_KERNEL, the default) and gathered
    and copied around the launches."""
    want = long_prompt(MoeCausalLM.from_pretrained(FP8, rt(mode="resident")), 256)
    real, real_fp8, rows_in_kernel = waves_module.expert_mlp, waves_module.fp8_expert_mlp, waves_module.ROWS_IN_KERNEL
    seen: list[bool] = []

    def checked(x: torch.Tensor, table: object, offs: torch.Tensor, blocks: object = None) -> torch.Tensor:
        seen.append(blocks is not None)
        return real(x, table, offs, blocks)  # type: ignore[arg-type]

    def checked_fp8(x: torch.Tensor, table: object, offs: torch.Tensor, tiles: object, blocks: object = None,
                    *maps: Any) -> torch.Tensor:  # fmt: skip
        seen.append(blocks is not None and all(m is not None for m in maps) and len(maps) == 2)
        return real_fp8(x, table, offs, tiles, blocks, *maps)  # type: ignore[arg-type]

    waves_module.expert_mlp = checked  # type: ignore[assignment]
    waves_module.fp8_expert_mlp = checked_fp8  # type: ignore[assignment]
    try:
        for in_kernel in (True, False):
            waves_module.ROWS_IN_KERNEL = in_kernel
            for kw in ({}, {"prefill_staging_rows": 8}):
                seen.clear()
                model = MoeCausalLM.from_pretrained(FP8, rt(mode="paged", resident_experts=16, **kw))
                assert_same(long_prompt(model, 256), want, f"FP8 K=16 {kw}, rows in kernel {in_kernel}")
                assert len(seen) > 2 * 3 and all(seen), seen  # 2 layers x 3 chunks, several waves each
    finally:
        waves_module.expert_mlp, waves_module.fp8_expert_mlp = real, real_fp8
        waves_module.ROWS_IN_KERNEL = rows_in_kernel


def test_kernel_page_in_prefill_equals_resident() -> None:
    """page_in='kernel': every host-planned page-in as one copy-kernel launch per group of rows (bf16 and FP8);
    the copies went by the kernel, none by DMA (equal outputs alone cannot say which copy ran)."""
    _one_call_page_in_equals_resident("kernel", "_copy_kernel")


def test_batch_page_in_prefill_equals_resident() -> None:
    """page_in='batch': every host-planned page-in group as one cuMemcpyBatchAsync (bf16 and FP8, weights and
    scales in one call); the copies went by the driver's batch, none by `direct`'s DMAs or row kernel."""
    _one_call_page_in_equals_resident("batch", "_copy_batch")


def _one_call_page_in_equals_resident(page_in: str, method: str) -> None:
    from paged_experts.residency.batch_copy import DriverBatchCopy

    want = {chunk: long_prompt(MoeCausalLM.from_pretrained(QWEN2, rt(mode="resident")), chunk) for chunk in (600, 256)}
    want_fp8 = long_prompt(MoeCausalLM.from_pretrained(FP8, rt(mode="resident")), 256)
    calls = {method: 0, "_copy_direct": 0, "driver": 0}
    originals = {name: getattr(PageInEngine, name) for name in (method, "_copy_direct")}
    driver_call = DriverBatchCopy.__call__

    def counting(name: str) -> object:
        def counted(self: PageInEngine, *args: object) -> None:
            calls[name] += 1
            originals[name](self, *args)

        return counted

    def driver_counted(self: DriverBatchCopy, *args: Any) -> None:
        calls["driver"] += 1
        driver_call(self, *args)

    for name in originals:
        setattr(PageInEngine, name, counting(name))
    DriverBatchCopy.__call__ = driver_counted  # type: ignore[method-assign]
    try:
        for k in (16, 32):
            model = MoeCausalLM.from_pretrained(QWEN2, rt(mode="paged", resident_experts=k, page_in=page_in))
            for chunk, ref in want.items():
                assert_same(long_prompt(model, chunk), ref, f"{page_in} page-in K={k} chunks of {chunk}")
            assert model.counters.snapshot().prefill.misses > 0
        model = MoeCausalLM.from_pretrained(FP8, rt(mode="paged", resident_experts=16, page_in=page_in))
        assert_same(long_prompt(model, 256), want_fp8, f"FP8 {page_in} page-in K=16")
    finally:
        for name, fn in originals.items():
            setattr(PageInEngine, name, fn)
        DriverBatchCopy.__call__ = driver_call  # type: ignore[method-assign]
    assert calls[method] > 0 and calls["_copy_direct"] == 0, calls
    assert (calls["driver"] == calls[method]) if page_in == "batch" else calls["driver"] == 0, calls


def test_batch_copy_writes_every_tensor_and_falls_back_on_the_default_stream() -> None:
    """The driver's batch (cuMemcpyBatchAsync) from the pinned store on a side stream writes exactly what an index
    copy writes (bf16 and FP8 rows, runs of neighbours and single rows, nothing else touched); on the legacy
    default stream, which the driver refuses, the engine copies as `direct`."""
    from paged_experts.residency.store import ExpertTensors

    e, k, hidden, inter = 12, 6, 256, 192
    dev = torch.device("cuda")
    direct = PageInEngine._copy_direct
    fell_back: list[int] = []

    def counted(self: PageInEngine, *args: Any) -> None:
        fell_back.append(1)
        direct(self, *args)

    for is_fp8 in (False, True):
        host = ExpertTensors.empty(e, hidden, inter, torch.bfloat16, torch.device("cpu"), pin=True, is_fp8=is_fp8)
        gen = torch.Generator().manual_seed(0)
        for name in host.names():
            raw = host.get(name).view(torch.uint8)
            raw.copy_(torch.randint(0, 120, raw.shape, generator=gen, dtype=torch.uint8))
        engine = PageInEngine(dev, "batch", hidden, inter, torch.bfloat16, k, is_fp8, batch_copy=_driver())
        index = PageInEngine(dev, "index", hidden, inter, torch.bfloat16, k, is_fp8)
        for pairs in ([(3, 0), (4, 1), (5, 2), (9, 4), (0, 5)], [(7, 3)], [(11, 1), (2, 0)]):
            want = ExpertTensors.empty(k, hidden, inter, torch.bfloat16, dev, is_fp8=is_fp8)
            side = ExpertTensors.empty(k, hidden, inter, torch.bfloat16, dev, is_fp8=is_fp8)
            legacy = ExpertTensors.empty(k, hidden, inter, torch.bfloat16, dev, is_fp8=is_fp8)
            for table in (want, side, legacy):
                for name in table.names():
                    table.get(name).view(torch.uint8).fill_(7)
            index.copy_rows(host, want, pairs)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())  # the fills are done before the copies
            calls, fell_back[:] = engine.batch_calls, []
            PageInEngine._copy_direct = counted  # type: ignore[method-assign]
            try:
                with torch.cuda.stream(stream):
                    engine.copy_rows(host, side, pairs)
                assert engine.batch_calls == calls + 1 and not fell_back, "the side stream's copy did not go by batch"
                torch.cuda.current_stream().wait_stream(stream)
                engine.copy_rows(host, legacy, pairs)  # the default stream
                assert len(fell_back) == 1 and engine.batch_calls == calls + 1, "the legacy stream did not go direct"
            finally:
                PageInEngine._copy_direct = direct  # type: ignore[method-assign]
            torch.cuda.synchronize()
            for name in host.names():
                for got in (side, legacy):
                    assert torch.equal(got.get(name).view(torch.uint8), want.get(name).view(torch.uint8)), (pairs, name)


def _driver() -> Any:
    from paged_experts.residency.batch_copy import driver_batch_copy

    return driver_batch_copy(torch.device("cuda"))


def test_staging_rows_prefill_equals_resident_and_does_not_sync() -> None:
    """prefill_staging_rows: each layer's first page-ins of a chunk copied into shared rows on the page-in stream
    while the layer before computes, then served from there: the same bits as resident (bf16, FP8, and with
    every wave's compute delayed so copies run far ahead of it), staged copies on every layer but the first
    of each large chunk, and no host synchronization with host-known routing."""
    from paged_experts.moe.staging import StagingRows

    calls, stage = [0], StagingRows.stage

    def counted(self: StagingRows, *args: object) -> None:
        calls[0] += 1
        stage(self, *args)  # type: ignore[arg-type]

    StagingRows.stage = counted  # type: ignore[method-assign]
    try:
        want = {c: long_prompt(MoeCausalLM.from_pretrained(QWEN2, rt(mode="resident")), c) for c in (600, 256)}
        for k, rows in ((16, 16), (32, 24)):
            model = MoeCausalLM.from_pretrained(QWEN2, rt(mode="paged", resident_experts=k, prefill_staging_rows=rows))
            for chunk, ref in want.items():
                assert_same(long_prompt(model, chunk), ref, f"K={k}, {rows} staging rows, chunks of {chunk}")
        # chunks of 600 (one large chunk) and of 256 (two large ones; 88 tokens are below 8 pairs per expert),
        # two models, every layer but the first of 2
        assert calls[0] == 2 * (1 + 2), calls
        want_fp8 = long_prompt(MoeCausalLM.from_pretrained(FP8, rt(mode="resident")), 256)
        model = MoeCausalLM.from_pretrained(FP8, rt(mode="paged", resident_experts=16, prefill_staging_rows=8))
        assert_same(long_prompt(model, 256), want_fp8, "FP8 K=16, 8 staging rows")
        # more staging rows than K through page_in 'staged' (its buffers once held K rows: the stage failed)
        model = MoeCausalLM.from_pretrained(
            FP8, rt(mode="paged", resident_experts=16, prefill_staging_rows=24, page_in="staged")
        )
        assert_same(long_prompt(model, 256), want_fp8, "FP8 K=16, 24 staging rows, page_in staged")
        original_wave = _delay_every_wave()
        try:
            model = MoeCausalLM.from_pretrained(QWEN2, rt(mode="paged", resident_experts=32, prefill_staging_rows=24))
            # with decode steps after the prompt: they read the promoted slots
            assert_same(long_prompt(model, 600), want[600], "staging rows, delayed compute")
        finally:
            waves_module._FusedPass.wave = original_wave  # type: ignore[method-assign]
    finally:
        StagingRows.stage = stage  # type: ignore[method-assign]
    _host_known_routing_does_not_sync(prefill_staging_rows=24)


def test_a_staging_wave_waits_for_its_copies() -> None:
    """With every staging copy delayed on the page-in stream (SLEEP_CYCLES before it), paged + staging still
    equals resident; the control, STAGING waves that do not wait for their copies (`wait_staged` a no-op),
    must differ (the test can see the race it guards)."""
    want = long_prompt(MoeCausalLM.from_pretrained(QWEN2, rt(mode="resident")), 600, decode_steps=0)
    stage, wait = LayerCopies.stage, LayerCopies.wait_staged

    def late(self: LayerCopies, *args: object, **kwargs: object) -> object:
        if self.copy is not None:
            with torch.cuda.stream(self.copy):
                torch.cuda._sleep(SLEEP_CYCLES)
        return stage(self, *args, **kwargs)  # type: ignore[arg-type]

    LayerCopies.stage = late  # type: ignore[method-assign, assignment]
    try:
        model = MoeCausalLM.from_pretrained(QWEN2, rt(mode="paged", resident_experts=32, prefill_staging_rows=24))
        assert_same(long_prompt(model, 600, decode_steps=0), want, "staging copies delayed")
        LayerCopies.wait_staged = lambda self, landed: None  # type: ignore[method-assign, assignment]
        model = MoeCausalLM.from_pretrained(QWEN2, rt(mode="paged", resident_experts=32, prefill_staging_rows=24))
        got = long_prompt(model, 600, decode_steps=0)
        assert not all(torch.equal(a, b) for a, b in zip(got, want)), "the control's race went unseen"
    finally:
        LayerCopies.stage, LayerCopies.wait_staged = stage, wait  # type: ignore[method-assign]


def _delay_every_wave() -> object:
    """Puts SLEEP_CYCLES on the compute stream before each wave's compute; returns the original."""
    original = waves_module._FusedPass.wave

    def delayed(self: object, *args: object) -> None:
        torch.cuda._sleep(SLEEP_CYCLES)
        original(self, *args)  # type: ignore[arg-type]

    waves_module._FusedPass.wave = delayed  # type: ignore[method-assign]
    return original


def _copies_ignore_readers() -> object:
    """The control's bug: a wave's page-ins wait for nothing (not for the waves that read their slots)."""
    original = LayerCopies.page_in

    def eager(self: LayerCopies, index: int, wave: object, copy_rows: object) -> None:
        if not wave.page_ins or self.copy is None:  # type: ignore[attr-defined]
            return original(self, index, wave, copy_rows)  # type: ignore[arg-type]
        with torch.cuda.stream(self.copy):
            start = mark(self.device)
            copy_rows(wave.page_ins)  # type: ignore[attr-defined,operator]
            self._count(len(wave.page_ins), start, mark(self.device))  # type: ignore[attr-defined]
            landed = torch.cuda.Event()
            landed.record(self.copy)
        self.landed[index] = landed
        return None

    LayerCopies.page_in = eager  # type: ignore[method-assign]
    return original


def test_slots_are_not_overwritten_while_a_wave_reads_them() -> None:
    want = long_prompt(MoeCausalLM.from_pretrained(QWEN2, rt(mode="resident")), 600, decode_steps=0)
    for page_in in ("direct", "kernel", "batch"):
        _slots_are_not_overwritten(want, page_in)


def _slots_are_not_overwritten(want: list[torch.Tensor], page_in: str) -> None:
    original_wave = _delay_every_wave()
    try:
        model = MoeCausalLM.from_pretrained(QWEN2, rt(mode="paged", resident_experts=32, page_in=page_in))
        assert_same(long_prompt(model, 600, decode_steps=0), want, f"delayed compute, {page_in}")
        original_copies = _copies_ignore_readers()
        try:  # control: the same run with copies that do not wait for their slots' readers
            model = MoeCausalLM.from_pretrained(QWEN2, rt(mode="paged", resident_experts=32, page_in=page_in))
            got = long_prompt(model, 600, decode_steps=0)
        finally:
            LayerCopies.page_in = original_copies  # type: ignore[method-assign]
        assert not all(torch.equal(a, b) for a, b in zip(got, want)), f"the control's race went unseen ({page_in})"
    finally:
        waves_module._FusedPass.wave = original_wave  # type: ignore[method-assign]


def test_a_wave_waits_for_its_page_ins_to_land() -> None:
    """The host issues a wave's page-ins one wave early and the compute stream waits for them only just before
    that wave (`LayerCopies.wait_landed`). With every group of page-ins delayed on the page-in stream
    (SLEEP_CYCLES before it), paged still equals resident, with the page-ins as DMAs and as one batch call; the
    control, waves that do not wait for their page-ins (`wait_landed` a no-op), must differ (the test can see the
    race it guards)."""
    want = long_prompt(MoeCausalLM.from_pretrained(QWEN2, rt(mode="resident")), 600, decode_steps=0)
    timed, wait = LayerCopies._timed, LayerCopies.wait_landed

    def late(self: LayerCopies, *args: object) -> None:
        if self.copy is not None:
            torch.cuda._sleep(SLEEP_CYCLES)  # on the page-in stream: _timed runs inside page_in's stream block
        timed(self, *args)  # type: ignore[arg-type]

    LayerCopies._timed = late  # type: ignore[method-assign, assignment]
    try:
        for page_in in ("direct", "batch"):
            model = MoeCausalLM.from_pretrained(QWEN2, rt(mode="paged", resident_experts=32, page_in=page_in))
            assert_same(long_prompt(model, 600, decode_steps=0), want, f"page-ins delayed, {page_in}")
        LayerCopies.wait_landed = lambda self, index: None  # type: ignore[method-assign, assignment]
        for page_in in ("direct", "batch"):
            model = MoeCausalLM.from_pretrained(QWEN2, rt(mode="paged", resident_experts=32, page_in=page_in))
            got = long_prompt(model, 600, decode_steps=0)
            assert not all(torch.equal(a, b) for a, b in zip(got, want)), f"the control's race went unseen ({page_in})"
    finally:
        LayerCopies._timed, LayerCopies.wait_landed = timed, wait  # type: ignore[method-assign]


def _prefill_layers(model: MoeCausalLM, router: object | None, tokens: int = 512) -> list[torch.Tensor]:
    x = torch.randn(tokens, model.config.hidden_size, device="cuda", dtype=torch.bfloat16)
    ctx = StepContext(seq_ids=(0,) * tokens, positions=tuple(range(tokens)))
    return [layer.forward(x, ctx, router, []) for layer in model.moe_layers]  # type: ignore[arg-type]


def test_prefill_with_host_known_routing_does_not_sync() -> None:
    for page_in in ("direct", "kernel", "batch"):
        _host_known_routing_does_not_sync(page_in=page_in)


def _host_known_routing_does_not_sync(**options: object) -> None:
    model = MoeCausalLM.from_pretrained(QWEN2, rt(mode="paged", resident_experts=32, **options))
    router = make_router("qwen3-30b-a3b", model.config, seed=1)
    _prefill_layers(model, router)  # warm-up: the grouped backend decided, allocator blocks made
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _prefill_layers(model, router)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert model.counters.snapshot().prefill.misses > 0


def test_prefill_with_model_routing_reads_the_ids_once_per_layer() -> None:
    model = MoeCausalLM.from_pretrained(QWEN2, rt(mode="paged", resident_experts=32))
    _prefill_layers(model, None)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _prefill_layers(model, None)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message).lower()]
    assert len(syncs) == len(model.moe_layers), [str(w.message) for w in syncs]


def test_prefill_counters_on_cuda() -> None:
    for page_in in ("direct", "kernel", "batch"):
        _prefill_counters(page_in)


def _prefill_counters(page_in: str) -> None:
    model = MoeCausalLM.from_pretrained(QWEN2, rt(mode="paged", resident_experts=16, page_in=page_in))
    long_prompt(model, 600, decode_steps=0)
    snap = model.counters.snapshot()
    p = snap.prefill
    assert p.chunks == 2 and p.tokens == 4 + len(PROMPT) and p.layer_steps == 2 * len(model.moe_layers)
    assert p.bytes_paged_in == p.misses * snap.expert_bytes > 0
    assert 0 < p.copy_time_s <= p.span_s and 0 < p.copy_busy_fraction <= 1
    assert p.waves >= p.misses // 8  # a wave holds at most (K - protected) // 2 = 8 experts at K = 16
    # the link's idle split from the page-in stream's event gaps: each layer's chain shows, and with the copies
    # it fits the span (events of two streams: a microsecond's slack)
    assert p.idle_before_layer_s > 0 and p.idle_between_waves_s >= 0
    assert p.copy_time_s + p.idle_before_layer_s + p.idle_between_waves_s <= p.span_s + 1e-6


def test_prefill_host_times_file_a_wait_on_the_device_as_waiting() -> None:
    """The host's side of the paged prefill layers (PrefillCounts.host_wait_s, host_plan_s; the report's
    host_wait_ms, host_plan_ms): a GPU sleep queued behind one layer's router makes that layer's read of its ids
    wait, and the wait lands in host_wait_s, not host_plan_s; both fit the prefill's wall clock."""
    cycles = 5 * SLEEP_CYCLES
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    sleep_s = start.elapsed_time(end) / 1e3  # ~50 ms: what the queued sleep holds the ids' read back
    original = PagedLayer._host_planned
    slept: list[int] = []

    def delayed(layer: PagedLayer, *args: Any, **kwargs: Any) -> torch.Tensor:
        if not slept:  # the first host-planned layer-step (a prefill step's): queued after its router
            torch.cuda._sleep(cycles)
            slept.append(layer.layer_idx)
        return original(layer, *args, **kwargs)

    PagedLayer._host_planned = delayed  # type: ignore[method-assign]
    try:
        model = MoeCausalLM.from_pretrained(QWEN2, rt(mode="paged", resident_experts=16))
        torch.cuda.synchronize()
        started = time.perf_counter()
        long_prompt(model, 600, decode_steps=0)
        torch.cuda.synchronize()
        wall_s = time.perf_counter() - started
    finally:
        PagedLayer._host_planned = original  # type: ignore[method-assign]
    p = model.counters.snapshot().prefill
    assert slept and p.layer_steps == 2 * len(model.moe_layers)
    assert p.host_wait_s >= 0.8 * sleep_s, (p.host_wait_s, sleep_s)
    assert 0 < p.host_plan_s and p.host_wait_s + p.host_plan_s <= wall_s


if __name__ == "__main__":
    from _script import run_tests

    raise SystemExit(run_tests(globals()))
