"""Host expert store (all E experts of every per-expert tensor) and the K-slot table on the device.

Experts are stacked per layer as `[E, ...]` tensors (gate `[E, I, H]`, up `[E, I, H]`,
down `[E, H, I]`), so an expert is one contiguous row and a page-in is a row copy. On a CUDA
machine the host rows that are ever copied to the GPU live in pinned memory: pageable memory
copies at about a tenth of the link speed (DESIGN.md section 5). The pinned store is page-locked
at its exact size by `pinned.py` (torch's allocator would round each tensor up to a power of two).

Page-in of a wave's misses never synchronizes the host per expert. Strategies:
- `index` (CPU default): on the CPU a `copy_` per tensor and run of rows (no temporary); to another device
  `index_select` then one `index_copy_` per tensor;
- `direct` (CUDA default): one `non_blocking` copy per contiguous run of rows, straight from the
  pinned store into the slots; the copies queue back-to-back on the stream. They are issued in one
  call (`torch._foreach_copy_`, over row views made once per tensor), and where the engine has a
  device row kernel (CUDA with Triton) an FP8 row's three block-scale rows (384 bytes each) go by one
  kernel launch for the whole call instead of one DMA each: a 2,048-token prefill pages in ~86
  experts per layer, and issuing their 516 copies one by one from Python (~15 us each) kept the
  host, not the link, the bound (an 8-layer H200 profile: copy engine busy 204 of 628 ms);
- `kernel` (CUDA with Triton): the whole call as ONE launch of the device row kernel (every tensor of
  every row: `copy_kernel.copy_planned`), after one upload of its (expert, slot) list: SMs read the
  pinned rows over the link (51.3 GB/s at 64 experts against the DMA's 52.9,
  `benchmarks/results/h200/decode_h200_48l.txt`), and the host issues one launch where `direct`
  issues a DMA per tensor and run (~72 a prefill wave of 12 FP8 experts). For the host-bound paged
  prefill; `RuntimeConfig.page_in`, measured by configs/h200/kernelcopy.yaml;
- `batch`: every tensor of every run of rows, FP8 scales included, in ONE driver call
  (`cuMemcpyBatchAsync`, CUDA driver 12.8+: `batch_copy.py`): the host issues one call where `direct` issues a
  DMA per tensor and run, an index upload and a row-kernel launch; the weights' copies are the same DMAs from
  the pinned store, and an FP8 row's three scale rows become three small descriptors a run (where `direct` sends
  them by the row kernel). On the legacy default stream, which the driver refuses, it copies as `direct`; on the CPU the
  same descriptors run as memmoves. For the host-bound paged prefill; measured by configs/h200/batchcopy.yaml;
- `staged` (CUDA): gather the rows into a pinned staging buffer on the host, one `non_blocking`
  copy per tensor to a device staging buffer, then one `index_copy_` into the slots. The staging
  buffer is reused, so the host waits for the previous staged copy (once per wave, not per expert).

Measured on the H200 test machine (benchmarks/results/h200/pagein_h200.txt; bf16 Qwen3-30B-A3B experts, 4 layers,
random experts into random slots): `direct` 51.8-52.3 GB/s for m >= 4 experts per layer, 93.5-94.4%
of the 55.4 GB/s pinned 1 GiB copy ceiling; `staged` 16-32 GB/s because the host gather runs before
the copy instead of alongside it. Hence `direct` is the CUDA default.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from paged_experts import fp8
from paged_experts.residency import pinned
from paged_experts.residency.batch_copy import (
    LEGACY_STREAMS,
    BatchCopy,
    RowTables,
    descriptors,
    memmove_batch,
    row_tables,
)
from paged_experts.residency.counters import PagingCounters
from paged_experts.residency.page_in import PAGE_IN_STRATEGIES
from paged_experts.upload import to_device

log = logging.getLogger(__name__)

EXPERT_TENSORS: tuple[str, ...] = ("gate", "up", "down")
"""Per-expert tensors. Page-in walks this tuple; the fault-injection test removes one name."""
SCALE_TENSORS: tuple[str, ...] = ("gate_scale", "up_scale", "down_scale")
"""Per-expert block scales of FP8 experts, paged with their weights (the FP8 fault test removes one)."""


ROW_ALIGN_BYTES = 256  # each tensor of a packed row starts on this boundary (DMAs and 16-byte loads stay aligned)
PACKED_ORDER: tuple[str, ...] = ("gate", "up", "gate_scale", "up_scale", "down", "down_scale")
"""A packed row's tensors, in row order: gate/up (what an overlapped pass copies first) a prefix, down a suffix."""


