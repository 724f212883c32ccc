"""Host<->device link bandwidth probe: pinned and pageable copies, host-to-device and back, at
expert sizes and at 1 GiB, timed with CUDA events after warmup; and the built-in runtime's decode page-in
path, the copy kernel (SMs reading pinned host rows, `paged_experts.kernels.copy_kernel`), on FP8-expert rows.

Why the kernel beside the DMAs: a paged decode step pages in with the copy kernel inside its captured graph, not
with the copy engine, and its rate need not follow the DMA's from machine to machine (2026-12-07: two H100 boxes
with the same DMA figure, 51.6 and 52.0 GB/s, decoded the same code ~9 us a paged MB apart;
benchmarks/results/h200/2026-12-07-h100-duelconfirm). The paging figure stays the DMA's; the kernel's is beside it
(`kernel_gb_per_s`), checked for the bytes it moved, and its failure is recorded (`kernel_error`) without
failing the probe.

Owns the measurement plan (`LinkPlan`), the timing loop, the result record (`LinkBwReport`, JSON
with a schema version) and `paging_b_per_s_from_json`, the single figure preflight and simulate
take from a report: pinned host->device bandwidth of back-to-back expert-sized copies (what
paging does; DESIGN.md section 5 measured 50 GB/s for 384 x 2.4 MB on PCIe 5.0 x16).
`probe_in_subprocess` is the run's measurement (matrix `linkbw: true`): the same probe in a child
process, stored in the run's manifest (`link_bandwidth`) for the report's link bounds.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pydantic import Field

from benchsuite.errors import RunError, UserError
from benchsuite.records import StoredFacts

SCHEMA_VERSION = 1
GB_BYTES = 10**9
GIB_BYTES = 2**30
# Qwen3-30B-A3B experts (DESIGN.md section 3): int4 GPTQ, fp8 block, bf16.
EXPERT_SIZES_BYTES = (2_433_024, 4_719_744, 9_437_184)
LARGE_BYTES = GIB_BYTES
BURST_COPIES = 384  # one int4 token whose 48 x 8 expert activations all miss


@dataclass(frozen=True)
class LinkPlan:
    expert_sizes_bytes: tuple[int, ...] = EXPERT_SIZES_BYTES
    large_bytes: int = LARGE_BYTES
    burst_copies: int = BURST_COPIES
    warmup: int = 2
    samples: int = 5
    large_samples: int = 3
    pageable: bool = True
    d2h: bool = True
    kernel_rows: int = 16  # the copy kernel's rows a launch (0: not measured); 16 misses, a calibrated c=4 decode step
    kernel_row_bytes: int = EXPERT_SIZES_BYTES[1]  # one FP8 expert (a packed row's bytes, less its padding)


@dataclass(frozen=True)
class LinkMeasurement:
    direction: str  # "h2d" | "d2h"
    memory: str  # "pinned" | "pageable"
    size_bytes: int  # one copy
    copies: int  # copies per sample (back-to-back when > 1; the kernel: rows in its one launch)
    sample_s: tuple[float, ...]  # seconds per sample (all copies)
    method: str = "dma"  # "dma" (tensor copy_, the copy engine) | "kernel" (the runtime's copy kernel, one launch)

    @property
    def median_gb_per_s(self) -> float:
        return self.size_bytes * self.copies / statistics.median(self.sample_s) / GB_BYTES

    @property
    def best_gb_per_s(self) -> float:
        return self.size_bytes * self.copies / min(self.sample_s) / GB_BYTES

    def to_dict(self) -> dict:
        return {**asdict(self), "median_gb_per_s": self.median_gb_per_s, "best_gb_per_s": self.best_gb_per_s}


@dataclass(frozen=True)
class LinkBwReport:
    device: str
    torch_version: str
    cuda_version: str
    measurements: tuple[LinkMeasurement, ...]
    created_unix_s: float = field(default_factory=time.time)
    kernel_error: str | None = None  # why the copy kernel was not measured (no Triton, a launch failed, wrong bytes)

    @property
    def paging_gb_per_s(self) -> float:
        """Pinned H2D, back-to-back DMA copies of the smallest expert size (median)."""
        bursts = [m for m in self.measurements
                  if m.method == "dma" and m.direction == "h2d" and m.memory == "pinned" and m.copies > 1]  # fmt: skip
        if not bursts:
            raise ValueError("report has no pinned back-to-back host-to-device measurement")
        return min(bursts, key=lambda m: m.size_bytes).median_gb_per_s

    @property
    def kernel_gb_per_s(self) -> float | None:
        """The copy kernel's median over its rows (pinned host rows -> device slots), None where not measured."""
        kernel = [m for m in self.measurements if m.method == "kernel"]
        return kernel[0].median_gb_per_s if kernel else None

    def to_dict(self) -> dict:
        return {
            "schema_version": SCHEMA_VERSION,
            "device": self.device,
            "torch_version": self.torch_version,
            "cuda_version": self.cuda_version,
            "created_unix_s": self.created_unix_s,
            "paging_gb_per_s": self.paging_gb_per_s,
            "kernel_gb_per_s": self.kernel_gb_per_s,
            "kernel_error": self.kernel_error,
            "measurements": [m.to_dict() for m in self.measurements],
        }


