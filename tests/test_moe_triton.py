"""The decode kernels of moe_triton (routing; gate+up per pair; down with the top-k combine) and
attn_triton (GQA decode attention over a KV row table) against plain torch, in the Triton
interpreter (TRITON_INTERPRET=1, CPU, fp32). Skipped where Triton is absent (the CPU torch wheel has
none); tests/cuda/test_device_paging_cuda.py runs the same checks compiled, in bf16, on a GPU
(`check_kernels(device="cuda", ...)`, `check_attention(...)`).

Triton reads TRITON_INTERPRET when it is imported, so the checks run in a child interpreter
started with it set (this process may already hold a compiled Triton)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from dataclasses import replace
from typing import Any

import pytest
import torch
import torch.nn.functional as F

# (tokens, experts, top_k, hidden, intermediate): H spans partial K blocks, I partial N blocks;
# the last case shares experts between tokens (rows read by several pairs).
CASES = ((1, 16, 4, 160, 48), (3, 10, 2, 300, 40), (4, 6, 3, 96, 24), (2, 128, 8, 64, 32))


def reference_moe(x, rows, topw, gate, up, down, top_k: int) -> torch.Tensor:
    """Per pair in fp32: silu(x W_g^T) * (x W_u^T) W_d^T, summed over k with the routing weights."""
    t = x.shape[0]
    out = torch.zeros(t, x.shape[1], dtype=torch.float32, device=x.device)
    for p, r in enumerate(rows.tolist()):
        xt = x[p // top_k].float()
        h = F.silu(xt @ gate[r].float().T) * (xt @ up[r].float().T)
        out[p // top_k] += topw.reshape(-1)[p].float() * (h @ down[r].float().T)
    return out


def check_kernels(device: str = "cpu", dtype: torch.dtype = torch.float32, tol: float = 1e-4) -> None:
    from paged_experts.experts import route
    from paged_experts.kernels import moe_tiles, moe_triton

    gen = torch.Generator().manual_seed(0)
    for t, e, k, h, i in CASES:
        logits = torch.randn(t, e, generator=gen).to(device, dtype)
        for norm in (True, False):
            ids, w = moe_triton.route(logits, k, norm)
            ref_ids, ref_w = route(logits, k, norm)
            assert ids.dtype == torch.int64 and w.dtype == torch.float32
            # the same logits in the same (descending) order: ids may differ only between equal logits
            assert torch.equal(logits.gather(1, ids), logits.gather(1, ref_ids)), (ids, ref_ids)
            assert all(len(set(row)) == k for row in ids.tolist())
            torch.testing.assert_close(w, ref_w, rtol=1e-5, atol=1e-6)
        gate = (torch.randn(e, i, h, generator=gen) / 8).to(device, dtype)
        up = (torch.randn(e, i, h, generator=gen) / 8).to(device, dtype)
        down = (torch.randn(e, h, i, generator=gen) / 8).to(device, dtype)
        x = torch.randn(t, h, generator=gen).to(device, dtype)
        rows, topw = route(logits, k, True)
        if t > 1:  # token 1 reuses token 0's experts: a row serves several pairs
            rows[1] = rows[0]
        want = reference_moe(x, rows.reshape(-1), topw, gate, up, down, k)
        # the down pass both ways: pairs one after another, and a token's pairs loaded together
        vec_tiles = {**moe_tiles.CONFIGS, "down": replace(moe_tiles.CONFIGS["down"], pair_vector=True)}
        loop_tiles = {**moe_tiles.CONFIGS, "down": replace(moe_tiles.CONFIGS["down"], pair_vector=False)}
        vec = moe_triton.moe_pairs(x, rows.reshape(-1), topw, gate, up, down, k, tiles=vec_tiles)
        got = moe_triton.moe_pairs(x, rows.reshape(-1), topw, gate, up, down, k, tiles=loop_tiles)
        assert got.shape == (t, h) and got.dtype == dtype and vec.shape == got.shape
        torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol * max(1.0, want.abs().max().item()))
        torch.testing.assert_close(vec.float(), want, rtol=tol, atol=tol * max(1.0, want.abs().max().item()))
        # a slot table holding the same experts in other rows gives the same bits (paged == resident)
        perm = torch.randperm(e, generator=gen).to(device)
        slot_of = torch.argsort(perm)  # expert -> its row in the permuted table
        paged = moe_triton.moe_pairs(x, slot_of[rows.reshape(-1)], topw, gate[perm], up[perm], down[perm], k)
        assert torch.equal(paged, got)
        print("ok", (t, e, k, h, i))


# (tokens, experts, top_k, hidden, intermediate) for FP8 experts: partial 128-blocks on both axes,
# several blocks per row, and shared experts between tokens.
FP8_CASES = ((1, 8, 2, 300, 200), (3, 12, 4, 256, 192), (2, 6, 3, 130, 128))
# tiles beside the defaults: the one-pair down loop, steps of 512 and 256 columns (several scale
# blocks per step, partial at the edge), one-row tiles, and the old kernels' 16 x 128
FP8_TILES = ("gate_up=16x512x4,down=8x256x4", "gate_up=1x256x2,down=32x64x2xv", "gate_up=16x128x4,down=16x128x4")


def check_fp8_kernels(device: str = "cpu", dtype: torch.dtype = torch.float32, tol: float = 1e-4) -> None:
    """The FP8 kernels against the dequantized weights in fp32 (fp8.dequantize), and a permuted slot
    table (paged) against the table in expert order (resident): the same bits."""
    from paged_experts import fp8
    from paged_experts.experts import route
    from paged_experts.kernels import moe_tiles, moe_triton

    gen = torch.Generator().manual_seed(1)
    for t, e, k, h, i in FP8_CASES:
        q = {}
        for name, shape in (("gate", (e, i, h)), ("up", (e, i, h)), ("down", (e, h, i))):
            w, s = fp8.quantize(torch.randn(*shape, generator=gen) / 8)
            q[name] = (w.to(device), s.to(device))
        x = torch.randn(t, h, generator=gen).to(device, dtype)
        rows, topw = route(torch.randn(t, e, generator=gen), k, True)
        if t > 1:
            rows[1] = rows[0]
        rows, topw = rows.to(device), topw.to(device)
        dense = [fp8.dequantize(w, s, torch.float32) for w, s in q.values()]
        want = reference_moe(x, rows.reshape(-1), topw, *dense, k)
        weights = [q[n][0] for n in ("gate", "up", "down")]
        scales = [q[n][1] for n in ("gate", "up", "down")]
        got = moe_triton.moe_pairs(x, rows.reshape(-1), topw, *weights, k, *scales)
        assert got.shape == (t, h) and got.dtype == dtype
        torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol * max(1.0, want.abs().max().item()))
        for tiles in FP8_TILES:  # every kernel variant and steps spanning several scale blocks
            parsed = moe_tiles.parse_fp8_tiles(tiles)
            out = moe_triton.moe_pairs(x, rows.reshape(-1), topw, *weights, k, *scales, tiles=parsed)
            torch.testing.assert_close(out.float(), want, rtol=tol, atol=tol * max(1.0, want.abs().max().item()))
        perm = torch.randperm(e, generator=gen).to(device)
        slot_of = torch.argsort(perm)
        paged = moe_triton.moe_pairs(
            x, slot_of[rows.reshape(-1)], topw, *(w[perm] for w in weights), k, *(s[perm] for s in scales)
        )
        assert torch.equal(paged, got)
        print("ok", (t, e, k, h, i))


# (experts, slots, top_k, hidden, intermediate, FP8) for the read-through page-in: one token whose pairs are
# all misses, some, or none; partial tiles and scale blocks on both axes.
READ_CASES = ((16, 8, 4, 160, 48, False), (12, 6, 3, 300, 200, True), (10, 10, 4, 256, 192, True))


def check_read_through(device: str = "cpu", dtype: torch.dtype = torch.float32) -> None:
    """A batch-1 step whose misses the expert kernels read from the host store (`moe_pairs(read=...)`):
    the same bits as copying the misses into their slots first and computing from the slots, and the
    missed slots then hold exactly their host rows (the other slots untouched), for every tile variant.
    Host rows come from pinned host memory on CUDA, from CPU tensors in the interpreter."""
    from paged_experts import fp8
    from paged_experts.kernels import moe_tiles, moe_triton
    from paged_experts.residency.store import ExpertTensors

    gen = torch.Generator().manual_seed(2)
    for e, kslots, k, h, i, is_fp8 in READ_CASES:
        shapes = {"gate": (e, i, h), "up": (e, i, h), "down": (e, h, i)}
        if is_fp8:
            q = {n: fp8.quantize(torch.randn(*sh, generator=gen) / 8) for n, sh in shapes.items()}
            host = [q[n][0] for n in shapes] + [q[n][1] for n in shapes]
            tile_sets = [None, *(moe_tiles.parse_fp8_tiles(t) for t in FP8_TILES)]
        else:
            host = [(torch.randn(*sh, generator=gen) / 8).to(dtype) for sh in shapes.values()]
            vec = {**moe_tiles.CONFIGS, "down": replace(moe_tiles.CONFIGS["down"], pair_vector=True)}
            loop = {**moe_tiles.CONFIGS, "down": replace(moe_tiles.CONFIGS["down"], pair_vector=False)}
            tile_sets = [vec, loop]
        if device == "cuda":
            host = [t.pin_memory() for t in host]
        x = torch.randn(1, h, generator=gen).to(device, dtype)
        topw = torch.softmax(torch.randn(1, k, generator=gen), -1).to(device)
        for misses in (0, 1, k):  # pairs 0..misses-1 miss, the rest hit: none, one, all
            ids = torch.randperm(e, generator=gen)[:k]  # [k] distinct experts (one token)
            slot_ids = torch.randperm(kslots, generator=gen)[:k]  # [k] the slot serving each pair
            src = torch.where(torch.arange(k) < misses, ids, -1)  # [k]
            # the slots: garbage everywhere, the hits' rows in their slots
            slots = [torch.randn(kslots, *t.shape[1:], generator=gen).to(t.dtype) for t in host]
            for t_slot, t_host in zip(slots, host):
                hit = src < 0
                t_slot[slot_ids[hit]] = t_host[ids[hit]]
            copied = [t.clone() for t in slots]  # the misses copied in first: what the copy path computes from
            for t_copy, t_host in zip(copied, host):
                t_copy[slot_ids] = t_host[ids]
            copied = [t.to(device) for t in copied]
            rows, src_d = slot_ids.to(device), src.to(device)
            for tiles in tile_sets:
                dev_slots = [t.to(device) for t in slots]
                read = moe_triton.ReadThrough(src_d, ExpertTensors(*host))
                weights, scales = dev_slots[:3], dev_slots[3:]
                got = moe_triton.moe_pairs(x, rows, topw, *weights, k, *scales, tiles=tiles, read=read)
                want = moe_triton.moe_pairs(x, rows, topw, *copied[:3], k, *copied[3:], tiles=tiles)
                assert torch.equal(got, want), (e, misses, tiles)
                for t_got, t_want in zip(dev_slots, copied):  # missed slots written, every other slot as it was
                    assert torch.equal(fp8.raw(t_got).cpu(), fp8.raw(t_want).cpu()), (e, misses, tiles)
        print("ok", (e, kslots, k, h, i, is_fp8))


# (pairs, groups, N, K, pairs covered by the groups) for the grouped FP8 matmul: empty groups, groups
# over several row blocks, partial N and K tiles, and rows past the last group (the overlapped pass
# leaves them to the other pass).
GROUPED_CASES = ((40, 6, 160, 256, 40), (7, 12, 128, 130, 7), (50, 5, 96, 128, 31))
GLU_CASES = (*GROUPED_CASES, (20, 3, 100, 128, 20))  # and an N that is no multiple of the tile's


def check_grouped_fp8(device: str = "cpu", dtype: torch.dtype = torch.float32, tol: float = 1e-4) -> None:
    """moe_grouped_fp8 against the dequantized weights per group (fp32), its block table against the
    plain definition, and a pair's bits independent of its neighbours (a paged wave's table)."""
    from paged_experts import fp8
    from paged_experts.kernels.moe_grouped_fp8 import BlockTable, block_table, grouped_fp8_mm, host_block_tables
    from paged_experts.kernels.moe_tiles import GroupedTiles

    gen = torch.Generator().manual_seed(2)
    tiles = GroupedTiles(block_m=16, block_n=32, block_k=64, num_warps=4, num_stages=2)
    for p, g, n, k, covered in GROUPED_CASES:
        cuts = torch.sort(torch.randint(0, covered + 1, (g - 1,), generator=gen)).values
        offs = torch.cat([cuts, torch.tensor([covered])]).to(torch.int32)  # [G] cumulative, some groups empty
        w, s = fp8.quantize(torch.randn(g, n, k, generator=gen) / 8)
        a = torch.randn(p, k, generator=gen)
        blocks = block_table(offs.to(device), p, tiles.block_m)
        want_blocks = [
            (gi, m, int(offs[gi]))  # the block's first row and its group's end
            for gi in range(g)
            for m in range(int(offs[gi - 1]) if gi else 0, int(offs[gi]), tiles.block_m)
        ]
        got_blocks = [(int(x), int(y), int(z)) for x, y, z in zip(*(t.cpu() for t in blocks)) if x >= 0]
        assert got_blocks == want_blocks, (offs, got_blocks, want_blocks)
        assert blocks.group.shape[0] == -(-p // tiles.block_m) + min(g, p)
        assert (blocks.group.cpu()[len(want_blocks) :] == -1).all()
        got = grouped_fp8_mm(a.to(device, dtype), w.to(device), s.to(device), blocks, tiles)
        # the same blocks laid out on the host (moe/waves.py, one upload a step): no padding, the same bits
        counts = torch.diff(offs, prepend=torch.zeros(1, dtype=offs.dtype)).numpy()[None]  # [1, G]
        host, _, (count,) = host_block_tables(counts, tiles.block_m)
        assert [tuple(int(v) for v in col) for col in host[:, :count].T] == want_blocks
        laid = BlockTable(*(torch.from_numpy(row[:count]).to(device) for row in host))
        again = grouped_fp8_mm(a.to(device, dtype), w.to(device), s.to(device), laid, tiles)
        assert torch.equal(again[:covered], got[:covered])  # rows past the last group: no block writes them
        dense = fp8.dequantize(w, s, torch.float32)  # [G, N, K]
        start = 0
        for gi, end in enumerate(offs.tolist()):
            want = a[start:end] @ dense[gi].T  # [rows, N]
            if end == start:
                continue
            torch.testing.assert_close(
                got[start:end].float().cpu(), want, rtol=tol, atol=tol * max(1.0, want.abs().max().item())
            )
            start = end
        # the same pairs computed one group at a time from a permuted table (a paged wave): the same bits
        perm = torch.randperm(g, generator=gen)
        first = 0
        for gi, end in enumerate(offs.tolist()):
            if end > first:
                one = torch.tensor([end - first], dtype=torch.int32)
                wave = grouped_fp8_mm(
                    a[first:end].to(device, dtype),
                    w[perm][torch.argsort(perm)[gi]][None].to(device),
                    s[gi][None].to(device),
                    block_table(one.to(device), end - first, tiles.block_m),
                    tiles,
                )
                assert torch.equal(wave, got[first:end]), (gi, (wave - got[first:end]).abs().max())
            first = end
        print("ok", (p, g, n, k, covered))


def check_grouped_fp8_glu(device: str = "cpu", dtype: torch.dtype = torch.float32, tol: float = 1e-4) -> None:
    """grouped_fp8_glu (gate, up, silu and their product in one launch) against the four launches it replaces
    (grouped_fp8_mm twice, F.silu, the product) and against the dequantized weights in fp32; a pair's bits
    independent of its neighbours (one group alone, as a paged wave computes it)."""
    import torch.nn.functional as F

    from paged_experts import fp8
    from paged_experts.kernels.moe_grouped_fp8 import block_table, grouped_fp8_glu, grouped_fp8_mm
    from paged_experts.kernels.moe_tiles import GroupedTiles

    gen = torch.Generator().manual_seed(5)
    tiles = GroupedTiles(block_m=16, block_n=32, block_k=64, num_warps=4, num_stages=2)
    for p, g, n, k, covered in GLU_CASES:
        cuts = torch.sort(torch.randint(0, covered + 1, (g - 1,), generator=gen)).values
        offs = torch.cat([cuts, torch.tensor([covered])]).to(torch.int32)  # [G] cumulative, some groups empty
        gate = tuple(t.to(device) for t in fp8.quantize(torch.randn(g, n, k, generator=gen) / 8))
        up = tuple(t.to(device) for t in fp8.quantize(torch.randn(g, n, k, generator=gen) / 8))
        a = torch.randn(p, k, generator=gen).to(device, dtype)  # [P, K]
        blocks = block_table(offs.to(device), p, tiles.block_m)
        got = grouped_fp8_glu(a, gate, up, blocks, tiles)[:covered].float().cpu()  # [covered, N]
        four = F.silu(grouped_fp8_mm(a, *gate, blocks, tiles)) * grouped_fp8_mm(a, *up, blocks, tiles)
        four = four[:covered].float().cpu()
        # rounded at the same points; the exponential is Triton's, not torch's: closeness asserted, bits reported
        torch.testing.assert_close(got, four, rtol=tol, atol=tol * max(1.0, four.abs().max().item()))
        same = (got == four).float().mean().item()
        dense_g, dense_u = fp8.dequantize(*gate, torch.float32).cpu(), fp8.dequantize(*up, torch.float32).cpu()
        start = 0
        for gi, end in enumerate(offs.tolist()):
            if end > start:
                x = a[start:end].float().cpu()
                want = F.silu(x @ dense_g[gi].T) * (x @ dense_u[gi].T)  # [rows, N]
                scale = max(1.0, want.abs().max().item())
                torch.testing.assert_close(got[start:end], want, rtol=5 * tol, atol=5 * tol * scale)
                one = torch.tensor([end - start], dtype=torch.int32, device=device)
                alone = grouped_fp8_glu(
                    a[start:end],
                    (gate[0][gi : gi + 1], gate[1][gi : gi + 1]),
                    (up[0][gi : gi + 1], up[1][gi : gi + 1]),
                    block_table(one, end - start, tiles.block_m),
                    tiles,
                )
                assert torch.equal(alone.float().cpu(), got[start:end]), gi
            start = end
        print("ok", (p, g, n, k, covered), f"same bits as the four launches: {same:.4f}")


# (tokens, top_k, experts, slots, staging rows, seed): a host-planned step's waves over the slots and the staging rows
LAID_OUT_CASES = ((40, 4, 16, 6, 3, 0), (64, 2, 12, 5, 4, 1))


def check_laid_out_blocks(device: str = "cpu", dtype: torch.dtype = torch.float32) -> None:
    """A step's waves laid out by `_FusedPass.plan_waves` with their block tables (moe/waves.py): each wave's
    columns of the one [3, NB] table, sliced at their aligned offsets, compute through the grouped FP8 kernel
    exactly what `block_table` over the same wave's counts computes, for waves from the staging rows (fewer
    rows) and from the slots."""
    from paged_experts import fp8
    from paged_experts.kernels.moe_grouped_fp8 import ALIGN_BLOCKS, BlockTable, block_table, grouped_fp8_mm
    from paged_experts.kernels.moe_tiles import GroupedTiles
    from paged_experts.moe.waves import FUSED
    from paged_experts.residency.planner import STAGING, Wave

    tiles = GroupedTiles(block_m=8, block_n=32, block_k=64, num_warps=4, num_stages=2)
    for t, k, e, slots, rows, seed in LAID_OUT_CASES:
        gen = torch.Generator().manual_seed(seed)
        ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])  # [T, k]
        experts = torch.randperm(e, generator=gen).tolist()
        staged, rest = experts[:rows], experts[rows:]
        waves = [Wave(tuple(staged), tuple(range(rows)), (), 0, STAGING)]
        waves += [Wave(tuple(rest[i : i + slots]), tuple(range(len(rest[i : i + slots]))), (), 0)
                  for i in range(0, len(rest), slots)]  # fmt: skip
        x = torch.randn(t, 128, generator=gen).to(device, dtype)  # [T, H]
        run = FUSED.begin(x, ids, e, torch.device(device))
        run.plan_waves(waves, slots, tiles.block_m)
        laid = run.laid  # type: ignore[attr-defined]
        w, sc = fp8.quantize(torch.randn(slots, 96, 128, generator=gen) / 8)
        for i, wave in enumerate(waves):
            start, end = laid.starts[i], laid.starts[i + 1]
            if end == start:
                continue
            table_rows = rows if wave.table == STAGING else slots
            b0 = laid.block_starts[i]
            assert b0 % ALIGN_BLOCKS == 0 and laid.blocks.storage_offset() % ALIGN_BLOCKS == 0
            cols = slice(b0, b0 + laid.block_counts[i])
            mine = BlockTable(laid.blocks[0, cols], laid.blocks[1, cols], laid.blocks[2, cols])
            assert int(mine.group.max()) < table_rows  # a staging wave's groups are staging rows
            a = x[laid.tokens[start:end]]  # [P_w, H]
            ref = block_table(laid.offs[i, :table_rows].contiguous(), end - start, tiles.block_m)
            want = grouped_fp8_mm(a, w[:table_rows], sc[:table_rows], ref, tiles)
            got = grouped_fp8_mm(a, w[:table_rows], sc[:table_rows], mine, tiles)
            assert torch.equal(got, want), (i, (got - want).abs().max())
        print("ok", (t, k, e, slots, rows, seed))


# (tokens, top_k, experts, slots, seed): a host-planned step's waves, each computed with its rows read and written
# through the layout (RowMap) and through a gather and an index copy
ROW_MAP_CASES = ((40, 4, 16, 6, 0), (33, 2, 12, 5, 1))


def check_row_maps(
    device: str = "cpu", dtype: torch.dtype = torch.float32, tiles: Any = None, hidden: int = 128, inter: int = 96
) -> None:
    """The grouped FP8 launches with their rows read (`gather`) and written (`scatter`) through a wave's run of the
    step's layout compute the same bits as the gathered copy, the launch and the index copy they replace (moe/waves.py
    ROWS_IN_KERNEL), and write no other row: per launch, and through `_FusedPass.wave` for whole steps (a first row
    that is not 16-byte aligned among them), with the gated launch and with four, with block tables laid out with
    the plan and built per wave. `tiles` (default: small ones) and the shape: a GPU test passes the production's."""
    from paged_experts import fp8
    from paged_experts.kernels import fused
    from paged_experts.kernels.moe_grouped_fp8 import RowMap, block_table, grouped_fp8_glu, grouped_fp8_mm
    from paged_experts.kernels.moe_tiles import GroupedTiles
    from paged_experts.moe import waves as waves_module
    from paged_experts.residency.planner import LayerResidency
    from paged_experts.residency.store import ExpertTensors

    tiles = tiles or GroupedTiles(block_m=8, block_n=32, block_k=64, num_warps=4, num_stages=2)
    for t, k, e, slots, seed in ROW_MAP_CASES:
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(t, hidden, generator=gen).to(device, dtype)  # [T, H]
        # one launch each way: rows 3.. of a permutation of the pairs, in 2 groups
        perm = torch.randperm(t * k, generator=gen).to(device)  # [T*k]
        tokens = torch.div(perm, k, rounding_mode="floor")  # [T*k]
        first, num = 3, t * k - 5
        offs = torch.tensor([num // 2, num], dtype=torch.int32, device=device)
        blocks = block_table(offs, num, tiles.block_m)
        gate = tuple(q.to(device) for q in fp8.quantize(torch.randn(2, inter, hidden, generator=gen) / 8))
        up = tuple(q.to(device) for q in fp8.quantize(torch.randn(2, inter, hidden, generator=gen) / 8))
        down = tuple(q.to(device) for q in fp8.quantize(torch.randn(2, hidden, inter, generator=gen) / 8))
        want_h = grouped_fp8_glu(x[tokens[first : first + num]], gate, up, blocks, tiles)
        got_h = grouped_fp8_glu(x, gate, up, blocks, tiles, RowMap(tokens, first, num))
        assert torch.equal(got_h, want_h), (got_h - want_h).abs().max()
        want_y = torch.full((t * k, hidden), 7.0, dtype=dtype, device=device)
        want_y.index_copy_(0, perm[first : first + num], grouped_fp8_mm(want_h, *down, blocks, tiles))
        got_y = torch.full((t * k, hidden), 7.0, dtype=dtype, device=device)
        out = grouped_fp8_mm(want_h, *down, blocks, tiles, (got_y, RowMap(perm, first, num)))
        assert out is got_y and torch.equal(got_y, want_y)  # the rows outside the map kept their 7s
        # whole steps through the waves, their tables FP8 on this device (the grouped kernel as on a GPU)
        real_tiles, real_glu, real_rows = fused.fp8_grouped_tiles, fused.GLU_ONE_LAUNCH, waves_module.ROWS_IN_KERNEL
        fused.fp8_grouped_tiles = waves_module.fp8_grouped_tiles = lambda w: tiles if w.is_fp8 else None  # type: ignore[assignment]
        try:
            host = ExpertTensors.empty(e, hidden, inter, dtype, torch.device(device), is_fp8=True)
            for name in ("gate", "up", "down"):
                q, sc = fp8.quantize(torch.randn(e, *host.get(name).shape[1:], generator=gen) / 8)
                host.get(name).copy_(q)
                host.get(f"{name}_scale").copy_(sc)
            ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])  # [T, k]
            weights = torch.rand(t, k, generator=gen).to(device, dtype)
            plan = LayerResidency(e, slots, prefill_keep="recent").plan_step(ids.reshape(-1).numpy())
            # each wave served from the store's own rows (so one table holds every expert; the bits are the slots')
            waves = [dataclasses.replace(w, slots=w.experts) for w in plan.waves]
            assert len(waves) >= 3, len(waves)
            for glu_one_launch in (True, False):
                fused.GLU_ONE_LAUNCH = glu_one_launch
                for block_m in (tiles.block_m, None):  # the tables laid out with the plan, or built a wave
                    results = []
                    for rows_in_kernel in (False, True):
                        waves_module.ROWS_IN_KERNEL = rows_in_kernel
                        run = waves_module.FUSED.begin(x, ids, e, torch.device(device))
                        run.y_pairs.fill_(float("nan"))  # type: ignore[attr-defined]  # a row left unwritten shows
                        run.plan_waves(waves, e, block_m)
                        for wave in waves:
                            run.wave(host, wave.experts, wave.slots)
                        results.append(run.finish(weights))
                    assert any(s % 2 for s in run.laid.starts[:-1]), run.laid.starts  # type: ignore[attr-defined]
                    assert not results[1].isnan().any() and torch.equal(results[0], results[1]), (
                        glu_one_launch,
                        block_m,
                        (results[0] - results[1]).abs().max(),
                    )
        finally:
            fused.fp8_grouped_tiles = waves_module.fp8_grouped_tiles = real_tiles  # type: ignore[assignment]
            fused.GLU_ONE_LAUNCH, waves_module.ROWS_IN_KERNEL = real_glu, real_rows
        print("ok", (t, k, e, slots, seed))


