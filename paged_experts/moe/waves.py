"""Expert kernels for host-planned passes: a layer-step's routed pairs computed wave by wave.

A pass starts from the step's routed ids on the host (`begin`), then each wave computes the pairs
of some experts from the table rows that hold them (`wave(table, experts, rows)`: a slot table
for a paged wave, the `[E, ...]` store or the device experts otherwise), and `finish` weights and
sums the pairs over k. Which wave served an expert never changes its bits (experts.py, fused.py).

- `fused` (default): each wave's pairs as grouped matmuls over the table (`fused.run_pairs`); it
  also has a device pass without host planning (`device_pass`: `fused.experts_over_rows`, used by
  resident, offload and device-planned paged layers);
- `loop`: the per-expert reference (three matmuls per routed expert, `experts.run_experts`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from paged_experts.experts import build_dispatch, combine, run_experts
from paged_experts.kernels.fused import combine_pairs, group_pairs, run_pairs
from paged_experts.store import ExpertTensors


class WavePass(Protocol):
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
        self.flat = ids_cpu.reshape(-1).to(torch.long)  # [T*k] on the host
        self.top_k = ids_cpu.shape[1]
        self.num_experts = num_experts
        self.device = device
        self.y_pairs = self.x.new_empty(self.flat.numel(), self.x.shape[1])  # [T*k, H]

    def wave(self, table: ExpertTensors, experts: Sequence[int], rows: Sequence[int]) -> None:
        slot_of = torch.full((self.num_experts,), -1, dtype=torch.long)  # [E]
        rows_t = torch.tensor(rows, dtype=torch.long)  # [n]
        if table.is_fp8:  # dequantize only this wave's experts: a compact table, row i = rows[i]
            table = table.dense(self.x.dtype, _to_device(rows_t, table.gate.device))
            rows_t = torch.arange(len(rows), dtype=torch.long)
        slot_of[torch.tensor(experts, dtype=torch.long)] = rows_t
        pair_row = slot_of[self.flat]  # [T*k], -1 for pairs of other waves
        mine = torch.nonzero(pair_row >= 0).reshape(-1)  # [P_w]
        sub_order, offs, _ = group_pairs(pair_row[mine], table.num_rows)
        packed = _to_device(torch.cat([mine[sub_order], offs.to(torch.long)]), self.device)  # [P_w + rows]
        order, offs_dev = packed[: mine.numel()], packed[mine.numel() :].to(torch.int32)
        run_pairs(self.x, table, order, offs_dev, self.top_k, self.y_pairs)

    def finish(self, weights: torch.Tensor) -> torch.Tensor:
        return combine_pairs(self.y_pairs, weights)


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor sent without blocking the host: pinned first on CUDA (the caching host allocator
    keeps the block until the copy has run); a plain copy blocks the host until the stream drains."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


class _LoopPass:
    def __init__(self, x: torch.Tensor, ids_cpu: torch.Tensor, num_experts: int, device: torch.device) -> None:
        self.dispatch = build_dispatch(ids_cpu.to(torch.long), num_experts, device)
        self.x_sorted = x.to(device)[self.dispatch.tokens]  # [T*k, H]
        self.y_sorted = torch.empty_like(self.x_sorted)  # [T*k, H]

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