@dataclass(frozen=True)
class ExpertTensors:
    """One layer's stacked expert weights: gate/up `[N, I, H]`, down `[N, H, I]` (N = E or K); FP8
    experts (`float8_e4m3fn`) carry float32 block scales gate/up `[N, I/128, H/128]`, down
    `[N, H/128, I/128]` (fp8.py), stored and paged like the weights (an expert's row is all six).

    Two layouts (RuntimeConfig.expert_rows):
    - split: each tensor its own contiguous `[N, ...]` tensor; a page-in of an expert copies each tensor's row
      (an FP8 expert: three weight DMAs and three 384-byte scale rows);
    - packed: every tensor a view of ONE byte row per expert, `packed` [N, pitch] uint8 (tensors in
      `PACKED_ORDER`, each at a ROW_ALIGN_BYTES boundary): a page-in of a run of experts is one DMA, and the
      kernels read each tensor at its stride (`t.stride(0)`; `t[e]` stays contiguous). The same values: the
      kernels compute the same bits either way."""

    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    gate_scale: torch.Tensor | None = None
    up_scale: torch.Tensor | None = None
    down_scale: torch.Tensor | None = None
    packed: torch.Tensor | None = None  # [N, pitch] uint8 that every tensor above views (packed rows), else None
    # copy_views' views, made once per set of tensors (stable objects: the page-in engine caches per view)
    _views: dict[tuple[str, ...], tuple[tuple[torch.Tensor | None, ...], tuple[torch.Tensor, ...]]] = field(
        default_factory=dict, init=False, compare=False, repr=False, hash=False
    )

    def get(self, name: str) -> torch.Tensor:
        t = getattr(self, name)
        assert t is not None, f"{name} of dense experts"
        return t

    @property
    def is_fp8(self) -> bool:
        return self.gate_scale is not None

    def names(self) -> tuple[str, ...]:
        """The tensors an expert's row spans (read at call time: the fault-injection tests narrow them)."""
        return EXPERT_TENSORS + (SCALE_TENSORS if self.is_fp8 else ())

    @property
    def scales(self) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        return self.gate_scale, self.up_scale, self.down_scale

    @property
    def row_bytes(self) -> int:
        """Bytes of one expert (all its tensors, scales included): what a page-in moves, padding aside (a packed row
        moves `row_pitch` bytes, at most 256 a tensor more: 384 for a Qwen3-30B-A3B FP8 expert of 4.72 MB)."""
        tensors = [self.gate, self.up, self.down, *(t for t in self.scales if t is not None)]
        return sum(t[0].numel() * t.element_size() for t in tensors)

    def copy_views(self, names: Sequence[str] | None = None) -> tuple[torch.Tensor, ...]:
        """What a page-in of the tensors `names` (None: every tensor of the row) copies, each a tensor whose dim 0
        is the expert and whose rows are contiguous: split, each wanted tensor (FP8 as bytes); packed, the byte
        ranges of the row that hold them, neighbours merged (the whole row is the whole `packed` buffer, one
        contiguous tensor: a run of experts is one block). Its dim-0 stride may exceed a row (a packed range):
        a copy of several rows then goes row by row. `names()` is read at call time (the fault-injection tests
        narrow it); the views are made once per set."""
        wanted = tuple(n for n in self.names() if names is None or n in names)
        made_of = tuple(getattr(self, n) for n in (*wanted, "packed"))
        cached = self._views.get(wanted)
        if cached is not None and all(a is b for a, b in zip(cached[0], made_of, strict=True)):
            return cached[1]  # made of the tensors the table holds now (a test may swap one in place)
        if self.packed is None:
            views = tuple(fp8.raw(self.get(n)) for n in wanted)
        else:
            pitch = self.packed.shape[1]
            views = tuple(
                self.packed if (a, b) == (0, pitch) else self.packed[:, a:b] for a, b in self._byte_ranges(wanted)
            )
        self._views[wanted] = (made_of, views)
        return views

    def _byte_ranges(self, wanted: tuple[str, ...]) -> list[tuple[int, int]]:
        """[(first byte, end byte)] of the packed row's ranges holding `wanted`, adjacent tensors merged (the
        alignment padding between them goes along); the last range runs to the pitch when it ends the row."""
        assert self.packed is not None
        base, pitch = self.packed.data_ptr(), self.packed.shape[1]
        present = [n for n in PACKED_ORDER if getattr(self, n) is not None]
        offsets = {n: self.get(n).data_ptr() - base for n in present}  # each tensor's first byte in the row
        ranges: list[tuple[int, int]] = []
        prev_wanted = False
        for i, name in enumerate(present):
            if name not in wanted:
                prev_wanted = False
                continue
            start = offsets[name]
            end = offsets[present[i + 1]] if i + 1 < len(present) else pitch  # through the padding after it
            if prev_wanted:
                ranges[-1] = (ranges[-1][0], end)
            else:
                ranges.append((start, end))
            prev_wanted = True
        return ranges

    @property
    def row_pitch(self) -> int:
        """Bytes between two experts' rows of the packed buffer (0 when split)."""
        return 0 if self.packed is None else int(self.packed.shape[1])

    @staticmethod
    def packed_layout(
        hidden: int, inter: int, dtype: torch.dtype, is_fp8: bool
    ) -> tuple[list[tuple[str, tuple[int, ...], torch.dtype, int]], int]:
        """[(name, row shape, dtype, byte offset)] of a packed row in PACKED_ORDER, and its pitch (bytes)."""
        wdtype = fp8.FP8_DTYPE if is_fp8 else dtype
        shapes = {"gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}
        specs: list[tuple[str, tuple[int, ...], torch.dtype]] = []
        for name in PACKED_ORDER:
            if name in shapes:
                specs.append((name, shapes[name], wdtype))
            elif is_fp8:
                specs.append((name, fp8.scale_shape(*shapes[name.removesuffix("_scale")]), torch.float32))
        layout, offset = [], 0
        for name, shape, t in specs:
            layout.append((name, shape, t, offset))
            nbytes = math.prod(shape) * t.itemsize
            offset += -(-nbytes // ROW_ALIGN_BYTES) * ROW_ALIGN_BYTES
        return layout, offset

    @classmethod
    def over(cls, buffer: torch.Tensor, hidden: int, inter: int, dtype: torch.dtype, is_fp8: bool) -> ExpertTensors:
        """The packed layout's tensors as views of `buffer` [N, pitch] uint8 (`packed_layout`)."""
        layout, pitch = cls.packed_layout(hidden, inter, dtype, is_fp8)
        if buffer.dtype != torch.uint8 or buffer.dim() != 2 or buffer.shape[1] != pitch or not buffer.is_contiguous():
            raise ValueError(f"a packed expert buffer is contiguous uint8 [N, {pitch}], got {tuple(buffer.shape)}")
        n = buffer.shape[0]
        views = {
            name: buffer[:, off : off + math.prod(shape) * t.itemsize].view(t).view(n, *shape)
            for name, shape, t, off in layout
        }
        return cls(**views, packed=buffer)

    @classmethod
    def empty(
        cls,
        n: int,
        hidden: int,
        inter: int,
        dtype: torch.dtype,
        device: torch.device,
        pin: bool = False,
        is_fp8: bool = False,
        packed: bool = False,
    ) -> ExpertTensors:
        """`is_fp8`: float8_e4m3fn weights and float32 block scales (`dtype` is then ignored). `packed`: every
        tensor a view of one byte row per expert (the class's docstring)."""
        if packed:
            _, pitch = cls.packed_layout(hidden, inter, dtype, is_fp8)
            if pin and device.type == "cpu" and torch.cuda.is_available():
                buffer = pinned.empty_pinned([(n, pitch)], torch.uint8)[0]
            else:
                buffer = torch.empty((n, pitch), dtype=torch.uint8, device=device, pin_memory=pin)
            return cls.over(buffer, hidden, inter, dtype, is_fp8)
        shapes = [(n, inter, hidden), (n, inter, hidden), (n, hidden, inter)]  # gate, up, down
        groups = [(shapes, fp8.FP8_DTYPE if is_fp8 else dtype)]
        if is_fp8:
            groups.append(([(n, *fp8.scale_shape(*s[1:])) for s in shapes], torch.float32))
        tensors: list[torch.Tensor] = []
        for group_shapes, group_dtype in groups:
            if pin and device.type == "cpu" and torch.cuda.is_available():
                tensors += pinned.empty_pinned(group_shapes, group_dtype)  # exact size: torch would round up to 2^k
            else:
                tensors += [torch.empty(s, dtype=group_dtype, device=device, pin_memory=pin) for s in group_shapes]
        return cls(*tensors)

    @property
    def num_rows(self) -> int:
        return int(self.gate.shape[0])

    def dense(self, dtype: torch.dtype, rows: torch.Tensor | None = None) -> ExpertTensors:
        """The experts as plain weights in `dtype` (FP8 dequantized): all rows, or `rows` [n] in that
        order. Dense experts are returned as they are (indexed when `rows` is given)."""

        def pick(t: torch.Tensor) -> torch.Tensor:
            return t if rows is None else t[rows]

        if not self.is_fp8:
            return self if rows is None else ExpertTensors(pick(self.gate), pick(self.up), pick(self.down))
        dense = (fp8.dequantize(pick(self.get(w)), pick(self.get(f"{w}_scale")), dtype) for w in EXPERT_TENSORS)
        return ExpertTensors(*dense)

    def dense_row(self, name: str, row: int, dtype: torch.dtype) -> torch.Tensor:
        """One expert's `name` weight ([I, H] or [H, I]) in `dtype` (dequantized when FP8)."""
        w = self.get(name)[row]
        return fp8.dequantize(w, self.get(f"{name}_scale")[row], dtype) if self.is_fp8 else w


class RowKernel(Protocol):
    """Copies host rows `experts[i]` into device rows `slots[i]` of the tensors `names`, on the device
    (experts, slots: [m] int64 on it), stream-ordered like a DMA: `copy_kernel.copy_planned`."""

    def __call__(
        self, host: ExpertTensors, slots: ExpertTensors, experts: torch.Tensor, slot_ids: torch.Tensor,
        names: Sequence[str] | None = None,
    ) -> None: ...  # fmt: skip


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

    def __init__(
        self,
        device: torch.device,
        strategy: str,
        hidden: int,
        inter: int,
        dtype: torch.dtype,
        max_rows: int,
        is_fp8: bool = False,
        row_kernel: RowKernel | None = None,
        batch_copy: BatchCopy | None = None,
        packed: bool = False,
    ) -> None:
        """`packed`: the expert tables it copies between have packed rows (its `staged` buffers are laid out so).
        `row_kernel`: a device-side row copy (the weights loader passes `copy_kernel.copy_planned`
        on CUDA with Triton); the `direct` strategy sends an FP8 row's small scale rows by it, the `kernel`
        strategy every row. `batch_copy`: the `batch` strategy's one call a copy (the loader passes the
        driver's on CUDA: `batch_copy.driver_batch_copy`; on the CPU memmoves by default)."""
        if strategy == "auto":
            strategy = "direct" if device.type == "cuda" else "index"
        if strategy == "staged" and device.type != "cuda":
            raise ValueError("page_in='staged' needs a CUDA device (it overlaps pinned staging with the copy stream)")
        if strategy == "kernel" and row_kernel is None:
            raise ValueError("page_in='kernel' needs a device row kernel (CUDA with Triton)")
        if strategy == "batch" and batch_copy is None:
            if device.type == "cuda":
                raise ValueError("page_in='batch' on CUDA needs the driver's batch copy (batch_copy.driver_batch_copy)")
            batch_copy = memmove_batch
        if strategy not in PAGE_IN_STRATEGIES:
            raise ValueError(f"page_in must be one of {('auto', *PAGE_IN_STRATEGIES)}, got {strategy!r}")
        self.device = device
        self.strategy = strategy
        # `staged` waits on the host for its previous copy (one staging buffer): issued ahead of a wave's
        # launches it would hold them back, so HostWaves issues its copies just before their wave
        self.blocks_host = strategy == "staged"
        self.row_kernel = row_kernel
        self.batch_copy = batch_copy
        self.batch_calls = 0  # `batch`: calls the batch copy took
        self.batch_fallbacks = 0  # `batch`: calls copied as `direct` (the legacy default stream, graph capture)
        self._tables: dict[tuple[int, int, tuple[str, ...]], RowTables] = {}  # `batch`: (src, dst, names) -> tables
        self._staging_host: ExpertTensors | None = None
        self._staging_dev: ExpertTensors | None = None
        self._staging_free: torch.cuda.Event | None = None
        self._row_views: dict[int, tuple[torch.Tensor, tuple[torch.Tensor, ...]]] = {}  # `direct`: id -> rows
        if strategy == "staged":
            self._staging_host = ExpertTensors.empty(
                max_rows, hidden, inter, dtype, torch.device("cpu"), True, is_fp8, packed
            )
            self._staging_dev = ExpertTensors.empty(
                max_rows, hidden, inter, dtype, device, is_fp8=is_fp8, packed=packed
            )

    def copy_rows(
        self,
        src: ExpertTensors,
        dst: ExpertTensors,
        pairs: Sequence[tuple[int, int]],
        counters: PagingCounters | None = None,
        layer: int = 0,
        row_bytes: int = 0,
    ) -> None:
        """Copies src row `s` to dst row `d` for every (s, d) in `pairs`, for every expert tensor; with `counters`,
        counts and times them there (a caller that times its copies itself passes none: a paged prefill's waves
        mark theirs in `streaming.LayerCopies`, and two timing events a call are host time a layer-step pays once a
        wave or more on the H200, where the host bounds the prefill: docs/prefill.md)."""
        if not pairs:
            return
        timing_cuda = self.device.type == "cuda" and counters is not None
        if timing_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()  # the CPU's copy time (an index_copy_ runs inline)
        if self.strategy == "index":
            self._copy_index(src, dst, pairs)
        elif self.strategy == "direct":
            self._copy_direct(src, dst, pairs)
        elif self.strategy == "kernel":
            self._copy_kernel(src, dst, pairs, None)
        elif self.strategy == "batch":
            self._copy_batch(src, dst, pairs)
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
        if self.device.type == "cpu":
            # a copy_ a run of rows, in 8-byte words where the bytes allow, no temporary: index_select's output (37 MB
            # for 4 bf16 Qwen3-30B-A3B rows) is fresh memory on every call past glibc's 32 MB mmap threshold, and its
            # page faults cost more than the copy (4 such rows on a 2-core EPYC: 13.1 -> 2.8 ms split, 30.0 -> 2.8 ms
            # packed; benchmarks/results/cpu/README.md); a packed range's rows are strided: copy_ takes them as they are
            runs = contiguous_runs(pairs)
            for s_t, d_t in _paired_views(src, dst):
                s_w, d_w = as_words(s_t, d_t)
                for s, d, n in runs:
                    d_w[d : d + n].copy_(s_w[s : s + n])
            return
        src_idx = torch.tensor([p[0] for p in pairs], dtype=torch.long)  # [m]
        dst_idx = torch.tensor([p[1] for p in pairs], dtype=torch.long, device=self.device)  # [m]
        for s_t, d_t in _paired_views(src, dst):  # FP8 as bytes: float8 has no index_copy_
            d_t.index_copy_(0, dst_idx, s_t.index_select(0, src_idx).to(self.device))

    def _copy_direct(self, src: ExpertTensors, dst: ExpertTensors, pairs: Sequence[tuple[int, int]]) -> None:
        runs = contiguous_runs(pairs)
        names = src.names()
        # split rows: from 2 rows the kernel replaces at least 6 scale DMAs by one index upload and one launch
        # (packed rows carry their scales inside the one DMA a run)
        small: list[str] = []
        if self.row_kernel is not None and len(pairs) >= 2 and src.packed is None:
            small = [n for n in names if n in SCALE_TENSORS]
        dsts: list[torch.Tensor] = []
        srcs: list[torch.Tensor] = []
        for s_t, d_t in _paired_views(src, dst, [n for n in names if n not in small]):
            s_rows, d_rows = self._rows(s_t), self._rows(d_t)
            # a run is one block where rows are back to back on both sides (split tensors, whole packed rows)
            whole = _rows_adjacent(s_t) and _rows_adjacent(d_t)
            for s, d, n in runs:
                if n == 1:
                    srcs.append(s_rows[s])
                    dsts.append(d_rows[d])
                elif whole:
                    srcs.append(s_t[s : s + n])
                    dsts.append(d_t[d : d + n])
                else:
                    srcs.extend(s_rows[s : s + n])
                    dsts.extend(d_rows[d : d + n])
        torch._foreach_copy_(dsts, srcs, non_blocking=True)  # one call: a DMA per run, issued in C++
        if small:
            self._copy_kernel(src, dst, pairs, small)

    def _copy_batch(self, src: ExpertTensors, dst: ExpertTensors, pairs: Sequence[tuple[int, int]]) -> None:
        """Every tensor's runs of rows in one `batch_copy` call on the current stream (batch_copy.py). On the legacy
        default stream, which the driver refuses, or under graph capture, which a batch cannot join: as `direct`
        (counted in `batch_fallbacks`; logged once)."""
        if len({d for _, d in pairs}) != len(pairs):  # a batch's copies run in no set order: one writer a row
            raise ValueError(f"a batch copy names a destination row twice: {list(pairs)}")
        stream = 0
        if self.device.type == "cuda":
            stream = torch.cuda.current_stream(self.device).cuda_stream
            if stream in LEGACY_STREAMS or torch.cuda.is_current_stream_capturing():
                self.batch_fallbacks += 1
                if self.batch_fallbacks == 1:
                    log.info("page_in batch: a call on the legacy default stream or under capture went as direct")
                self._copy_direct(src, dst, pairs)
                return
        assert self.batch_copy is not None
        if not all(_rows_adjacent(s) and _rows_adjacent(d) for s, d in _paired_views(src, dst)):
            # a narrowed packed row (the fault-injection tests): ranges whose rows are not back to back, which the
            # batch's row tables cannot describe
            self._copy_direct(src, dst, pairs)
            return
        dsts, srcs, sizes = descriptors(self._row_tables(src, dst), contiguous_runs(pairs))
        self.batch_copy(dsts, srcs, sizes, stream)
        self.batch_calls += 1
        if self.batch_calls == 1:  # the server's log says the batch ran (a slot reload's copies go direct, above)
            log.info("page_in batch: the first call went by one batch copy (%d copies)", dsts.size)

    def _row_tables(self, src: ExpertTensors, dst: ExpertTensors) -> RowTables:
        """src and dst's tensors as base addresses, made once per pair of tables and kept while every tensor is
        the one they were made from, at the same address (a table freed and another made at its id, or a tensor
        whose storage moved, gets new ones: a stale base would be a wild pointer)."""
        names = src.names()
        key = (id(src), id(dst), names)
        views = _paired_views(src, dst)
        tensors = (*(s for s, _ in views), *(d for _, d in views))
        cached = self._tables.get(key)
        if cached is None or any(
            a is not b or a.data_ptr() != base
            for a, b, base in zip(
                cached.tensors, tensors, (*cached.src_base.tolist(), *cached.dst_base.tolist()), strict=True
            )
        ):
            cached = row_tables(tensors[: len(views)], tensors[len(views) :], keep=tensors)
            self._tables[key] = cached
        return cached

    def _copy_kernel(
        self, src: ExpertTensors, dst: ExpertTensors, pairs: Sequence[tuple[int, int]], names: Sequence[str] | None
    ) -> None:
        """The rows of `names` (None: every tensor) by the device row kernel, after one index upload."""
        assert self.row_kernel is not None
        index = torch.tensor(pairs, dtype=torch.long).t().contiguous()  # [2, m]: experts, slots
        experts, slots = to_device(index, self.device)  # each [m]; pinned: the upload does not block the host
        self.row_kernel(src, dst, experts, slots, names)

    def _rows(self, t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """t's row views, made once per tensor (slicing per copy cost the host ~2 us a row)."""
        cached = self._row_views.get(id(t))
        if cached is None or cached[0] is not t:
            cached = (t, t.unbind(0))  # holding t: its id is not reused while cached
            self._row_views[id(t)] = cached
        return cached[1]

    def _copy_staged(self, src: ExpertTensors, dst: ExpertTensors, pairs: Sequence[tuple[int, int]]) -> None:
        assert self._staging_host is not None and self._staging_dev is not None
        m = len(pairs)
        if m > self._staging_host.num_rows:
            raise ValueError(f"wave pages in {m} experts but staging holds {self._staging_host.num_rows}")
        if self._staging_free is not None:
            self._staging_free.synchronize()  # the previous staged copy may still read the buffer
        src_idx = torch.tensor([p[0] for p in pairs], dtype=torch.long)  # [m]
        dst_idx = torch.tensor([p[1] for p in pairs], dtype=torch.long).to(self.device, non_blocking=True)  # [m]
        for s_t, h_t, v_t, d_t in zip(
            src.copy_views(), self._staging_host.copy_views(), self._staging_dev.copy_views(), dst.copy_views(),
            strict=True,
        ):  # fmt: skip
            host_buf, dev_buf = h_t[:m], v_t[:m]  # contiguous: every tensor, or a whole packed row
            torch.index_select(s_t, 0, src_idx, out=host_buf)
            dev_buf.copy_(host_buf, non_blocking=True)
            d_t.index_copy_(0, dst_idx, dev_buf)
        self._staging_free = torch.cuda.Event()
        self._staging_free.record()


def _paired_views(
    src: ExpertTensors, dst: ExpertTensors, names: Sequence[str] | None = None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(source, destination) of each view a page-in of `names` copies (`copy_views`); both sides one layout."""
    if (src.packed is None) != (dst.packed is None) or src.row_pitch != dst.row_pitch:
        raise ValueError(
            f"a page-in copies between two expert tables of one layout, got row pitches {src.row_pitch} and "
            f"{dst.row_pitch} (0: split)"
        )
    return list(zip(src.copy_views(names), dst.copy_views(names), strict=True))


_WORDS = (torch.int64, torch.int32, torch.int16)


def as_words(src: torch.Tensor, dst: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Byte views (packed rows, FP8 as bytes) as the widest integer words both sides allow, the same bytes: the CPU's
    index_select / index_copy_ move uint8 elements 5-8x slower than 4- or 8-byte ones (2-core EPYC, rows of 12 KB and
    256 KB: ~1.1 against 4.8-8.9 GB/s; row copy_ ~11 against ~13 GB/s). Other dtypes pass through."""
    if src.dtype != torch.uint8 or dst.dtype != torch.uint8:
        return src, dst

    def fits(t: torch.Tensor, size: int) -> bool:
        inner = t.dim() == 0 or (t.stride(-1) == 1 and t.shape[-1] % size == 0)
        return inner and t.storage_offset() % size == 0 and all(st % size == 0 for st in t.stride()[:-1])

    for word in _WORDS:
        size = word.itemsize
        if fits(src, size) and fits(dst, size):
            return src.view(word), dst.view(word)
    return src, dst


def _rows_adjacent(t: torch.Tensor) -> bool:
    """True where row i + 1 starts where row i ends (a run of rows is one block)."""
    return t.shape[0] < 2 or t.stride(0) == t[0].numel()


class SlotArena:
    """Every paged layer's packed slot rows in ONE device allocation, `buffer` [layers, K, pitch] uint8, each layer
    taking its [K, pitch] part in turn (`take`). Why one: torch's caching allocator rounds each allocation up to 2 MiB,
    so 48 tables of K rows cost the device 20-92 MiB more than asked at K = 54..64 of the 48-layer FP8 shape, the same
    bytes as one buffer 0-2 MiB (default allocator; benchmarks/alloc_probe.py, one H100:
    benchmarks/results/h200/2026-12-06-h100-capcopy): memory a paged K budget can spend on slots."""

    def __init__(self, layers: int, rows: int, pitch: int, device: torch.device) -> None:
        self.buffer = torch.empty(layers, rows, pitch, dtype=torch.uint8, device=device)  # [layers, K, pitch]
        self._taken = 0

    def take(self, rows: int, pitch: int) -> torch.Tensor:
        """The next layer's [rows, pitch] part (contiguous); refuses a shape the arena was not made for."""
        layers, have_rows, have_pitch = self.buffer.shape
        if (rows, pitch) != (have_rows, have_pitch) or self._taken >= layers:
            raise ValueError(
                f"slot arena of {layers} x [{have_rows}, {have_pitch}] ({self._taken} taken): asked [{rows}, {pitch}]"
            )
        part = self.buffer[self._taken]
        self._taken += 1
        return part


def to_device_rows(
    src: ExpertTensors, rows: int, device: torch.device, split: bool = False, arena: SlotArena | None = None
) -> ExpertTensors:
    """A device copy of the first `rows` experts (the initial slots hold experts 0..K-1), scales included, in
    the source's layout, or split whatever the source's (`split`: a resident layer's rows). Packed rows go into
    the next part of `arena` when one is given (every paged layer's slots in one allocation), else their own."""
    if src.packed is not None and not split:
        if arena is None:
            buffer = src.packed[:rows].to(device, copy=True)  # [rows, pitch]
        else:
            buffer = arena.take(rows, src.row_pitch)  # [rows, pitch]
            buffer.copy_(src.packed[:rows])
        return ExpertTensors.over(buffer, src.gate.shape[2], src.gate.shape[1], src.gate.dtype, src.is_fp8)

    def copy(t: torch.Tensor) -> torch.Tensor:
        return t[:rows].to(device, copy=True)

    scales = (None if t is None else copy(t) for t in src.scales)
    return ExpertTensors(copy(src.gate), copy(src.up), copy(src.down), *scales)