# (batch, query heads, KV heads, head dim, block size, positions): GQA groups of 1, 4 and 8,
# contexts inside one block of the online softmax, across several, a sequence that has only its
# first token, and a block size that does not divide the softmax block.
ATTENTION_CASES = ((1, 8, 2, 16, 16, (5,)), (3, 4, 4, 32, 16, (0, 70, 127)), (2, 32, 4, 128, 8, (63, 9)),
                   (2, 8, 2, 16, 4, (200, 1)))  # fmt: skip


def check_attention(device: str = "cpu", dtype: torch.dtype = torch.float32, tol: float = 1e-4) -> None:
    from paged_experts.attention import attend
    from paged_experts.kernels.attn_triton import decode_attention

    gen = torch.Generator().manual_seed(0)
    for b, nh, kvh, d, bs, pos in ATTENTION_CASES:
        width = max(pos) // bs + 3  # the pool's table width: more blocks than any sequence holds
        num_blocks = b * width + 2
        slots = num_blocks * bs
        kv_k = torch.randn(slots, kvh, d, generator=gen).to(device, dtype)  # [slots, kvh, D]
        kv_v = torch.randn(slots, kvh, d, generator=gen).to(device, dtype)
        positions = torch.tensor(pos, device=device)  # [B]
        # each sequence's blocks scattered over the pool; entries past its last block are padding
        blocks = torch.randperm(num_blocks, generator=gen)[: b * width].view(b, width).to(device)  # [B, W]
        length = max(pos) + 1
        cols = torch.arange(length, device=device)[None, :]  # [1, L]
        rows = blocks.gather(1, (cols // bs).expand(b, -1)) * bs + cols % bs  # [B, L] KV row of each position
        mask = torch.where(cols <= positions[:, None], 0.0, torch.finfo(torch.float32).min)  # [B, L]
        q = torch.randn(b, nh, d, generator=gen).to(device, dtype)
        got = decode_attention(q, kv_k, kv_v, blocks, positions, bs)
        want = attend(q.float()[:, None], kv_k.float(), kv_v.float(), rows, mask[:, None, :])[:, 0]
        assert got.shape == (b, nh * d) and got.dtype == dtype
        torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)
        print("ok", (b, nh, kvh, d, bs, pos))


@pytest.mark.parametrize(
    ("check", "cases"),
    [
        ("check_kernels", CASES),
        ("check_attention", ATTENTION_CASES),
        ("check_fp8_kernels", FP8_CASES),
        ("check_grouped_fp8", GROUPED_CASES),
        ("check_grouped_fp8_glu", GLU_CASES),
        ("check_laid_out_blocks", LAID_OUT_CASES),
        ("check_row_maps", ROW_MAP_CASES),
        ("check_read_through", READ_CASES),
    ],
)
def test_decode_kernels_match_torch_in_the_interpreter(check: str, cases: tuple) -> None:
    pytest.importorskip("triton")
    code = f"import sys; sys.path.insert(0, sys.argv[1]); import test_moe_triton as t; t.{check}()"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, "-c", code, os.path.dirname(__file__)], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert done.stdout.count("ok ") == len(cases)


