"""Can a page-in hide behind the experts' compute? Each copy's rate, alone and beside a decode expert pass.

Issue 29's first item: a paged decode step's misses copy while its hits compute. Inside the captured decode
graph the page-in is a Triton kernel reading the pinned host store (`copy_kernel.copy_planned`); a DMA cannot
join a graph whose addresses the device chose. On the H200 every paged cell's decode is serial: link time plus
compute time, nothing hidden (h200-headline-c, the report's `of_serial` 0.97-1.05), and `overlap_page_in` and
`copy_programs` (the copy kernel's grid capped so that compute can run beside it) measured slower
(configs/h200/overlap.yaml, copy.yaml). Those were whole servers. This measures the two questions under them, on one
process and two streams: does the copy kernel reach the link's rate on few SMs, and how much of it hides behind
(and slows) the expert kernels running beside it, against the copy engine (DMAs), which holds no SM.

Copies (each moves m FP8 experts, the six tensors of a row, into slots the compute does not read):
- `dma`: the runtime's `direct` page-in, as the weights loader builds it: the weights as DMAs (one `_foreach_copy_`),
  the FP8 scale rows by one copy-kernel launch, issued by the host (its issue time is `issue_ms`);
- `kernel`: `copy_planned` with the full grid, one launch (the decode graph's copy today);
- `kernel:P`: `copy_planned` with P programs (`copy_programs` P), a launch per tensor;
- `wide:P`: P programs of a 64 KiB block and 8 warps each, 4x the bytes in flight per program (a candidate, not
  in the runtime);
- `proxy`: the DMA proxy (`overlap_copies: dma`, residency/dma_proxy.py): the graph rings a host thread, which
  issues the rows as DMAs on the copy engine, and waits on the device for their landing; its copy_ms is the whole
  round trip (the ring's record over PCIe, the thread's poll and issue, the DMAs, the done word back);
- `switch` / `switch:L` (`--switch`, off unless asked): SWITCH conditional nodes with memcpy bodies
  (residency/switch_lanes.py), L lanes (`switch`: L = m), lane j copying into slot j; a one-thread kernel in the
  graph sets each lane's condition on the device to its expert, lanes past m to none. Its copy_ms is the setter and
  every lane; `switch:L` beside `switch` is what an empty lane costs. The row adds the graph's memcpy nodes and
  the host's time adding them and instantiating the graph, for the 48-layer node count's estimate.
Compute: `moe_triton.moe_pairs`, the decode expert pass (gate/up, then down and combine) of B tokens x top_k pairs
over resident slots, R times back to back (R set so that the compute alone lasts about as long as the DMA
copy alone). The compute and the kernel copies are captured in CUDA graphs and replayed, as the decode step runs
them (one by one, a small pass's launches take the host longer than the GPU); the DMAs are issued by the host.
Each copy then runs alone, and beside the compute issued first and issued second. Per row: copy_ms and its GB/s
alone; compute_ms alone; in both runs the span (start to the later end) and each side's time inside it;
`hidden` = (copy alone + compute alone - span) / min(copy alone, compute alone): 1 when the shorter one
hid entirely, 0 when they ran one after the other (below 0: slower than serial).
Every copy is checked twice, after its warm-up and after its last timed run (the rows cleared before it): the slots'
bytes equal the host rows they came from and no other slot changed. On a GPU the device waits (a sleep kernel)
while the host issues each timed piece of work, so the events time the device, and the second of two streams
starts ~2 us after the first. A failing arm gets a row with its `error` and the run goes on (exit status 1); the
JSON is rewritten after every row.

    python benchmarks/copy_overlap.py --out copy_overlap.json [--m 4,16] [--tokens 4] [--programs 8,16,32,64]
    python benchmarks/copy_overlap.py --out switch.json --rows packed --m 1,2,4,8 --programs '' --wide '' \
        --no-proxy --switch m,16                   # the SWITCH lanes against the DMA and the copy kernel
    python benchmarks/copy_overlap.py --show copy_overlap.json      # a stored record's table

On the CPU (`--device cpu`, the tests' tiny shapes) the copies run as the runtime's CPU fallbacks and the compute as
dequantized matmuls, one after the other: the script's plumbing and the copies' check, no overlap figure.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from paged_experts import fp8
from paged_experts.kernels import copy_kernel, moe_triton
from paged_experts.residency import dma_proxy, switch_lanes
from paged_experts.residency.store import ExpertTensors, PageInEngine

WIDE_BLOCK_BYTES = 65536  # `wide:P`: 4x copy_kernel.BLOCK_BYTES a program iteration
WIDE_WARPS = 8


@dataclass(frozen=True)
class Setup:
    host: ExpertTensors  # [E] rows in pinned host memory (CUDA) or plain memory (CPU)
    slots: ExpertTensors  # [K] rows on the device
    device: torch.device
    top_k: int
    tokens: int


def make_setup(args: argparse.Namespace, device: torch.device) -> Setup:
    cpu = torch.device("cpu")
    packed = args.rows == "packed"
    host = ExpertTensors.empty(args.experts, args.hidden, args.inter, torch.bfloat16, cpu, pin=device.type == "cuda",
                               is_fp8=True, packed=packed)  # fmt: skip
    gen = torch.Generator().manual_seed(args.seed)
    for name in host.names():  # random bytes: a copy that lands in the wrong row or not at all shows
        t = fp8.raw(host.get(name))
        if t.dtype == torch.uint8:
            t.copy_(torch.randint(0, 120, t.shape, dtype=torch.uint8, generator=gen))  # finite e4m3 values
        else:
            t.copy_(torch.rand(t.shape, generator=gen) * 1e-3 + 1e-4)  # block scales
    slots = ExpertTensors.empty(args.slots, args.hidden, args.inter, torch.bfloat16, device, is_fp8=True, packed=packed)
    for name in slots.names():
        fp8.raw(slots.get(name)).copy_(fp8.raw(host.get(name))[: args.slots].to(device))
    return Setup(host, slots, device, args.top_k, args.tokens)


def copy_fn(mech: str, setup: Setup, pairs: list[tuple[int, int]]) -> Callable[[], None]:
    """The copy `mech` of host rows to slots (pairs: (expert, slot)), as a closure issuing it on the current stream."""
    device = setup.device
    if mech == "dma":
        strategy = "direct" if device.type == "cuda" else "index"
        hidden, inter = setup.host.gate.shape[2], setup.host.gate.shape[1]
        row_kernel = copy_kernel.copy_planned if copy_kernel.graph_safe(device) else None  # as the loader passes it
        engine = PageInEngine(
            device, strategy, hidden, inter, torch.bfloat16, setup.slots.num_rows, is_fp8=True, row_kernel=row_kernel
        )
        return lambda: engine.copy_rows(setup.host, setup.slots, pairs)
    experts = torch.tensor([e for e, _ in pairs], dtype=torch.long, device=device)  # [m]
    slot_ids = torch.tensor([s for _, s in pairs], dtype=torch.long, device=device)  # [m]
    if mech == "kernel":
        return lambda: copy_kernel.copy_planned(setup.host, setup.slots, experts, slot_ids)
    if mech == "proxy":
        if device.type != "cuda":  # no copy engine: the CPU fallback, as `wide` has
            return lambda: copy_kernel.copy_planned(setup.host, setup.slots, experts, slot_ids)
        proxy = dma_proxy.for_device(device, dma_proxy.MAX_PAIRS)
        table, mask = proxy.table(setup.host, setup.slots), dma_proxy.DmaProxy.mask(setup.host, None)
        return lambda: proxy.wait(proxy.ring(table, experts, slot_ids, mask))
    kind, programs = mech.split(":")
    if kind == "kernel":
        return lambda: copy_kernel.copy_planned(setup.host, setup.slots, experts, slot_ids, programs=int(programs))
    if kind == "wide":
        if not copy_kernel.graph_safe(device):
            return lambda: copy_kernel.copy_planned(setup.host, setup.slots, experts, slot_ids)  # the CPU fallback
        return lambda: _wide_copy(setup, experts, slot_ids, int(programs))
    raise ValueError(f"unknown copy {mech!r}: dma, kernel, kernel:P, wide:P, proxy, switch or switch:L")


def _wide_copy(setup: Setup, experts: torch.Tensor, slot_ids: torch.Tensor, programs: int) -> None:
    """`copy_kernel`'s capped loop with a 64 KiB block and 8 warps a program: a launch per tensor."""
    num_experts = setup.host.num_rows
    for src, dst in zip(setup.host.copy_views(), setup.slots.copy_views()):
        row = src[0].numel()
        block = WIDE_BLOCK_BYTES // src.element_size()
        chunks = -(-row // block)
        work = experts.shape[0] * chunks
        copy_kernel._copy_planned_rows_capped[(max(1, min(programs, work)),)](
            src, dst, experts, slot_ids, row, src.stride(0), dst.stride(0), num_experts, chunks, work,
            BLOCK=block, num_warps=WIDE_WARPS,
        )  # fmt: skip


def switch_lanes_of(mech: str, m: int) -> int:
    """`switch` -> m lanes, `switch:L` -> L."""
    return m if mech == "switch" else int(mech.split(":")[1])


def switch_copy(setup: Setup, pairs: list[tuple[int, int]], lanes: int) -> tuple[Callable[[], None], dict[str, Any]]:
    """The `switch` arm: `lanes` SWITCH lanes captured in a graph (lane j into slot j; the first len(pairs) carry the
    pairs' experts, the rest none) -> (its replay, what building it took). Needs pairs' slots to be 0..m-1, as
    `measure` makes them. On the CPU: the copy kernel's CPU fallback (the plumbing; no graph)."""
    m = len(pairs)
    if lanes < m or lanes > setup.slots.num_rows:
        raise ValueError(f"{lanes} lanes for {m} copies into {setup.slots.num_rows} slots")
    if [s for _, s in pairs] != list(range(m)):
        raise ValueError("switch lanes copy into slots 0..m-1, lane j into slot j")
    ids = [e for e, _ in pairs] + [-1] * (lanes - m)  # [lanes]; -1: the lane selects nothing
    experts = torch.tensor(ids, dtype=torch.long, device=setup.device)
    if setup.device.type != "cuda":
        return copy_fn("kernel", setup, pairs), {}
    built = switch_lanes.SwitchLanes(setup.host, setup.slots, list(range(lanes)))
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize(setup.device)
    with torch.cuda.graph(graph):
        t0 = time.perf_counter()  # inside: not the context's own synchronize and cache emptying
        built.capture(experts)
    capture_s = time.perf_counter() - t0  # the nodes added, the capture ended and the graph instantiated
    held = (graph, experts, built)  # the graph reads `experts` at every replay, and copies between the tables
    info = {"lanes": lanes, "switch_nodes": built.nodes_added, "switch_build_ms": built.build_s * 1e3,
            "switch_capture_ms": capture_s * 1e3}  # fmt: skip
    return (lambda: held[0].replay()), info


def compute_fn(setup: Setup, compute_slots: list[int], repeats: int, seed: int) -> Callable[[], None]:
    """`repeats` decode expert passes of setup.tokens tokens over the slots `compute_slots` (none of them a copy's
    destination), as a closure issuing them on the current stream."""
    gen = torch.Generator().manual_seed(seed)
    t, k, hidden = setup.tokens, setup.top_k, setup.slots.gate.shape[2]
    x = (torch.randn(t, hidden, generator=gen) * 0.1).to(setup.device, torch.bfloat16)  # [T, H]
    picks = [random.Random(seed + i).sample(compute_slots, k) for i in range(t)]  # distinct experts a token
    pair_rows = torch.tensor(picks, dtype=torch.long).reshape(-1).to(setup.device)  # [T*k]
    weights = torch.full((t, k), 1.0 / k, dtype=torch.float32, device=setup.device)  # [T, k]
    s = setup.slots
    if setup.device.type == "cuda" and moe_triton.available():

        def run() -> None:
            for _ in range(repeats):
                moe_triton.moe_pairs(x, pair_rows, weights, s.gate, s.up, s.down, k, *s.scales)

        return run
    rows = sorted(set(pair_rows.tolist()))
    dense = s.dense(torch.float32, torch.tensor(rows))  # the CPU's stand-in: dequantized rows, plain matmuls
    where = {r: i for i, r in enumerate(rows)}

    def run_cpu() -> None:
        for _ in range(repeats):
            for pair, row in enumerate(pair_rows.tolist()):
                i, xi = where[row], x[pair // k].float()
                h = F.silu(dense.gate[i] @ xi) * (dense.up[i] @ xi)  # [I]
                _ = dense.down[i] @ h  # [H]

    return run_cpu


def graphed(work: Callable[[], None], device: torch.device) -> Callable[[], None]:
    """`work` captured in a CUDA graph and replayed on the current stream, as the decode step runs its kernels (issued
    one by one, a small pass's launches take longer on the host than on the GPU, and the gaps would count as
    compute); on the CPU `work` itself. The replay holds `work`, and with it the tensors the graph reads: a graph
    keeps no reference to them, and memory freed under it would be handed out again while it still reads there."""
    if device.type != "cuda":
        return work
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        work()  # warm-up outside the capture: Triton compiles, the allocator settles
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    before = dma_proxy.captured_rings()
    with torch.cuda.graph(graph):
        work()
    torch.cuda.synchronize(device)
    # the proxy arm's rings: counted on each replay, not drained (the device sleeps while the timed work is
    # issued, and a drain would wait for the device)
    rings = dma_proxy.rings_since(before)
    held = (graph, work)

    def replay() -> None:
        held[0].replay()
        if rings:
            dma_proxy.replayed(rings, drain=False)

    return replay


def check_copied(setup: Setup, pairs: list[tuple[int, int]]) -> None:
    """Every tensor of every copied row equals its host row, byte for byte, and every other slot still holds the host
    row it was filled with (`make_setup`: slot s = expert s), so no copy wrote outside its rows (raises otherwise)."""
    copied = dict((slot, expert) for expert, slot in pairs)
    for name in setup.host.names():
        src, dst = fp8.raw(setup.host.get(name)), fp8.raw(setup.slots.get(name)).cpu()
        for slot in range(setup.slots.num_rows):
            expert = copied.get(slot, slot)
            if not torch.equal(dst[slot], src[expert]):
                raise AssertionError(f"{name}: slot {slot} does not hold expert {expert} after the copies")


def clear_rows(setup: Setup, slots: list[int]) -> None:
    for name in setup.slots.names():
        fp8.raw(setup.slots.get(name))[slots] = 0


HOLD_CYCLES = 40_000_000  # ~20 ms of GPU clock: the device waits while the host issues every timed piece of work
ORDER_CYCLES = 4_000  # ~2 us: how much later the second of two streams starts, so the first one issued starts first


class Clock:
    """Times work on streams: CUDA events on a GPU, perf_counter (work run inline, one after the other) on the CPU.
    On a GPU the device first waits (a sleep kernel) while the host issues the work, so the events time the device
    alone, not the host's issue (the DMA arm's copies are the host's calls); `issue_s` is the host's time apart."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.streams = (torch.cuda.Stream(device), torch.cuda.Stream(device)) if self.cuda else None

    def alone(self, work: Callable[[], None]) -> tuple[float, float]:
        """-> (the work's time, the host's time issuing it)."""
        if not self.cuda:
            t0 = time.perf_counter()
            work()
            elapsed = time.perf_counter() - t0
            return elapsed, elapsed
        assert self.streams is not None
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.streams[0]):
            torch.cuda._sleep(HOLD_CYCLES)
            start.record()
            t0 = time.perf_counter()
            work()
            issue_s = time.perf_counter() - t0
            end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3, issue_s

    def both(self, first: Callable[[], None], second: Callable[[], None]) -> tuple[float, float, float]:
        """`first` then `second` on two streams from one start (the second ~2 us later) -> (span, first's time,
        second's time)."""
        if not self.cuda:
            t0 = time.perf_counter()
            first()
            t1 = time.perf_counter()
            second()
            t2 = time.perf_counter()
            return t2 - t0, t1 - t0, t2 - t0
        assert self.streams is not None
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        torch.cuda._sleep(HOLD_CYCLES)
        start.record()
        for i, (stream, work, end) in enumerate(zip(self.streams, (first, second), ends, strict=True)):
            stream.wait_event(start)
            with torch.cuda.stream(stream):
                if i:
                    torch.cuda._sleep(ORDER_CYCLES)
                work()
                end.record()
        for end in ends:
            end.synchronize()
        times = [start.elapsed_time(end) / 1e3 for end in ends]
        return max(times), times[0], times[1]


def median_of(samples: list[float]) -> float:
    return statistics.median(samples)


def measure(args: argparse.Namespace, device: torch.device, write: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """Every arm at every m; `write(result)` after each row, so a failure or a timeout keeps the rows before it. An
    arm that fails (a copy that does not check, a compile error) gets a row with its `error` and the next one runs."""
    setup = make_setup(args, device)
    clock = Clock(device)
    ms = [int(v) for v in args.m.split(",")]
    if max(ms) * 2 > args.slots:
        raise SystemExit(f"--m {max(ms)} needs at least {2 * max(ms)} --slots (copies and compute use separate slots)")
    mechs = ["dma", "kernel", *(f"kernel:{p}" for p in args.programs.split(",") if p)]
    mechs += [f"wide:{p}" for p in args.wide.split(",") if p]
    mechs += ["proxy"] if args.proxy else []
    mechs += [("switch" if v == "m" else f"switch:{int(v)}") for v in args.switch.split(",") if v]
    rng = random.Random(args.seed)
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "concurrent": device.type == "cuda",
        "expert_shape": {
            "hidden": args.hidden,
            "inter": args.inter,
            "dtype": "float8_e4m3fn",
            "row_bytes": setup.host.row_bytes,
        },  # fmt: skip
        "args": vars(args) | {"out": str(args.out)},
        "rows": [],
    }
    for m in ms:
        copy_slots = list(range(m))  # copies land in slots 0..m-1; the compute reads the others
        compute_slots = list(range(m, args.slots))
        pairs = list(zip(rng.sample(range(args.slots, args.experts), m), copy_slots, strict=True))
        nbytes = m * setup.host.row_bytes
        one = graphed(compute_fn(setup, compute_slots, 1, args.seed), device)
        for _ in range(args.warmup):
            one()
        pass_s = median_of([clock.alone(one)[0] for _ in range(args.repeats)])
        dma = copy_fn("dma", setup, pairs)
        for _ in range(args.warmup):
            dma()
        dma_s = median_of([clock.alone(dma)[0] for _ in range(args.repeats)])
        passes = args.passes or max(1, min(4000, round(dma_s / max(pass_s, 1e-9))))
        compute = graphed(compute_fn(setup, compute_slots, passes, args.seed), device)
        compute()
        compute_s = median_of([clock.alone(compute)[0] for _ in range(args.repeats)])
        for mech in mechs:
            row: dict[str, Any] = {"copy": mech, "m": m, "bytes": nbytes, "compute_passes": passes,
                                   "pass_ms": pass_s * 1e3, "compute_ms": compute_s * 1e3}  # fmt: skip
            try:
                row.update(measure_arm(args, setup, clock, mech, pairs, compute, compute_s))
            except Exception as exc:  # noqa: BLE001 - one arm's failure is its row's finding, not the run's end
                row["error"] = f"{type(exc).__name__}: {exc}"[:500]
                if device.type == "cuda":
                    torch.cuda.synchronize()  # an asynchronous CUDA error surfaces here, and ends the run
            result["rows"].append(row)
            write(result)
    return result


def measure_arm(
    args: argparse.Namespace, setup: Setup, clock: Clock, mech: str, pairs: list[tuple[int, int]],
    compute: Callable[[], None], compute_s: float,
) -> dict[str, Any]:  # fmt: skip
    """One copy arm: checked once warm, timed alone and beside the compute in both issue orders, then cleared and
    checked again after its last timed run (a replay that stopped copying would fail there)."""
    copy_slots = [slot for _, slot in pairs]
    built: dict[str, Any] = {}
    if mech.startswith("switch"):  # captured by its own graph: its nodes are added under capture, no eager form
        copy, built = switch_copy(setup, pairs, switch_lanes_of(mech, len(pairs)))
    else:
        copy = copy_fn(mech, setup, pairs)
        if mech != "dma":  # the kernels run inside the decode graph; DMAs are the host's
            copy = graphed(copy, setup.device)
    clear_rows(setup, copy_slots)
    copy()  # warm-up (Triton compiles here), then checked
    if setup.device.type == "cuda":
        torch.cuda.synchronize()
    check_copied(setup, pairs)
    alone = [clock.alone(copy) for _ in range(args.repeats)]
    copy_s = median_of([a[0] for a in alone])
    nbytes = len(pairs) * setup.host.row_bytes
    out: dict[str, Any] = {"copy_ms": copy_s * 1e3, "copy_gbps": nbytes / copy_s / 1e9,
                           "issue_ms": median_of([a[1] for a in alone]) * 1e3, **built}  # fmt: skip
    for order, (first, second) in (("copy_first", (copy, compute)), ("compute_first", (compute, copy))):
        runs = []
        for i in range(args.repeats):
            if order == "compute_first" and i == args.repeats - 1:
                clear_rows(setup, copy_slots)  # the last timed run must copy the rows again
            runs.append(clock.both(first, second))
        span = median_of([r[0] for r in runs])
        first_s = median_of([r[1] for r in runs])
        second_s = median_of([r[2] for r in runs])
        copy_in, compute_in = (first_s, second_s) if order == "copy_first" else (second_s, first_s)
        hidden = (copy_s + compute_s - span) / min(copy_s, compute_s)
        out[order] = {"span_ms": span * 1e3, "copy_ms": copy_in * 1e3, "compute_ms": compute_in * 1e3,
                      "hidden": hidden}  # fmt: skip
    if setup.device.type == "cuda":
        torch.cuda.synchronize()
    check_copied(setup, pairs)
    return out


def table(result: dict[str, Any]) -> str:
    lines = [f"device {result['device']}; torch {result['torch']}; expert row {result['expert_shape']['row_bytes']} B"]
    if not result["concurrent"]:
        lines.append(
            "on the CPU: every run one after the other (the plumbing and the copies' check; no overlap figure)"
        )
    head = f"{'copy':>10} {'m':>3} {'copy ms':>8} {'GB/s':>6} {'issue ms':>8} {'comp ms':>8} {'span cf':>8} "
    lines.append(head + f"{'hid cf':>7} {'span kf':>8} {'hid kf':>7} {'copy@kf':>8} {'comp@cf':>8}")
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"{r['copy']:>10} {r['m']:>3} failed: {r['error']}")
            continue
        cf, kf = r["copy_first"], r["compute_first"]
        lines.append(
            f"{r['copy']:>10} {r['m']:>3} {r['copy_ms']:>8.3f} {r['copy_gbps']:>6.1f} {r['issue_ms']:>8.3f} "
            f"{r['compute_ms']:>8.3f} {cf['span_ms']:>8.3f} {cf['hidden']:>7.2f} {kf['span_ms']:>8.3f} "
            f"{kf['hidden']:>7.2f} {kf['copy_ms']:>8.3f} {cf['compute_ms']:>8.3f}"
        )
    for r in result["rows"]:
        if "switch_nodes" in r:
            lines.append(
                f"{r['copy']} m={r['m']}: {r['lanes']} lanes, {r['switch_nodes']} memcpy nodes, added in "
                f"{r['switch_build_ms']:.1f} ms, added and instantiated in {r['switch_capture_ms']:.1f} ms"
            )
    lines.append("cf: the copy issued first, kf: the compute first; hid: (copy + compute - span) / the shorter alone;")
    lines.append(
        "copy@kf: the copy's time beside the compute issued first; comp@cf: the compute's beside the copy first"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="the JSON record to write (required unless --show)")
    ap.add_argument("--show", type=Path, help="print the table of a stored record and exit (no device)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--m", default="4,16", help="experts a copy moves")
    ap.add_argument("--programs", default="8,16,32,64", help="`kernel:P` arms (copy_programs)")
    ap.add_argument("--wide", default="8,16,32", help="`wide:P` arms (64 KiB a program iteration)")
    ap.add_argument("--proxy", action=argparse.BooleanOptionalAction, default=True, help="the `proxy` arm (DMA proxy)")
    ap.add_argument("--switch", default="", help="`switch` arms: lane counts, `m` for as many lanes as copies "
                    "(e.g. m,16); off by default")  # fmt: skip
    ap.add_argument("--rows", default="split", choices=["split", "packed"], help="expert rows' layout (store.py)")
    ap.add_argument("--tokens", type=int, default=4, help="decode batch of the compute (B)")
    ap.add_argument("--passes", type=int, default=0, help="expert passes the compute runs (0: as long as the DMA)")
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.show is not None:
        print(table(json.loads(args.show.read_text())))
        return 0
    if args.out is None:
        ap.error("--out is required (or --show a stored record)")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("copy_overlap.py: no CUDA device (--device cpu runs the plumbing only)", file=sys.stderr)
        return 2
    ms = [int(v) for v in args.m.split(",")]
    if args.experts - args.slots < max(ms):
        print(f"copy_overlap.py: --m {max(ms)} needs {max(ms)} experts outside the --slots {args.slots} "
              f"(--experts {args.experts})", file=sys.stderr)  # fmt: skip
        return 2
    if args.slots < args.top_k * 2:
        print(
            f"copy_overlap.py: --slots {args.slots} leaves too few for the compute's top_k {args.top_k}",
            file=sys.stderr,
        )
        return 2
    lanes = [v for v in args.switch.split(",") if v]
    top = min(args.slots, switch_lanes.MAX_LANES)
    if any(v != "m" and not (v.isdigit() and max(ms) <= int(v) <= top) for v in lanes) or (
        lanes and max(ms) > top
    ):  # `m` lanes too: as many as the largest --m
        print(f"copy_overlap.py: --switch {args.switch}: each entry `m` or a lane count in {max(ms)}..{top} (at least "
              f"the largest --m, at most --slots and {switch_lanes.MAX_LANES})", file=sys.stderr)  # fmt: skip
        return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def write(result: dict[str, Any]) -> None:
        args.out.write_text(json.dumps(result, indent=2) + "\n")

    result = measure(args, torch.device(args.device), write)
    print(table(result))
    return 1 if any("error" in r for r in result["rows"]) else 0


if __name__ == "__main__":
    raise SystemExit(main())
