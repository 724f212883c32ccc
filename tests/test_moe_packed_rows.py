"""The expert kernels over packed rows (every tensor of an expert in one byte row of a uint8 buffer [N, pitch], each
tensor a strided view: `t[e]` contiguous, `t.stride(0)` the pitch over the element size) compute exactly the bits
they compute over contiguous tables holding the same values: moe_triton's gate/up and down passes (plain, SKIP,
both down variants, READ with either side packed) and moe_grouped_fp8's matmul and gated product (with and without
a row map). READ's write-through lands the host rows' bytes in the missed slots' views and no other byte of the
buffer (the alignment padding and the other rows keep theirs).

The kernels run in Triton's interpreter in a child process (TRITON_INTERPRET=1, CPU: tests/interpreted.py), fp32
activations over fp32, bf16 and block-FP8 weights. The layout here is the test's own (`packed`), the order and
alignment of residency/store.py's: the kernels see only the views' strides. tests/test_moe_triton_switch.py checks
that a contiguous table compiles to the code it always did."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from interpreted import run_interpreted

from paged_experts import fp8

ALIGN = 256  # bytes: each tensor of a packed row starts on this boundary, and the pitch is a multiple of it
ORDER = ("gate", "up", "gate_scale", "up_scale", "down", "down_scale")


def packed(tables: dict[str, torch.Tensor], gen: torch.Generator) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The same values in packed rows: (buffer [N, pitch] uint8, name -> view of it). Tensors in ORDER (those
    present), each at an ALIGN-byte offset; the padding between them holds random bytes (a kernel reading it
    would show)."""
    n = next(iter(tables.values())).shape[0]
    offsets, pitch = {}, 0
    for name in (m for m in ORDER if m in tables):
        t = tables[name]
        offsets[name] = pitch
        pitch += -(-t[0].numel() * t.element_size() // ALIGN) * ALIGN
    buffer = torch.randint(0, 256, (n, pitch), dtype=torch.uint8, generator=gen)  # [N, pitch]
    views = {}
    for name, off in offsets.items():
        t = tables[name]
        views[name] = buffer[:, off : off + t[0].numel() * t.element_size()].view(t.dtype).view(t.shape)
        fp8.raw(views[name]).copy_(fp8.raw(t))
        assert views[name].stride(0) == pitch // t.element_size() != t[0].numel(), name  # strided, not contiguous
    return buffer, views


def experts(e: int, h: int, i: int, kind: str, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Contiguous expert tables: gate/up [E, I, H], down [E, H, I] in `kind` (float32, bfloat16, or fp8 with scales)."""
    shapes = {"gate": (e, i, h), "up": (e, i, h), "down": (e, h, i)}
    if kind != "fp8":
        return {n: (torch.randn(*s, generator=gen) / 8).to(getattr(torch, kind)) for n, s in shapes.items()}
    out = {}
    for name, shape in shapes.items():
        out[name], out[f"{name}_scale"] = fp8.quantize(torch.randn(*shape, generator=gen) / 8)
    return out


def args(t: dict[str, torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    """moe_pairs's weights and scales of a table."""
    return [t["gate"], t["up"], t["down"]], [t.get("gate_scale"), t.get("up_scale"), t.get("down_scale")]


def tile_sets(kind: str) -> list[dict | None]:
    """Both down variants (a token's pairs loaded together, one after another) at the dtype's tiles."""
    from paged_experts.kernels import moe_tiles

    if kind == "fp8":
        return [None, moe_tiles.parse_fp8_tiles("gate_up=16x128x4,down=16x128x4")]
    base = moe_tiles.CONFIGS
    return [{**base, "down": replace(base["down"], pair_vector=v)} for v in (True, False)]


# (tokens, experts, top_k, hidden, intermediate, weights): partial tiles and scale blocks on both axes,
# a row read by two tokens' pairs
PAIR_CASES = ((3, 8, 3, 160, 48, "float32"), (2, 6, 2, 96, 32, "bfloat16"), (2, 6, 2, 256, 192, "fp8"))


def check_pairs() -> None:
    """moe_pairs over packed tables == over contiguous ones, both down variants; gate_up_pairs with SKIP: the
    same rows written, the skipped pairs' rows left as they were."""
    from paged_experts.experts import route
    from paged_experts.kernels import moe_triton

    gen = torch.Generator().manual_seed(11)
    for t, e, k, h, i, kind in PAIR_CASES:
        table = experts(e, h, i, kind, gen)
        _, views = packed(table, gen)
        x = torch.randn(t, h, generator=gen)
        rows, topw = route(torch.randn(t, e, generator=gen), k, True)
        rows[1] = rows[0]
        rows = rows.reshape(-1).contiguous()  # [T*k]
        assert int(rows.max()) > 0  # a row past the first: a wrong stride reads another expert
        for tiles in tile_sets(kind):
            want = moe_triton.moe_pairs(x, rows, topw, *args(table)[0], k, *args(table)[1], tiles=tiles)
            got = moe_triton.moe_pairs(x, rows, topw, *args(views)[0], k, *args(views)[1], tiles=tiles)
            assert want.abs().sum() > 0 and torch.equal(got, want), (kind, tiles, (got - want).abs().max())
        # SKIP: pairs of row -1 are another launch's
        skipping = torch.where(torch.arange(t * k) % 2 == 0, rows, -1)  # [T*k]
        hids = []
        for tab in (table, views):
            w, s = args(tab)
            hid = torch.full((t * k, i), 7.0)  # [T*k, I]
            tiles = moe_triton.pass_tiles(x, w[0], k, s[0] is not None)
            moe_triton.gate_up_pairs(x, skipping, w[0], w[1], s[0], s[1], hid, k, tiles, skip_negative=True)
            hids.append(hid)
        assert torch.equal(hids[1], hids[0]) and (hids[0][1::2] == 7.0).all() and (hids[0][::2] != 7.0).any()
        print("ok", (t, e, k, h, i, kind))


# (experts, slots, top_k, hidden, intermediate, weights): one token, every pair a miss but its last (a hit)
READ_CASES = ((10, 6, 3, 160, 48, "float32"), (8, 5, 3, 256, 192, "fp8"))


def check_read_through() -> None:
    """A batch-1 step whose misses the kernels read from the host rows (`moe_pairs(read=...)`) with the host rows,
    the slots, or both packed: the bits of both sides contiguous, and the missed slots' views then hold their host
    rows while every other byte of the slots' buffer (padding, the other rows) keeps its value."""
    from paged_experts.kernels import moe_triton
    from paged_experts.residency.store import ExpertTensors

    gen = torch.Generator().manual_seed(12)
    for e, kslots, k, h, i, kind in READ_CASES:
        host = experts(e, h, i, kind, gen)
        slots = {n: fp8.raw(v)[torch.randint(0, e, (kslots,), generator=gen)].view(v.dtype) for n, v in host.items()}
        ids = torch.randperm(e, generator=gen)[:k]  # [k] distinct experts (one token)
        slot_ids = torch.randperm(kslots, generator=gen)[:k]  # [k] the slot of each pair
        src = torch.where(torch.arange(k) < k - 1, ids, -1)  # [k] all but the last pair miss
        for name, v in slots.items():  # the hits' rows already in their slots
            fp8.raw(v)[slot_ids[-1]] = fp8.raw(host[name])[ids[-1]]
        x = torch.randn(1, h, generator=gen)
        topw = torch.softmax(torch.randn(1, k, generator=gen), -1)
        host_buf, host_views = packed(host, gen)
        host_before = host_buf.clone()
        for tiles in tile_sets(kind):
            flat = {n: v.clone() for n, v in slots.items()}
            read = moe_triton.ReadThrough(src, ExpertTensors(**host))
            want = moe_triton.moe_pairs(x, slot_ids, topw, *args(flat)[0], k, *args(flat)[1], tiles=tiles, read=read)
            landed = {n: fp8.raw(v).clone() for n, v in flat.items()}
            for n, v in slots.items():  # the contiguous slots hold exactly their host rows now
                expect = fp8.raw(v).clone()
                expect[slot_ids[:-1]] = fp8.raw(host[n])[ids[:-1]]
                assert torch.equal(landed[n], expect), (kind, n)
            for host_packed, slots_packed in ((True, True), (True, False), (False, True)):
                slot_buf, slot_views = (
                    packed(slots, gen) if slots_packed else (None, {n: v.clone() for n, v in slots.items()})
                )
                before = None if slot_buf is None else slot_buf.clone()  # [K, pitch]
                read = moe_triton.ReadThrough(src, ExpertTensors(**(host_views if host_packed else host)))
                w, s = args(slot_views)
                got = moe_triton.moe_pairs(x, slot_ids, topw, *w, k, *s, tiles=tiles, read=read)
                case = (kind, host_packed, slots_packed)
                assert torch.equal(got, want), (case, (got - want).abs().max())
                for n, v in slot_views.items():
                    assert torch.equal(fp8.raw(v), landed[n]), (case, n)
                if slot_buf is not None and before is not None:  # no byte written outside the views' missed rows
                    expect_buf = before.clone()
                    for n, v in packed_views_of(expect_buf, slots).items():
                        fp8.raw(v).copy_(landed[n])
                    assert not torch.equal(expect_buf, before) and torch.equal(slot_buf, expect_buf), case
        assert torch.equal(host_buf, host_before), "the host rows were written"
        print("ok", (e, kslots, k, h, i, kind))


def packed_views_of(buffer: torch.Tensor, tables: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`packed`'s views of tables' tensors over an existing buffer of that layout (no values copied)."""
    views, off = {}, 0
    for name in (m for m in ORDER if m in tables):
        t = tables[name]
        nbytes = t[0].numel() * t.element_size()
        views[name] = buffer[:, off : off + nbytes].view(t.dtype).view(buffer.shape[0], *t.shape[1:])
        off += -(-nbytes // ALIGN) * ALIGN
    assert off == buffer.shape[1]
    return views


# (pairs, groups, N, K, pairs covered by the groups): partial N and K tiles, empty groups, rows past the last group
GROUPED_CASES = ((24, 5, 160, 256, 20), (9, 4, 128, 130, 9))


def check_grouped() -> None:
    """grouped_fp8_mm (down rows; plain and scattering) and grouped_fp8_glu (gate and up rows; plain and gathering)
    over a packed table == over the contiguous one; gate and up rows at different strides are refused."""
    from paged_experts.kernels.moe_grouped_fp8 import RowMap, block_table, grouped_fp8_glu, grouped_fp8_mm
    from paged_experts.kernels.moe_tiles import GroupedTiles

    gen = torch.Generator().manual_seed(13)
    tiles = GroupedTiles(block_m=8, block_n=32, block_k=64, num_warps=4, num_stages=2)
    for p, g, n, k, covered in GROUPED_CASES:
        # gate/up [G, N, K] and down [G, K, N]: the grouped matmul reads the first as [N, K], down as [K, N] rows
        table = experts(g, k, n, "fp8", gen)
        _, views = packed(table, gen)
        cuts = torch.sort(torch.randint(0, covered + 1, (g - 1,), generator=gen)).values
        offs = torch.cat([cuts, torch.tensor([covered])]).to(torch.int32)  # [G] cumulative
        blocks = block_table(offs, p, tiles.block_m)
        a = torch.randn(p, k, generator=gen)  # [P, K]
        hid = torch.randn(p, n, generator=gen)  # [P, N]
        perm = torch.randperm(p, generator=gen)  # [P] a row map over every row
        outs = []
        for tab in (table, views):
            gate, up = (tab["gate"], tab["gate_scale"]), (tab["up"], tab["up_scale"])
            glu = grouped_fp8_glu(a, gate, up, blocks, tiles)  # [P, N]
            gathered = grouped_fp8_glu(a, gate, up, blocks, tiles, RowMap(perm, 0, p))  # [P, N]
            down = grouped_fp8_mm(hid, tab["down"], tab["down_scale"], blocks, tiles)  # [P, K]
            y = torch.full((p, k), 7.0)
            grouped_fp8_mm(hid, tab["down"], tab["down_scale"], blocks, tiles, (y, RowMap(perm, 0, p)))
            outs.append((glu[:covered], gathered[:covered], down[:covered], y))
        for name, want, got in zip(("glu", "gathered glu", "down", "scattered down"), *outs):
            assert want.abs().sum() > 0 and torch.equal(got, want), (name, (p, g, n, k), (got - want).abs().max())
        try:  # one offset reads a group's gate and up rows: a packed gate with a contiguous up is refused
            grouped_fp8_glu(a, (views["gate"], views["gate_scale"]), (table["up"], table["up_scale"]), blocks, tiles)
        except ValueError as exc:
            assert "gate/up" in str(exc), exc
        else:
            raise AssertionError("gate and up rows at different strides were read at one offset")
        print("ok", (p, g, n, k, covered))


@pytest.mark.parametrize(("check", "cases"), [("check_pairs", PAIR_CASES), ("check_read_through", READ_CASES),
                                              ("check_grouped", GROUPED_CASES)])  # fmt: skip
def test_packed_rows_compute_the_contiguous_bits_in_the_interpreter(check: str, cases: tuple) -> None:
    pytest.importorskip("triton")
    out = run_interpreted("test_moe_packed_rows", check)
    assert out.count("ok ") == len(cases), out


def test_row_stride_takes_packed_rows_and_refuses_what_the_kernels_cannot_read() -> None:
    from paged_experts.kernels.moe_triton import row_stride, shared_stride

    gen = torch.Generator().manual_seed(14)
    table = experts(4, 256, 128, "fp8", gen)
    buffer, views = packed(table, gen)
    assert row_stride(table["gate"], "gate") == 128 * 256 and row_stride(table["gate_scale"], "s") == 2
    assert row_stride(views["gate"], "gate") == buffer.shape[1]  # fp8: one element a byte
    assert row_stride(views["down_scale"], "s") == buffer.shape[1] // 4
    assert shared_stride(views["gate"], views["up"], "gate/up") == buffer.shape[1]
    assert row_stride(table["gate"][:1], "one row") == 128 * 256
    with pytest.raises(ValueError, match="must be contiguous"):
        row_stride(table["gate"].transpose(1, 2), "gate")  # [E, H, I] read as rows of I: not one row's layout
    with pytest.raises(ValueError, match="must be contiguous"):
        row_stride(table["gate"][:, :, ::2], "gate")
    with pytest.raises(ValueError, match="overlap"):
        row_stride(torch.zeros(1, 8, 4).expand(3, 8, 4), "gate")
    with pytest.raises(ValueError, match="gate/up"):
        shared_stride(views["gate"], table["up"], "gate/up")
