"""Host expert store (all E experts of every per-expert tensor) and the K-slot table on the device.

Experts are stacked per layer as `[E, ...]` tensors (gate `[E, I, H]`, up `[E, I, H]`,
down `[E, H, I]`), so an expert is one contiguous row and a page-in is a row copy. On a CUDA
machine the host rows that are ever copied to the GPU live in pinned memory: pageable memory
copies at about a tenth of the link speed (DESIGN.md section 5). The pinned store is page-locked
at its exact size by `pinned.py` (torch's allocator would round each tensor up to a power of two).

Page-in of a wave's misses never synchronizes the host per expert. Strategies:
- `index` (CPU default): one `index_copy_` per tensor;
- `direct` (CUDA default): one `non_blocking` copy per contiguous run of rows, straight from the
  pinned store into the slots; the copies queue back-to-back on the stream;
- `staged` (CUDA): gather the rows into a pinned staging buffer on the host, one `non_blocking`
  copy per tensor to a device staging buffer, then one `index_copy_` into the slots. The staging
  buffer is reused, so the host waits for the previous staged copy (once per wave, not per expert).

Measured on the H200 test machine (benchmarks/results/h200/pagein_h200.txt; bf16 Qwen3-30B-A3B experts, 4 layers,
random experts into random slots): `direct` 51.8-52.3 GB/s for m >= 4 experts per layer, 93.5-94.4%
of the 55.4 GB/s pinned 1 GiB copy ceiling; `staged` 16-32 GB/s because the host gather runs before
the copy instead of alongside it. Hence `direct` is the CUDA default.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from paged_experts import pinned
from paged_experts.counters import PagingCounters

EXPERT_TENSORS: tuple[str, ...] = ("gate", "up", "down")
"""Per-expert tensors. Page-in walks this tuple; the fault-injection test removes one name."""


@dataclass(frozen=True)
class ExpertTensors:
    """One layer's stacked expert weights: gate/up `[N, I, H]`, down `[N, H, I]` (N = E or K)."""

    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor

    def get(self, name: str) -> torch.Tensor:
        return getattr(self, name)

    @classmethod
    def empty(
        cls, n: int, hidden: int, inter: int, dtype: torch.dtype, device: torch.device, pin: bool = False
    ) -> ExpertTensors:
        shapes = [(n, inter, hidden), (n, inter, hidden), (n, hidden, inter)]  # gate, up, down
        if pin and device.type == "cpu" and torch.cuda.is_available():
            gate, up, down = pinned.empty_pinned(shapes, dtype)  # exact size: torch would round each up to 2^k
            return cls(gate=gate, up=up, down=down)
        gate, up, down = (torch.empty(s, dtype=dtype, device=device, pin_memory=pin) for s in shapes)
        return cls(gate=gate, up=up, down=down)

    @property
    def num_rows(self) -> int:
        return int(self.gate.shape[0])