def test_row_maps_compile_for_the_h200_as_the_plain_kernels() -> None:
    """The grouped FP8 kernels with their rows read or written through a map (moe/waves.py ROWS_IN_KERNEL) compile
    for the H200 (sm_90) at the production's tiles to the same matmul code as without one: the same tensor-core
    instructions, the same 16-byte asynchronous loads into shared memory and 16-byte stores (an index that broke
    the loads' vectorization or their pipelining would show here); only the index loads are added."""
    triton = pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the interpreter compiles nothing")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from paged_experts.kernels import moe_grouped_fp8 as g
    from paged_experts.kernels.moe_tiles import fp8_prefill

    tiles = fp8_prefill(2048, 768)
    assert tiles is not None

    def ptx(fn: Any, n: int, k: int, gather: bool, scatter: bool) -> str:
        kinds = {"a": "*bf16", "out": "*bf16", "row0": "i32", "a_rows": "*i64", "out_rows": "*i64"}
        kinds |= {name: "*fp8e4nv" for name in ("w", "wg", "wu")} | {name: "*fp32" for name in ("s", "sg", "su")}
        kinds |= {name: "*i32" for name in ("blk_group", "blk_m0", "blk_m1")}
        constants = {"N": n, "K": k, "QB": g.QUANT_BLOCK, "BM": tiles.block_m, "BN": tiles.block_n,
                     "BK": tiles.block_k, "IEEE": False, "GATHER": gather, "SCATTER": scatter,
                     "W_STRIDE": n * k, "S_STRIDE": (n // g.QUANT_BLOCK) * (k // g.QUANT_BLOCK)}  # fmt: skip
        signature = {a: "constexpr" if a in constants else kinds[a] for a in fn.arg_names}
        # what the launcher derives for real tensors: every pointer 16-byte aligned
        attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names) if kinds.get(a, "")[:1] == "*"}
        src = ASTSource(fn, signature, constants, attrs)
        options = {"num_warps": tiles.num_warps, "num_stages": tiles.num_stages}
        return str(triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"])

    def counts(code: str) -> tuple[int, ...]:
        return tuple(code.count(s) for s in ("wgmma.mma_async", "cp.async.cg.shared.global", "st.global.v4"))

    plain_glu, gathered = (
        ptx(g._grouped_fp8_glu, 768, 2048, False, False),
        ptx(g._grouped_fp8_glu, 768, 2048, True, False),
    )
    plain_down, scattered = ptx(g._grouped_fp8, 2048, 768, False, False), ptx(g._grouped_fp8, 2048, 768, False, True)
    for plain, mapped in ((plain_glu, gathered), (plain_down, scattered)):
        assert counts(mapped) == counts(plain) and all(counts(plain)), (counts(plain), counts(mapped))
        print("ok", counts(plain))
