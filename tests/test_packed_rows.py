"""Packed expert rows (RuntimeConfig.expert_rows = 'packed', residency/store.py): every tensor of an expert in one
byte row of one buffer, so a page-in of a run of experts is one copy.

- the layout: every tensor a view of the buffer, each at a 256-byte boundary, rows contiguous, writes through;
- `copy_views`: the whole row is the whole buffer (one contiguous tensor); gate/up a prefix, down a suffix;
  a narrowed `names()` (the fault-injection tests) keeps the missing tensor's bytes out;
- every CPU page-in strategy lands exactly the planned rows, bit for bit as the split layout does, and `direct`
  issues one copy a run of rows where split issues one a tensor and run;
- the device row copy kernel (Triton's interpreter) and the DMA proxy's thread (host backend) copy packed rows
  and ranges of them: the proxy merges a record's adjacent ranges into one copy;
- a paged model with packed rows equals the resident model bit for bit (prefill waves, decode, FP8, bf16,
  device-planned steps, batch page-ins, offloaded layers);
- the option: RuntimeConfig, the server's rule, the adapter's flag."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from interpreted import run_interpreted
from test_dma_proxy import random_bytes

from paged_experts import fp8
from paged_experts.residency.store import (
    PACKED_ORDER,
    ROW_ALIGN_BYTES,
    ExpertTensors,
    PageInEngine,
    SlotArena,
    to_device_rows,
)
from paged_experts.runtime import RuntimeConfig

E, K, H, INTER = 9, 5, 256, 128  # FP8 needs 128-multiples (one block-scale row per 128 x 128 block)
GATE_UP = ("gate", "up", "gate_scale", "up_scale")
DOWN = ("down", "down_scale")
CPU = torch.device("cpu")


def filled(n: int, seed: int, is_fp8: bool, packed: bool, dtype: torch.dtype = torch.float32) -> ExpertTensors:
    """Random bytes in every tensor (the same bytes for either layout at one seed)."""
    return random_bytes(ExpertTensors.empty(n, H, INTER, dtype, CPU, is_fp8=is_fp8, packed=packed), seed)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Byte equality (random bytes make NaNs, which no value comparison finds equal)."""
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def assert_tables_equal(a: ExpertTensors, b: ExpertTensors) -> None:
    assert a.names() == b.names()
    for name in a.names():
        assert same(a.get(name), b.get(name)), name


# ---- the layout ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("is_fp8", "dtype"), [(True, torch.float32), (False, torch.bfloat16), (False, torch.float32)])
def test_every_tensor_is_an_aligned_view_of_one_row_an_expert(is_fp8: bool, dtype: torch.dtype) -> None:
    t = ExpertTensors.empty(E, H, INTER, dtype, CPU, is_fp8=is_fp8, packed=True)
    split = ExpertTensors.empty(E, H, INTER, dtype, CPU, is_fp8=is_fp8)
    assert t.packed is not None and t.packed.dtype == torch.uint8 and t.packed.is_contiguous()
    assert t.row_pitch == t.packed.shape[1] and t.row_pitch % ROW_ALIGN_BYTES == 0 and split.row_pitch == 0
    assert t.row_pitch >= t.row_bytes == split.row_bytes  # the same bytes an expert, padding aside
    base = t.packed.data_ptr()
    offsets = []
    for name in t.names():
        view, ref = t.get(name), split.get(name)
        assert view.shape == ref.shape and view.dtype == ref.dtype, name
        assert view.untyped_storage().data_ptr() == t.packed.untyped_storage().data_ptr(), name
        assert view[0].is_contiguous() and view.stride(0) * view.element_size() == t.row_pitch, name
        offsets.append((view.data_ptr() - base, name))
        assert (view.data_ptr() - base) % ROW_ALIGN_BYTES == 0, name
    assert [n for _, n in sorted(offsets)] == [n for n in PACKED_ORDER if n in t.names()]  # gate/up first, down last
    # a write to one expert's tensor lands in that expert's row of the buffer, nowhere else
    before = t.packed.clone()
    t.get("down")[3].view(torch.uint8).fill_(7)
    changed = (t.packed != before).nonzero()[:, 0].unique().tolist() if not torch.equal(t.packed, before) else []
    assert changed == [3]