def contiguous_runs(pairs: Sequence[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(src_row, dst_row, length) runs of consecutive rows, so neighbours copy as one block."""
    runs: list[tuple[int, int, int]] = []
    for src, dst in sorted(pairs, key=lambda p: p[1]):
        if runs and runs[-1][0] + runs[-1][2] == src and runs[-1][1] + runs[-1][2] == dst:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((src, dst, 1))
    return runs


class PageInEngine:
    """Copies host rows into device rows for one device; owns the staging buffers and timing."""

    def __init__(self, device: torch.device, strategy: str, hidden: int, inter: int, dtype: torch.dtype, max_rows: int) -> None:
        if strategy == "auto":
            strategy = "direct" if device.type == "cuda" else "index"
        if strategy == "staged" and device.type != "cuda":
            raise ValueError("page_in='staged' needs a CUDA device (it overlaps pinned staging with the copy stream)")
        self.device = device
        self.strategy = strategy
        self._staging_host: ExpertTensors | None = None
        self._staging_dev: ExpertTensors | None = None
        self._staging_free: torch.cuda.Event | None = None
        if strategy == "staged":
            self._staging_host = ExpertTensors.empty(max_rows, hidden, inter, dtype, torch.device("cpu"), pin=True)
            self._staging_dev = ExpertTensors.empty(max_rows, hidden, inter, dtype, device)

    def copy_rows(
        self,
        src: ExpertTensors,
        dst: ExpertTensors,
        pairs: Sequence[tuple[int, int]],
        counters: PagingCounters | None = None,
        layer: int = 0,
        row_bytes: int = 0,
    ) -> None:
        """Copies src row `s` to dst row `d` for every (s, d) in `pairs`, for every expert tensor."""
        if not pairs:
            return
        timing_cuda = self.device.type == "cuda"
        if timing_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        else:
            t0 = time.perf_counter()
        if self.strategy == "index":
            self._copy_index(src, dst, pairs)
        elif self.strategy == "direct":
            self._copy_direct(src, dst, pairs)
        else:
            self._copy_staged(src, dst, pairs)
        if counters is not None:
            if timing_cuda:
                end.record()
                counters.record_copy_events(layer, start, end)
                counters.record_copy(layer, bytes_h2d=len(pairs) * row_bytes)
            else:
                counters.record_copy(layer, bytes_h2d=len(pairs) * row_bytes, copy_time_s=time.perf_counter() - t0)

    def _copy_index(self, src: ExpertTensors, dst: ExpertTensors, pairs: Sequence[tuple[int, int]]) -> None:
        src_idx = torch.tensor([p[0] for p in pairs], dtype=torch.long)  # [m]
        dst_idx = torch.tensor([p[1] for p in pairs], dtype=torch.long, device=self.device)  # [m]
        for name in EXPERT_TENSORS:
            dst.get(name).index_copy_(0, dst_idx, src.get(name).index_select(0, src_idx).to(self.device))

    def _copy_direct(self, src: ExpertTensors, dst: ExpertTensors, pairs: Sequence[tuple[int, int]]) -> None:
        runs = contiguous_runs(pairs)
        for name in EXPERT_TENSORS:
            s_t, d_t = src.get(name), dst.get(name)
            for s, d, n in runs:
                d_t[d : d + n].copy_(s_t[s : s + n], non_blocking=True)

    def _copy_staged(self, src: ExpertTensors, dst: ExpertTensors, pairs: Sequence[tuple[int, int]]) -> None:
        assert self._staging_host is not None and self._staging_dev is not None
        m = len(pairs)
        if m > self._staging_host.num_rows:
            raise ValueError(f"wave pages in {m} experts but staging holds {self._staging_host.num_rows}")
        if self._staging_free is not None:
            self._staging_free.synchronize()  # the previous staged copy may still read the buffer
        src_idx = torch.tensor([p[0] for p in pairs], dtype=torch.long)  # [m]
        dst_idx = torch.tensor([p[1] for p in pairs], dtype=torch.long).to(self.device, non_blocking=True)  # [m]
        for name in EXPERT_TENSORS:
            host_buf = self._staging_host.get(name)[:m]
            torch.index_select(src.get(name), 0, src_idx, out=host_buf)
            dev_buf = self._staging_dev.get(name)[:m]
            dev_buf.copy_(host_buf, non_blocking=True)
            dst.get(name).index_copy_(0, dst_idx, dev_buf)
        self._staging_free = torch.cuda.Event()
        self._staging_free.record()


def to_device_rows(src: ExpertTensors, rows: int, device: torch.device) -> ExpertTensors:
    """A device copy of the first `rows` experts (the initial slots hold experts 0..K-1)."""
    return ExpertTensors(
        gate=src.gate[:rows].to(device, copy=True),
        up=src.up[:rows].to(device, copy=True),
        down=src.down[:rows].to(device, copy=True),
    )