def paging_b_per_s_from_json(path: str | Path) -> float:
    """Bytes per second preflight/simulate use from a `benchsuite linkbw --json-out` file."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"cannot read linkbw JSON {path}: {exc}") from None
    if data.get("schema_version") != SCHEMA_VERSION:
        raise UserError(f"{path}: linkbw schema {data.get('schema_version')}, expected {SCHEMA_VERSION}; re-run linkbw")
    value = data.get("paging_gb_per_s")
    if not isinstance(value, (int, float)) or value <= 0:
        raise UserError(f"{path}: no positive paging_gb_per_s")
    return float(value) * GB_BYTES


def _time_copies(torch, dst, src, size: int, copies: int, warmup: int, samples: int) -> tuple[float, ...]:
    """Seconds per sample of `copies` back-to-back copies of `size` bytes, CUDA-event timed."""

    def run() -> None:
        for i in range(copies):
            dst[i * size : (i + 1) * size].copy_(src[i * size : (i + 1) * size], non_blocking=True)

    return _time_runs(torch, run, warmup, samples)


def _time_runs(torch, run: Callable[[], None], warmup: int, samples: int) -> tuple[float, ...]:
    """Seconds per sample of `run`, CUDA-event timed after `warmup` untimed runs."""
    for _ in range(warmup):
        run()
    torch.cuda.synchronize()
    out = []
    for _ in range(samples):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) / 1e3)
    return tuple(out)


def _cases(plan: LinkPlan) -> list[tuple[str, str, int, int, int]]:
    """(direction, memory, size_bytes, copies, samples) in the order measured."""
    cases = []
    directions = ("h2d", "d2h") if plan.d2h else ("h2d",)
    memories = ("pinned", "pageable") if plan.pageable else ("pinned",)
    for direction in directions:
        for memory in memories:
            for size in plan.expert_sizes_bytes:
                cases.append((direction, memory, size, 1, plan.samples))
                if memory == "pinned" and plan.burst_copies > 1:
                    cases.append((direction, memory, size, plan.burst_copies, plan.samples))
            cases.append((direction, memory, plan.large_bytes, 1, plan.large_samples))
    return cases


def measure(plan: LinkPlan, device_index: int = 0) -> LinkBwReport:
    try:
        import torch
    except ImportError:
        raise RunError("linkbw needs torch") from None
    if not torch.cuda.is_available():
        raise RunError("linkbw needs a CUDA GPU: torch.cuda.is_available() is False on this machine")
    device = torch.device("cuda", device_index)
    torch.cuda.set_device(device)
    biggest = max(
        max(s * (plan.burst_copies if plan.burst_copies > 1 else 1) for s in plan.expert_sizes_bytes),
        plan.large_bytes,
        2 * plan.kernel_rows * plan.kernel_row_bytes,  # the kernel's scattered rows: every other host row is read
    )
    dev_buf = torch.empty(biggest, dtype=torch.uint8, device=device)
    host = {"pinned": torch.empty(biggest, dtype=torch.uint8, pin_memory=True)}
    if plan.pageable:
        host["pageable"] = torch.empty(biggest, dtype=torch.uint8)
    for buf in host.values():
        buf.fill_(1)  # touch every page so pageable timing excludes first-touch faults
    results = []
    for direction, memory, size, copies, samples in _cases(plan):
        src, dst = (host[memory], dev_buf) if direction == "h2d" else (dev_buf, host[memory])
        sample_s = _time_copies(torch, dst, src, size, copies, plan.warmup, samples)
        results.append(LinkMeasurement(direction, memory, size, copies, sample_s))
    kernel_error = None
    if plan.kernel_rows:
        try:
            results.append(_measure_kernel(torch, plan, host["pinned"], dev_buf))
        except Exception as exc:  # noqa: BLE001 - the DMA figures stand without it; why is recorded
            kernel_error = f"{type(exc).__name__}: {exc}"
    return LinkBwReport(
        device=torch.cuda.get_device_name(device),
        torch_version=torch.__version__,
        cuda_version=str(torch.version.cuda),
        measurements=tuple(results),
        kernel_error=kernel_error,
    )


def _measure_kernel(torch, plan: LinkPlan, host, dev_buf) -> LinkMeasurement:
    """The runtime's decode page-in: `plan.kernel_rows` FP8-expert rows of the pinned host buffer, scattered (every
    other row), into as many device slots by the copy kernel's one full-grid launch (`launch_copy_rows`, as a
    captured decode step copies packed rows); the slots are then checked against their rows (a wrong copy is an
    error, not a figure)."""
    from paged_experts.kernels import copy_kernel  # the runtime's kernel itself: what the engine's decode runs

    if not copy_kernel.graph_safe(dev_buf.device):
        raise RuntimeError("no Triton in this torch build: the copy kernel cannot run")
    row_bytes, rows = plan.kernel_row_bytes, plan.kernel_rows
    host_rows = host[: (host.numel() // row_bytes) * row_bytes].view(-1, row_bytes)  # [N, row] uint8, pinned
    if host_rows.shape[0] < 2 * rows or dev_buf.numel() < rows * row_bytes:
        raise RuntimeError(f"the buffers hold too few {row_bytes}-byte rows for {rows} scattered copies")
    slots = dev_buf[: rows * row_bytes].view(rows, row_bytes)  # [rows, row] uint8
    experts = torch.arange(0, 2 * rows, 2, dtype=torch.long, device=dev_buf.device)  # [rows]: no two adjacent
    slot_ids = torch.arange(rows, dtype=torch.long, device=dev_buf.device)  # [rows]
    host_rows[: 2 * rows].copy_(torch.randint(0, 256, (2 * rows, row_bytes), dtype=torch.uint8))

    def run() -> None:  # a packed-row decode step's copy: every tensor of a row in one full-grid launch
        copy_kernel.launch_copy_rows([host_rows], [slots], experts, slot_ids, host_rows.shape[0])

    sample_s = _time_runs(torch, run, plan.warmup, plan.samples)
    if not torch.equal(slots.cpu(), host_rows[0 : 2 * rows : 2]):
        raise RuntimeError("the copy kernel's slots differ from the host rows they were copied from")
    return LinkMeasurement("h2d", "pinned", row_bytes, rows, sample_s, method="kernel")


def render(report: LinkBwReport) -> str:
    lines = [f"{report.device} (torch {report.torch_version}, CUDA {report.cuda_version})",
             f"{'dir':<4} {'memory':<9} {'method':<6} {'size':>10} {'copies':>6} {'median GB/s':>12} "
             f"{'best GB/s':>10}"]  # fmt: skip
    for m in report.measurements:
        size = f"{m.size_bytes / 1e6:.2f} MB" if m.size_bytes < GIB_BYTES else f"{m.size_bytes / GIB_BYTES:.0f} GiB"
        lines.append(
            f"{m.direction:<4} {m.memory:<9} {m.method:<6} {size:>10} {m.copies:>6} "
            f"{m.median_gb_per_s:>12.1f} {m.best_gb_per_s:>10.1f}"
        )
    lines.append(f"paging figure (pinned H2D, back-to-back expert copies): {report.paging_gb_per_s:.1f} GB/s")
    kernel = report.kernel_gb_per_s
    lines.append(
        f"decode page-in (the runtime's copy kernel, pinned rows -> slots): {kernel:.1f} GB/s"
        if kernel is not None
        else f"decode page-in (the runtime's copy kernel): not measured ({report.kernel_error or 'not asked'})"
    )
    return "\n".join(lines)


PROBE_ARGV: tuple[str, ...] = (sys.executable, "-m", "benchsuite", "linkbw", "--json")
PROBE_TIMEOUT_S = 600.0


class LinkBandwidth(StoredFacts):
    """The run's probe as the manifest keeps it (`link_bandwidth`): the figure, its device and the
    probe's whole report; or, when the probe could not run, `error` and no figure."""

    command: list[str] = Field(default_factory=list)
    measured_unix_s: float | None = None
    paging_gb_per_s: float | None = None
    device: str | None = None
    report: dict[str, Any] | None = None  # the probe's own JSON (LinkBwReport, versioned by its schema_version)
    error: str | None = None


