"""Expert kernels for host-planned passes: a layer-step's routed pairs computed wave by wave.

A pass starts from the step's routed ids on the host (`begin`), then each wave computes the pairs
of some experts from the table rows that hold them (`wave(table, experts, rows)`: a slot table
for a paged wave, the `[E, ...]` store or the device experts otherwise), and `finish` weights and
sums the pairs over k. Which wave served an expert never changes its bits (experts.py, fused.py).

- `fused` (default): each wave's pairs as grouped matmuls over the table (`fused.expert_mlp`), the
  step's waves laid out at once (`plan_waves`); it also has a device pass without host planning
  (`device_pass`: `fused.experts_over_rows`, used by resident, offload and device-planned paged layers);
- `loop`: the per-expert reference (three matmuls per routed expert, `experts.run_experts`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from paged_experts.experts import build_dispatch, combine, run_experts
from paged_experts.kernels.fused import combine_pairs, expert_mlp, fp8_expert_mlp, fp8_grouped_tiles
from paged_experts.kernels.moe_grouped_fp8 import ALIGN_BLOCKS, BlockTable, RowMap, host_block_tables
from paged_experts.residency.planner import Wave
from paged_experts.residency.store import ExpertTensors
from paged_experts.upload import to_device

ROWS_IN_KERNEL = True
"""A wave's grouped FP8 launches read its pairs' activations and write their outputs through the step's laid-out
order (`RowMap`): no gather of the activations before them and no index copy after, two host ops and two kernels
a wave fewer on the host-bound paged prefill. False: the gather and the copy, as before (an A/B switch, as
fused.GLU_ONE_LAUNCH). The arithmetic is the same either way (tests/test_moe_triton.py checks the bits; the H200's
CUDA tests too). Its speed on the H200 was within the spread between processes (2026-12-05, docs/prefill.md)."""


class WavePass(Protocol):
    def plan_waves(self, waves: Sequence[Wave], num_rows: int, block_m: int | None = None) -> None:
        """The step's whole wave plan (every routed expert in exactly one wave, at a row < num_rows of the
        table every wave reads), before its first `wave`: the pass lays out all waves at once. block_m: the
        grouped FP8 kernel's row block where the tables run it (`fused.fp8_grouped_tiles`): the pass then
        lays out every wave's block table too (None: each wave's kernel builds its own)."""
        ...

    def wave(self, table: ExpertTensors, experts: Sequence[int], rows: Sequence[int]) -> None:
        """Computes the pairs routed to `experts[i]` from `table` row `rows[i]`."""
        ...

    def finish(self, weights: torch.Tensor) -> torch.Tensor:
        """weights [T, k] -> [T, H] on the compute device."""
        ...


class WaveKernel(Protocol):
    name: str
    device_pass: bool  # has a one-wave pass over device tensors with no host planning

    def begin(self, x: torch.Tensor, ids_cpu: torch.Tensor, num_experts: int, device: torch.device) -> WavePass:
        """x [T, H] (any device), ids_cpu [T, k] on the host; computes on `device`."""
        ...


class _FusedPass:
    def __init__(self, x: torch.Tensor, ids_cpu: torch.Tensor, num_experts: int, device: torch.device) -> None:
        self.x = x.to(device)  # [T, H]
        flat = ids_cpu.reshape(-1).to(torch.long)  # [T*k] on the host
        self.top_k = ids_cpu.shape[1]
        self.device = device
        self.y_pairs = self.x.new_empty(flat.numel(), self.x.shape[1])  # [T*k, H]
        self.num_experts = num_experts
        self.flat = flat
        self.laid: _LaidOut | None = None  # set by plan_waves: every wave's pairs laid out at once

    def plan_waves(self, waves: Sequence[Wave], num_rows: int, block_m: int | None = None) -> None:
        """Lays out every wave's pairs once for the step, so a wave costs the host a slice and its kernel
        launches, not ~20 small torch ops and a host-to-device copy (the host bounds a paged prefill: ~7.6
        waves a layer at K=49 on a 2,048-token chunk). Pairs are sorted by (wave, row): a wave's pairs are one
        contiguous run of the step's sorted activations, grouped by the row that serves them, each row's
        pairs in increasing pair order (as `wave` sorts them: the same groups, so the same bits). With
        `block_m`, every wave's block table of the grouped FP8 kernel too (`host_block_tables`: the blocks
        `block_table` builds on the device, one launch a wave, from the counts the host has here), in the
        same upload."""
        if self.flat.numel() == 0:
            return  # no pair, no wave: nothing to lay out
        stride = num_rows + 1
        key = np.full(self.num_experts, len(waves) * stride, dtype=np.int64)  # [E] (wave, row) of each routed expert
        for w, wave in enumerate(waves):
            for expert, row in zip(wave.experts, wave.slots):
                if not (0 <= row < num_rows and key[expert] == len(waves) * stride):
                    raise AssertionError(f"wave {w}: expert {expert} in row {row} (rows {num_rows}) or served twice")
                key[expert] = w * stride + row
        pair_key = key[self.flat.numpy()]  # [T*k]
        if int(pair_key.max(initial=0)) >= len(waves) * stride:
            raise AssertionError("a routed expert is in no wave")
        # 16-bit keys sort by radix (0.06 ms for 16,384 pairs; int64's merge sort took ~1 ms here)
        small = pair_key.astype(np.int16) if len(waves) * stride <= np.iinfo(np.int16).max else pair_key
        order = np.argsort(small, kind="stable")  # [T*k]
        counts = np.bincount(pair_key, minlength=len(waves) * stride).reshape(len(waves), stride)[:, :num_rows]
        offs = np.cumsum(counts, axis=1)  # [W, rows]: each wave's cumulative pairs per row, from its own start
        ends = np.cumsum(offs[:, -1]) if num_rows else np.zeros(len(waves), dtype=np.int64)  # [W]
        tables, block_starts, block_counts = (
            host_block_tables(counts, block_m) if block_m else (np.empty((3, 0), np.int32), None, None)
        )
        pad = np.zeros(-offs.size % ALIGN_BLOCKS, dtype=np.int64)  # the tables start 16-byte aligned
        parts = [order, offs.reshape(-1), pad, tables.reshape(-1)]
        packed = to_device(torch.from_numpy(np.concatenate(parts)), self.device)  # one upload
        order_dev = packed[: order.size]  # [T*k]
        as_int32 = packed[order.size :].to(torch.int32)  # offs, padding, then the block tables
        self.laid = _LaidOut(
            waves=tuple(waves), next=0, order=order_dev,
            offs=as_int32[: offs.size].view(len(waves), num_rows),
            starts=[0, *ends.tolist()], tokens=torch.div(order_dev, self.top_k, rounding_mode="floor"),
            block_m=block_m if block_starts is not None else None,
            blocks=as_int32[offs.size + pad.size :].view(3, -1),
            block_starts=None if block_starts is None else block_starts.tolist(),
            block_counts=None if block_counts is None else block_counts.tolist(),
        )  # fmt: skip

    def wave(self, table: ExpertTensors, experts: Sequence[int], rows: Sequence[int]) -> None:
        """Wave i of the laid-out plan: its pairs' run of the sorted activations, its rows' offsets."""
        laid = self.laid
        if laid is None:
            if self.flat.numel() == 0:
                return
            raise AssertionError("plan_waves lays out the step before its first wave")
        i = laid.next
        if i >= len(laid.waves) or tuple(experts) != laid.waves[i].experts or tuple(rows) != laid.waves[i].slots:
            raise AssertionError(f"wave {i} is not the one plan_waves laid out")
        laid.next += 1
        start, end = laid.starts[i], laid.starts[i + 1]
        if end == start:
            return
        offs = laid.offs[i, : table.num_rows]  # [rows] int32 (the layout's rows cover every table: slots, staging)
        tiles = fp8_grouped_tiles(table) if table.is_fp8 else None
        blocks = None
        if tiles is not None and laid.block_starts is not None and tiles.block_m == laid.block_m:
            assert laid.block_counts is not None
            b0 = laid.block_starts[i]
            b1 = b0 + laid.block_counts[i]  # this wave's laid-out blocks (views; the padding after them unused)
            blocks = BlockTable(laid.blocks[0, b0:b1], laid.blocks[1, b0:b1], laid.blocks[2, b0:b1])
        if tiles is not None and ROWS_IN_KERNEL:
            n = end - start  # the wave's pairs: sorted positions start..end of the step's layout
            gather, scatter = RowMap(laid.tokens, start, n), (self.y_pairs, RowMap(laid.order, start, n))
            fp8_expert_mlp(self.x, table, offs, tiles, blocks, gather, scatter)  # writes y_pairs' rows
            return
        if table.is_fp8 and tiles is None:
            # no grouped FP8 kernel: this wave's rows dequantized into a compact table in row order, whose
            # cumulative counts are the full table's at those rows (the other rows hold none of its pairs)
            ordered = torch.tensor(sorted(rows), dtype=torch.long)  # [n]
            table = table.dense(self.x.dtype, to_device(ordered, table.gate.device))
            offs = offs[to_device(ordered, offs.device)]  # [n]
        # gathered per wave (a [P, H] copy of the chunk's activations up front would add 64 MB to a 2,048-token
        # prefill's peak, which sets K at a memory budget)
        y = expert_mlp(self.x[laid.tokens[start:end]], table, offs, blocks)  # [P_w, H]
        self.y_pairs.index_copy_(0, laid.order[start:end], y)

    def finish(self, weights: torch.Tensor) -> torch.Tensor:
        laid = self.laid
        if laid is not None and laid.next != len(laid.waves):
            raise AssertionError(f"{laid.next} of {len(laid.waves)} laid-out waves computed")
        return combine_pairs(self.y_pairs, weights)


@dataclass
class _LaidOut:
    """Every wave of a step laid out at once (`_FusedPass.plan_waves`); P = routed pairs, W = waves."""

    waves: tuple[Wave, ...]
    next: int  # the wave `wave` computes next
    order: torch.Tensor  # [P] pair index at each sorted position
    offs: torch.Tensor  # [W, rows] int32: each wave's cumulative pairs per table row, counted from its start
    starts: list[int]  # [W + 1] each wave's first sorted position, then P
    tokens: torch.Tensor  # [P] token of the pair at each sorted position
    block_m: int | None  # the row block the block tables were laid out for (None: none laid out)
    blocks: torch.Tensor  # [3, NB] int32: every wave's grouped-FP8 blocks (moe_grouped_fp8.host_block_tables)
    block_starts: list[int] | None  # [W + 1] each wave's first column of `blocks`, then NB (aligned)
    block_counts: list[int] | None  # [W] each wave's blocks (columns from its start; the rest is padding)


class _LoopPass:
    def __init__(self, x: torch.Tensor, ids_cpu: torch.Tensor, num_experts: int, device: torch.device) -> None:
        self.dispatch = build_dispatch(ids_cpu.to(torch.long), num_experts, device)
        self.x_sorted = x.to(device)[self.dispatch.tokens]  # [T*k, H]
        self.y_sorted = torch.empty_like(self.x_sorted)  # [T*k, H]

    def plan_waves(self, waves: Sequence[Wave], num_rows: int, block_m: int | None = None) -> None:
        return None  # each wave indexes the dispatch as it comes

    def wave(self, table: ExpertTensors, experts: Sequence[int], rows: Sequence[int]) -> None:
        run_experts(self.x_sorted, table, self.dispatch, experts, rows, self.y_sorted)

    def finish(self, weights: torch.Tensor) -> torch.Tensor:
        return combine(self.y_sorted, self.dispatch, weights)


class _Kernel:
    def __init__(self, name: str, device_pass: bool, make: type) -> None:
        self.name = name
        self.device_pass = device_pass
        self._make = make

    def begin(self, x: torch.Tensor, ids_cpu: torch.Tensor, num_experts: int, device: torch.device) -> WavePass:
        return self._make(x, ids_cpu, num_experts, device)

    def __repr__(self) -> str:
        return f"WaveKernel({self.name})"


FUSED: WaveKernel = _Kernel("fused", True, _FusedPass)
LOOP: WaveKernel = _Kernel("loop", False, _LoopPass)
EXPERT_KERNELS: dict[str, WaveKernel] = {"fused": FUSED, "loop": LOOP}