def test_copy_views_are_the_row_its_prefix_and_its_suffix() -> None:
    t = filled(E, 1, True, True)
    assert t.packed is not None
    (whole,) = t.copy_views()
    assert whole is t.packed and t.copy_views() is t.copy_views()  # made once: stable objects for the caches
    down_at = t.down.data_ptr() - t.packed.data_ptr()
    (gate_up,) = t.copy_views(GATE_UP)
    assert gate_up.data_ptr() == t.packed.data_ptr() and gate_up.shape == (E, down_at)
    (down,) = t.copy_views(DOWN)
    assert down.data_ptr() - t.packed.data_ptr() == down_at and down.shape == (E, t.row_pitch - down_at)
    assert not gate_up.is_contiguous() and gate_up[0].is_contiguous()
    up, gate_scale = (t.get(n).data_ptr() - t.packed.data_ptr() for n in ("up", "gate_scale"))
    (only_up,) = t.copy_views(("up",))
    assert (only_up.data_ptr() - t.packed.data_ptr(), only_up.shape[1]) == (up, gate_scale - up)
    split = filled(E, 1, True, False)
    assert [v.shape for v in split.copy_views(DOWN)] == [(E, H, INTER), (E, *fp8.scale_shape(H, INTER))]


def test_a_narrowed_row_leaves_the_missing_tensor_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fault-injection tests remove a name from the row: its bytes must not be copied in either layout."""
    from paged_experts.residency import store

    monkeypatch.setattr(store, "EXPERT_TENSORS", ("gate", "down"))  # up left out
    t = filled(E, 1, False, True)
    ranges = [(v.data_ptr() - t.packed.data_ptr(), v.shape[1]) for v in t.copy_views()]  # type: ignore[union-attr]
    up = t.up.data_ptr() - t.packed.data_ptr()  # type: ignore[union-attr]
    assert len(ranges) == 2 and all(not a <= up < a + n for a, n in ranges)


# ---- page-ins on the CPU ------------------------------------------------------------------------------------

PAIRS = [(7, 0), (2, 3), (3, 4), (4, 1)]  # (expert, slot); experts 2, 3 to slots 3, 4: a run of two


@pytest.mark.parametrize("strategy", ["index", "direct", "batch"])
@pytest.mark.parametrize("is_fp8", [False, True])
def test_every_cpu_strategy_lands_the_planned_rows_as_split_does(strategy: str, is_fp8: bool) -> None:
    results = []
    for packed in (False, True):
        host, slots = filled(E, 1, is_fp8, packed), filled(K, 2, is_fp8, packed)
        engine = PageInEngine(CPU, strategy, H, INTER, torch.float32, K, is_fp8=is_fp8, packed=packed)
        engine.copy_rows(host, slots, PAIRS)
        for name in slots.names():
            want = filled(K, 2, is_fp8, False).get(name).clone()
            for e, s in PAIRS:
                want[s] = host.get(name)[e]
            assert same(slots.get(name), want), (strategy, packed, name)
        results.append(slots)
    assert_tables_equal(*results)


def test_direct_issues_one_copy_a_run_of_packed_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    issued: list[int] = []
    real = torch._foreach_copy_

    def counting(dsts, srcs, non_blocking=False):  # type: ignore[no-untyped-def]
        issued.append(len(dsts))
        return real(dsts, srcs, non_blocking=non_blocking)

    monkeypatch.setattr(torch, "_foreach_copy_", counting)
    for packed in (False, True):
        host, slots = filled(E, 1, True, packed), filled(K, 2, True, packed)
        PageInEngine(CPU, "direct", H, INTER, torch.float32, K, is_fp8=True, packed=packed).copy_rows(
            host, slots, PAIRS
        )
    runs = 3  # (7, 0), the run (2..3 -> 3..4), (4, 1)
    assert issued == [6 * runs, runs]  # split: six tensors a run (no row kernel on the CPU); packed: one a run


def test_gate_up_rows_of_several_experts_go_row_by_row(monkeypatch: pytest.MonkeyPatch) -> None:
    """A packed range (not the whole row) is not contiguous over rows: a run of them copies row by row, in `direct`
    and in `batch` (whose row tables cannot describe it: it goes as `direct`)."""
    from paged_experts.residency import store

    issued: list[list[tuple[int, ...]]] = []
    real = torch._foreach_copy_

    def counting(dsts, srcs, non_blocking=False):  # type: ignore[no-untyped-def]
        issued.append([tuple(d.shape) for d in dsts])
        return real(dsts, srcs, non_blocking=non_blocking)

    for strategy in ("direct", "batch"):
        issued.clear()
        host, slots, fresh = filled(E, 1, True, True), filled(K, 2, True, True), filled(K, 2, True, True)
        engine = PageInEngine(CPU, strategy, H, INTER, torch.float32, K, is_fp8=True, packed=True)
        with monkeypatch.context() as m:
            m.setattr(torch, "_foreach_copy_", counting)
            m.setattr(store, "SCALE_TENSORS", ())  # fault injection: the row narrowed to gate and up
            m.setattr(store, "EXPERT_TENSORS", ("gate", "up"))
            engine.copy_rows(host, slots, [(2, 3), (3, 4)])
        (gate_up,) = host.copy_views(("gate", "up"))
        assert issued == [[(gate_up.shape[1],)] * 2], (strategy, issued)  # one range a row, not a block of two
        for name in slots.names():  # down and the scales untouched, and the other slots (padding is not values)
            rows = [0, 1, 2] if name in ("gate", "up") else [0, 1, 2, 3, 4]
            assert same(slots.get(name)[rows], fresh.get(name)[rows]), (strategy, name)
        for name in ("gate", "up"):
            assert same(slots.get(name)[3:5], host.get(name)[2:4]), (strategy, name)


def test_the_cpu_index_copy_takes_runs_of_words_and_a_narrowed_row_lands_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU's `index` page-in copies each run of rows as one copy_ of 8-byte words (no index_select temporary:
    fresh memory past glibc's mmap threshold on every call), and a run of packed ranges (gate and up of two experts,
    strided) writes those ranges and nothing between them."""
    from paged_experts.residency import store

    host, slots = filled(E, 1, True, True), filled(K, 2, True, True)
    whole_src, whole_dst = store.as_words(*(t.copy_views()[0] for t in (host, slots)))
    assert whole_src.dtype == torch.int64 and whole_src.data_ptr() == host.packed.data_ptr()  # type: ignore[union-attr]
    assert whole_dst.shape == (K, slots.row_pitch // 8)
    odd = torch.zeros(4, 6, dtype=torch.uint8)
    assert store.as_words(odd, odd)[0].dtype == torch.int16  # 6 bytes a row: 2-byte words
    assert store.as_words(odd[:, :3], odd[:, :3])[0].dtype == torch.uint8  # 3 bytes a row: no wider word
    floats = torch.zeros(2, 8)
    assert store.as_words(floats, floats)[0] is floats
    copies: list[tuple[int, ...]] = []
    real = torch.Tensor.copy_

    def counting(self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        copies.append(tuple(self.shape))
        return real(self, src, non_blocking)

    engine = PageInEngine(CPU, "index", H, INTER, torch.float32, K, is_fp8=True, packed=True)
    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "copy_", counting)
        engine.copy_rows(host, slots, PAIRS)
    words = slots.row_pitch // 8
    assert copies == [(1, words), (1, words), (2, words)]  # 3 runs, by destination: 7 -> 0, 4 -> 1, 2..3 -> 3..4
    fresh = filled(K, 2, True, True)
    narrowed = filled(K, 2, True, True)
    with monkeypatch.context() as m:
        m.setattr(store, "SCALE_TENSORS", ())  # fault injection: the row narrowed to gate and up
        m.setattr(store, "EXPERT_TENSORS", ("gate", "up"))
        engine.copy_rows(host, narrowed, [(2, 3), (3, 4)])
    for name in narrowed.names():
        rows = [0, 1, 2] if name in ("gate", "up") else [0, 1, 2, 3, 4]
        assert same(narrowed.get(name)[rows], fresh.get(name)[rows]), name
    for name in ("gate", "up"):
        assert same(narrowed.get(name)[3:5], host.get(name)[2:4]), name


def test_page_ins_between_two_layouts_are_refused() -> None:
    engine = PageInEngine(CPU, "index", H, INTER, torch.float32, K, is_fp8=True)
    with pytest.raises(ValueError, match="one layout"):
        engine.copy_rows(filled(E, 1, True, True), filled(K, 2, True, False), PAIRS)


def test_device_rows_keep_the_host_layout() -> None:
    host = filled(E, 1, True, True)
    rows = to_device_rows(host, K, CPU)
    assert rows.packed is not None and rows.packed.data_ptr() != host.packed.data_ptr()  # type: ignore[union-attr]
    assert rows.row_pitch == host.row_pitch
    for name in host.names():
        assert same(rows.get(name), host.get(name)[:K]), name


def test_device_rows_go_into_the_next_part_of_a_slot_arena() -> None:
    """A SlotArena holds every paged layer's slot rows in one buffer: each layer's rows are its own contiguous part,
    holding that layer's first K experts; a part of another shape, or one past the last layer, is refused."""
    hosts = [filled(E, seed, True, True) for seed in (1, 2)]
    arena = SlotArena(2, K, hosts[0].row_pitch, CPU)
    rows = [to_device_rows(host, K, CPU, arena=arena) for host in hosts]
    base, part = arena.buffer.data_ptr(), K * hosts[0].row_pitch
    assert [r.packed.data_ptr() - base for r in rows] == [0, part]  # type: ignore[union-attr]
    for host, r in zip(hosts, rows, strict=True):
        for name in host.names():
            assert same(r.get(name), host.get(name)[:K]), name
    with pytest.raises(ValueError, match="2 taken"):
        arena.take(K, hosts[0].row_pitch)
    with pytest.raises(ValueError, match=r"asked \[4, "):
        SlotArena(2, K, hosts[0].row_pitch, CPU).take(4, hosts[0].row_pitch)


def test_a_paged_model_holds_its_slot_rows_in_one_arena() -> None:
    """Every paged layer's packed slot rows are consecutive parts of the model's one SlotArena (MoeShared.slots), so
    torch's allocator rounds one allocation up to 2 MiB, not one a layer; split rows and offload make none."""
    from test_prefill import TINY

    from paged_experts.model import MoeCausalLM

    model = MoeCausalLM.from_pretrained(TINY, _runtime(mode="paged", resident_experts=6, expert_rows="packed"))
    layers = model.moe_layers
    arena = layers[0].shared.slots
    assert arena is not None and tuple(arena.buffer.shape[:2]) == (len(layers), 6)
    part = arena.buffer[0].numel()
    offsets = [layer.device_experts.packed.data_ptr() - arena.buffer.data_ptr() for layer in layers]  # type: ignore[attr-defined]
    assert offsets == [i * part for i in range(len(layers))]
    split = MoeCausalLM.from_pretrained(TINY, _runtime(mode="paged", resident_experts=6))
    assert split.moe_layers[0].shared.slots is None
    offload = MoeCausalLM.from_pretrained(TINY, _runtime(mode="offload", expert_rows="packed"))  # no slots to hold
    assert offload.moe_layers[0].host.packed is not None and offload.moe_layers[0].shared.slots is None  # type: ignore[attr-defined]


# ---- the device row copy kernel and the DMA proxy -----------------------------------------------------------


def check_copy_kernel_copies_packed_rows_and_ranges() -> None:
    from paged_experts.kernels import copy_kernel

    experts = torch.tensor([7, E, 2, 3], dtype=torch.int64)  # one padding entry
    slot_ids = torch.tensor([0, K, 3, 4], dtype=torch.int64)
    for names in (None, GATE_UP, DOWN):
        for programs, one_launch in ((None, True), (None, False), (3, True)):
            host, slots = filled(E, 1, True, True), filled(K + 1, 2, True, True)
            want = filled(K + 1, 2, True, True)
            for e, s in ((7, 0), (2, 3), (3, 4)):
                for name in host.names():
                    if names is None or name in names:
                        want.get(name)[s] = host.get(name)[e]
            srcs, dsts = host.copy_views(names), slots.copy_views(names)
            if one_launch and programs is None:
                copy_kernel.launch_copy_rows(srcs, dsts, experts, slot_ids, E)
            else:
                for s_t, d_t in zip(srcs, dsts):
                    copy_kernel.launch_copy(s_t, d_t, experts, slot_ids, E, programs)
            for name in host.names():
                assert same(slots.get(name), want.get(name)), (names, programs, one_launch, name)
    print("ok")


def test_copy_kernel_copies_packed_rows_in_the_interpreter() -> None:
    pytest.importorskip("triton")
    assert run_interpreted("test_packed_rows", "check_copy_kernel_copies_packed_rows_and_ranges").strip() == "ok"


def test_the_dma_proxy_copies_a_packed_record_as_one_copy_an_expert(tmp_path: Path) -> None:
    from test_dma_proxy import _served, _write_record

    from paged_experts.residency.dma_proxy import DmaProxy

    proxy = DmaProxy(CPU, max_pairs=6, backend="host", ring_slots=4, cache_dir=tmp_path)
    try:
        host, slots = filled(E, 1, True, True), filled(K + 1, 2, True, True)
        table = proxy.table(host, slots)
        ticket, copies = 0, 0
        for names in (GATE_UP, DOWN, None):
            ticket += 1
            _write_record(proxy, ticket, table, [7, E, 2], [0, K, 3], DmaProxy.mask(host, names))
            _served(proxy, ticket)
            copies += 2  # two planned experts, one copy each whatever the range
            assert proxy.stats()["copies"] == copies, names
            for name in host.names():
                if names is None or name in names:
                    assert same(slots.get(name)[0], host.get(name)[7]) and same(slots.get(name)[3], host.get(name)[2])
        # the ranges' bytes, padding included (the proxy counts what it copied): gate/up + down is a row, then a row
        assert proxy.stats()["bytes"] == 2 * 2 * host.row_pitch
        split_host, split_slots = filled(E, 1, True, False), filled(K + 1, 2, True, False)
        ticket += 1
        _write_record(proxy, ticket, proxy.table(split_host, split_slots), [7], [0], DmaProxy.mask(split_host, None))
        _served(proxy, ticket)
        assert proxy.stats()["copies"] == copies + 6  # split: a copy a tensor
    finally:
        proxy.close()


# ---- whole models -------------------------------------------------------------------------------------------


def _runtime(**kw: object) -> RuntimeConfig:
    return RuntimeConfig(**kw)  # type: ignore[arg-type]


def test_paged_models_with_packed_rows_equal_resident() -> None:
    from test_prefill import TINY, TINY_FP8, assert_same, long_prompt

    from paged_experts.model import MoeCausalLM

    for path, dtype in ((TINY_FP8, "float32"), (TINY, "bfloat16"), (TINY, "float32")):
        want = long_prompt(MoeCausalLM.from_pretrained(path, _runtime(mode="resident", dtype=dtype)), 96)
        for k, extra in ((4, {}), (9, {"page_in": "batch"}), (8, {"device_planning": "on"})):
            model = MoeCausalLM.from_pretrained(
                path, _runtime(mode="paged", resident_experts=k, dtype=dtype, expert_rows="packed", **extra)
            )
            layer = model.moe_layers[0]
            assert layer.host.packed is not None and layer.device_experts.packed is not None  # type: ignore[attr-defined]
            assert_same(long_prompt(model, 96), want, f"{path} {dtype} K={k} {extra}")
        offload = MoeCausalLM.from_pretrained(path, _runtime(mode="offload", dtype=dtype, expert_rows="packed"))
        assert_same(long_prompt(offload, 96), want, f"{path} {dtype} offload")


def test_resident_layers_stay_split() -> None:
    from test_prefill import TINY

    from paged_experts.model import MoeCausalLM

    model = MoeCausalLM.from_pretrained(TINY, _runtime(mode="offload", offload_layers=1, expert_rows="packed"))
    packed = [layer.host.packed is not None for layer in model.moe_layers]
    assert packed[0] and not any(packed[1:])


# ---- the option ---------------------------------------------------------------------------------------------


def test_the_option_is_checked_where_it_is_set() -> None:
    with pytest.raises(ValueError, match="expert_rows"):
        RuntimeConfig(expert_rows="dense")  # type: ignore[arg-type]
    from paged_experts.server.options import problems

    for mode in ("resident", "cpu-experts"):
        found = list(problems({"mode": mode, "expert_rows": "packed"}))
        assert [p.option for p in found] == ["expert_rows"] and mode in found[0].message
    for mode in ("paged", "offload"):
        assert not list(problems({"mode": mode, "expert_rows": "packed"}))
    for mode in ("resident", "paged", "offload", "cpu-experts"):  # the default is never a problem
        assert not list(problems({"mode": mode, "expert_rows": "auto"}))


def test_auto_packs_the_rows_of_mode_paged_on_cuda_only() -> None:
    """The default (configs/h200/packed.yaml's rule met on the H100, 2026-12-06): packed where measured to win,
    paged on CUDA; split on the CPU (the layouts tie there) and for CUDA offload (not measured). The runtime,
    the server and the adapter's manifest resolve it by one function."""
    from benchsuite.engines.builtin.adapter import BuiltinOptions
    from paged_experts.residency.page_in import resolve_expert_rows
    from paged_experts.server.options import ServeOptions

    assert RuntimeConfig().expert_rows == "auto" and ServeOptions(model_path="m").expert_rows == "auto"
    want = {("paged", "cuda"): "packed", ("paged", "cpu"): "split", ("offload", "cuda"): "split"}
    want |= {("offload", "cpu"): "split", ("resident", "cuda"): "split", ("cpu-experts", "cuda"): "split"}
    for (mode, device), layout in want.items():
        for unset in ("auto", None):
            assert resolve_expert_rows(unset, mode, device) == layout, (mode, device)
        for explicit in ("split", "packed"):  # an explicit layout is kept on every device and mode
            assert resolve_expert_rows(explicit, mode, device) == explicit
        extra = {"paged": {"resident_experts": 8}, "offload": {"offload_layers": 1}, "cpu-experts": {"n_cpu_moe": 1}}
        options = BuiltinOptions(mode=mode, device=device, **extra.get(mode, {}))  # type: ignore[arg-type]
        assert options.resolved_expert_rows() == layout, (mode, device)  # what the manifest records
    paged = RuntimeConfig(mode="paged", resident_experts=8)  # the CPU: split, unless asked
    assert paged.rows_layout == "split" and not paged.packs_rows("paged")
    asked = RuntimeConfig(mode="paged", resident_experts=8, expert_rows="packed")
    assert asked.rows_layout == "packed" and asked.packs_rows("paged") and not asked.packs_rows("resident")


def test_a_cpu_paged_model_keeps_split_rows_unless_asked() -> None:
    from test_prefill import TINY

    from paged_experts.model import MoeCausalLM

    default = MoeCausalLM.from_pretrained(TINY, _runtime(mode="paged", resident_experts=8))
    assert all(layer.host.packed is None for layer in default.moe_layers)
    asked = MoeCausalLM.from_pretrained(TINY, _runtime(mode="paged", resident_experts=8, expert_rows="packed"))
    assert all(layer.host.packed is not None for layer in asked.moe_layers)


def test_a_checkpoint_loads_into_packed_rows_and_equals_resident(tmp_path: Path) -> None:
    """The loader's path (weights/loader.py: a checkpoint's experts written into the packed views), not the
    in-memory synthetic model's: bf16-shaped fp32 and block-FP8 checkpoints, paged with `direct` and `batch`
    page-ins and offloaded, equal resident bit for bit."""
    from test_prefill import assert_same, long_prompt

    from paged_experts.model import MoeCausalLM
    from paged_experts.weights.synth import write_checkpoint

    for preset in ("tiny", "tiny-fp8"):
        ckpt = write_checkpoint(preset, tmp_path / preset, layers=2, seed=3)
        want = long_prompt(MoeCausalLM.from_pretrained(ckpt, _runtime(mode="resident")), 96)
        for extra in ({"mode": "paged", "resident_experts": 6, "page_in": "direct"},
                      {"mode": "paged", "resident_experts": 6, "page_in": "batch"}, {"mode": "offload"}):  # fmt: skip
            model = MoeCausalLM.from_pretrained(ckpt, _runtime(expert_rows="packed", **extra))
            assert model.moe_layers[0].host.packed is not None  # type: ignore[attr-defined]
            assert_same(long_prompt(model, 96), want, f"{preset} {extra}")