def probe_in_subprocess(argv: tuple[str, ...] | None = None, timeout_s: float = PROBE_TIMEOUT_S) -> LinkBandwidth:
    """`benchsuite linkbw --json` in a child process, so its CUDA context and pinned buffers are gone
    before any engine of the run starts: the run's `link_bandwidth` record, with `error` (and no
    figure) when the probe could not run, e.g. on a machine without CUDA."""
    argv = argv or PROBE_ARGV
    command, measured_unix_s = list(argv), time.time()
    try:
        proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        error = f"the probe did not finish within {timeout_s:g} s"
        return LinkBandwidth(command=command, measured_unix_s=measured_unix_s, error=error)
    except OSError as exc:
        return LinkBandwidth(command=command, measured_unix_s=measured_unix_s, error=f"the probe did not start: {exc}")
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
        error = last.removeprefix("benchsuite: error: ")
        return LinkBandwidth(command=command, measured_unix_s=measured_unix_s, error=error)
    try:
        data = json.loads(proc.stdout)
        figure = float(data["paging_gb_per_s"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        error = f"unreadable probe output ({type(exc).__name__}: {exc})"
        return LinkBandwidth(command=command, measured_unix_s=measured_unix_s, error=error)
    return LinkBandwidth(command=command, measured_unix_s=measured_unix_s, paging_gb_per_s=figure,
                         device=data.get("device"), report=data)  # fmt: skip
