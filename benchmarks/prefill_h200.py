"""Paged prefill against its page-in floor, in process, on the 48-layer Qwen3-30B-A3B-shaped model.

One process, one pinned host store (`paged_experts.weights.synth_memory`, seeded bf16 weights) shared by
every cell. Per cell (mode, K, routing, prefill residency policy, page-in path): one warm-up prompt,
then `--repeats` prompts of `--prompt` tokens (fresh random token ids, one engine step each, the
model's state carried from one to the next as in a server), each followed by `--decode` eager decode
steps. Per prompt, from `torch.cuda.synchronize()` to `torch.cuda.synchronize()`:

    prefill_s                    the step's wall time (what TTFT adds over HTTP and sampling)
    floor_s = prefill bytes / link      link = `benchsuite linkbw`'s paging figure, measured here
    of_floor = prefill_s / floor_s      (the issue's target: <= 1.3 at K = 16, 32, 64)
    paging_of_floor = (prefill_s - router_s) / floor_s      (without the synthetic router's host time)
    copy_busy = page-in copy time / the step's device span (the runtime's prefill counters)
    router_s = host time in the synthetic router (the measurement's cost; resident pays it too)
    decode hit rate = hits / (hits + misses) of the decode steps after the prompt (what the prefill
                      residency policy left behind)
    idle / wait / plan ms = per paged layer-step, medians over the prompts: the link's idle before the
                      layer's first page-in, and the host's time blocked on the device (the routed ids) and
                      the rest of its host time (plan, launches); beside the prompts' fastest and slowest
                      prefill_s, they say whether a slow prompt waited on the host or on the device
    issue / cpu = medians over the prompts of the model's host time issuing the prompt's step over prefill_s
                      (near 1: the device never got ahead of the host's issue; wait ms says whether the host
                      was working or waiting on the device meanwhile), and of the thread's CPU time over that
                      issue time (near 1: the thread ran all along; below: it was off the CPU)
    gc ms = the longest time the garbage collector took inside one measured prompt's prefill (CPU ms of its
                      collections: paged_experts/server/gc_pauses.py); with --gc-freeze on (the default, as the
                      server: `--enable-gc-freeze`) the heap is frozen after each cell's warm-up prompt, so no
                      collection walks the model; a collection is CPU time on the engine thread, on its CPU
    queued / cpu ids = the median share of that issue time the thread was runnable but waiting for a CPU (the rest
                      off the CPU was blocked: a lock, a sleeping read), and the CPUs the prompts' steps ended on
                      (paged_experts/thread_clock.py; Linux)

    memory (CUDA) = per cell, from an emptied allocator cache: torch's allocated bytes and the device's used bytes
                      (mem_get_info, every process) before the model's build (an earlier cell's leftovers), after it and
                      at the cell's end, and torch's peak allocated and peak reserved bytes (the JSON's `memory`; the
                      table's "alloc GB" / "peak GB": peak allocated / reserved): where a paged server's measured peak
                      comes from at a K

    nvml/off = with --nvml-sampler ab: the median prefill_s of the measured prompts 2, 4, ... (the runner's memory
                      sampler's NVML reads running beside them in a process of their own, every 150 ms:
                      benchsuite.tools.nvml_load) over that of prompts 1, 3, ... (without): above 1, the instrument's
                      reads slow the engine; each cell's nvml_read_ms_max says how long one read took (the other
                      columns are then over all measured prompts, with and without)

Page-in paths: `streamed` (the runtime: page-ins on the page-in stream, overlapped with the waves'
compute) and `serial` (the same plan with the page-in stream taken away, so copies queue on the
compute stream behind each wave: the comparison that shows what the overlap buys), `batch` (streamed,
with each group of page-ins as one cuMemcpyBatchAsync: `page_in: batch`, against streamed's DMAs), and `kernel`
(`page_in: kernel`: each group of page-ins as one launch of the Triton copy kernel, every SM's program) or
`kernel:P` (the copy from P programs looping over its chunks, the rest of the SMs left to the waves: the grid
`copy_programs` caps for the decode's copies; the server has no option for it in the prefill). A capped copy is one
launch per tensor (six for an FP8 row), where `kernel` copies every tensor in one launch: `kernel` against `kernel:P`
differs in the launches too, not in the grid alone. Both need CUDA.

    python benchmarks/prefill_h200.py --out prefill.json            # ~6 min on one H200
    python benchmarks/prefill_h200.py --out p.json --preset tiny --layers 4 --device cpu --ks 8   # CPU smoke
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

import paged_experts.moe.paged as paged_module
import paged_experts.moe.waves as waves_module
from paged_experts.kernels.copy_kernel import copy_planned
from paged_experts.kv import KvPool
from paged_experts.model import MoeCausalLM, SeqChunk
from paged_experts.residency.page_in import EXPERT_ROWS, PageIn, resolve_expert_rows
from paged_experts.routing.sources import make_router
from paged_experts.runtime import RuntimeConfig
from paged_experts.server import gc_pauses
from paged_experts.weights import synth_memory
from paged_experts.weights.weights_id import source_weights

SCHEMA_VERSION = 1
PATHS = ("streamed", "serial", "batch", "kernel", "kernel:P")


def path_page_in(path: str) -> tuple[PageIn, int | None]:
    """A page-in path -> (RuntimeConfig.page_in, the kernel copy's program cap or None); ValueError if unknown."""
    if path in ("streamed", "serial"):
        return "auto", None
    if path == "batch":
        return "batch", None
    if path == "kernel":
        return "kernel", None
    kind, _, programs = path.partition(":")
    if kind == "kernel" and re.fullmatch(r"[1-9][0-9]*", programs):
        return "kernel", int(programs)
    raise ValueError(f"page-in path {path!r}: choose from streamed, serial, batch, kernel, kernel:P (P >= 1)")


@dataclass(frozen=True)
class Cell:
    mode: str  # "resident" | "paged"
    k: int | None
    routing: str  # "model" or a synthetic routing spec
    keep: str | None  # prefill residency policy (paged)
    path: str  # "streamed" | "serial" | "batch" | "kernel" | "kernel:P" (paged)

    @property
    def name(self) -> str:
        if self.mode == "resident":
            return f"resident/{self.routing}"
        return f"paged:{self.k}/{self.routing}/{self.keep}/{self.path}"


def plan_cells(ks: list[int], routings: list[str], keeps: list[str], paths: list[str]) -> list[Cell]:
    """Most important first (a --deadline-s cut drops the tail): the first routing's resident and
    streamed cells with the first policy, then the other policies, then the serial path, then the
    other routings."""
    cells: list[Cell] = []
    for routing in routings:
        cells.append(Cell("resident", None, routing, None, "streamed"))
        cells += [Cell("paged", k, routing, keeps[0], paths[0]) for k in ks]
        cells += [Cell("paged", k, routing, keep, paths[0]) for keep in keeps[1:] for k in ks]
        cells += [Cell("paged", k, routing, keeps[0], path) for path in paths[1:] for k in ks]
    return cells


class NvmlLoad:
    """The runner's memory sampler's reads (benchsuite.tools.nvml_load) in a process of their own, for the length
    of a `with` block: it starts reading before the block's body and stops after it. `stats` holds what it read
    (reads, read_ms_median, read_ms_max, read_s_total)."""

    def __init__(self, scripted_read_s: float | None = None) -> None:
        self.argv = [sys.executable, "-m", "benchsuite.tools.nvml_load"]
        if scripted_read_s is not None:
            self.argv += ["--scripted-read-s", str(scripted_read_s)]
        self.stats: dict[str, Any] | None = None
        self._proc: subprocess.Popen[str] | None = None

    def __enter__(self) -> NvmlLoad:
        self._proc = subprocess.Popen(self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self._proc.stdout is not None
        first = self._proc.stdout.readline().strip()
        if first != "ready":  # its one-line JSON error (no NVML), or nothing
            self._proc.wait(timeout=30)
            raise RuntimeError(f"nvml_load did not start: {first or 'no output'}")
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._proc is not None
        out, _ = self._proc.communicate(input="", timeout=60)  # stdin closed: it stops and reports
        self.stats = json.loads(out.strip().splitlines()[-1]) if out.strip() else None


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def measure_link(device: str) -> dict[str, Any]:
    """`benchsuite linkbw`'s paging figure (pinned H2D, back-to-back expert-sized copies), measured now."""
    if device != "cuda":
        return {"error": "no CUDA device: no link figure, no floor"}
    from benchsuite.tools.linkbw import LinkPlan, measure

    report = measure(LinkPlan(pageable=False, d2h=False))
    return {"paging_gb_per_s": report.paging_gb_per_s, "report": report.to_dict()}


def rows_layout(args: argparse.Namespace) -> str:
    """The paged cells' expert layout, --expert-rows with 'auto' resolved as the runtime resolves it (every cell of a
    run, resident ones too, shares one host store in this layout)."""
    return resolve_expert_rows(args.expert_rows, "paged", args.device)


def build(cell: Cell, args: argparse.Namespace) -> MoeCausalLM:
    programs: int | None = None
    if cell.mode == "resident":
        # the same host store as the paged cells (one in memory at a time); resident device rows stay split
        rt = RuntimeConfig(mode="resident", device=args.device, dtype=args.dtype, expert_rows=rows_layout(args))
    else:
        page_in, programs = path_page_in(cell.path)
        rt = RuntimeConfig(mode="paged", resident_experts=cell.k, device=args.device, dtype=args.dtype,
                           prefill_residency=cell.keep or "recent", page_in=page_in,
                           expert_rows=rows_layout(args), prefill_staging_rows=args.staging_rows)  # fmt: skip
    model = MoeCausalLM.synthetic(args.preset, rt, layers=args.layers, seed=args.seed)
    if programs is not None:  # every layer shares the one engine (MoeShared.page_in)
        model.moe_layers[0].shared.page_in.row_kernel = functools.partial(copy_planned, programs=programs)
    model.router_override = None if cell.routing == "model" else make_router(cell.routing, model.config, args.seed)
    return model


def one_prompt(model: MoeCausalLM, pool: KvPool, prompt: list[int], decode: int, device: str) -> dict[str, Any]:
    """Prefill `prompt` in one step, then `decode` greedy steps; the figures of both."""
    seq = pool.new_sequence()
    try:
        model.counters.reset()
        sync(device)
        gc_before = gc_pauses.clock().snapshot()
        t0 = time.perf_counter()
        step = model.run_step([SeqChunk(seq, prompt, 0)])
        token = int(step.greedy[0])  # the first token on the host
        prefill_s = time.perf_counter() - t0
        gc_after = gc_pauses.clock().snapshot()
        snap = model.counters.snapshot()
        t1 = time.perf_counter()
        for i in range(decode):
            token = int(model.run_step([SeqChunk(seq, [token], len(prompt) + i)]).greedy[0])
        sync(device)
        decode_s = time.perf_counter() - t1
        after = model.counters.snapshot()  # counters of the decode steps only (reset after the prefill read)
    finally:
        pool.free(seq)
    p, d = snap.prefill, after.total
    return {
        "prefill_s": prefill_s,
        "prefill": p.to_dict(),
        "issue_s": None if step.prefill is None else step.prefill.issue_s,  # the host's time issuing the step
        "issue_cpu_s": None if step.prefill is None else step.prefill.issue_cpu_s,  # the thread's CPU time in it
        # the rest of it: runnable but waiting for a CPU, the switches, the CPUs (paged_experts/thread_clock.py)
        **{
            name: None if step.prefill is None else getattr(step.prefill, name)
            for name in (
                "issue_run_delay_s",
                "issue_voluntary_switches",
                "issue_involuntary_switches",
                "cpu_id_first",
                "cpu_id_last",
            )
        },  # fmt: skip
        # the collector inside the prefill: CPU seconds of its collections, and how many of each generation
        "gc_s": sum(gc_after.pause_s) - sum(gc_before.pause_s),
        "gc_collections": [a - b for a, b in zip(gc_after.collections, gc_before.collections)],
        "union_mean": snap.total.union_sum / max(1, snap.total.steps),
        "decode_s": decode_s,
        "decode_hits": d.hits - snap.total.hits,
        "decode_misses": d.misses - snap.total.misses,
    }


def run_cell(cell: Cell, args: argparse.Namespace, link_b_per_s: float | None) -> dict[str, Any]:
    if cell.path == "serial":
        paged_module.page_in_stream = lambda device: None  # type: ignore[assignment]  # copies on the compute stream
    frozen = False  # the heap frozen for this cell (--gc-freeze on), given back at its end
    memory: dict[str, int] = {}
    try:
        cuda = args.device == "cuda"
        if cuda:  # the earlier cells' blocks given back, so this cell's reserved bytes are its own
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            # what an earlier cell left behind (nothing, if its model was freed): a reading climbing with the cells
            # order would be carry-over, not this cell's
            memory["allocated_before_build_bytes"] = torch.cuda.memory_allocated()
            memory["device_used_before_build_bytes"] = device_used_bytes()
        t0 = time.perf_counter()
        model = build(cell, args)
        build_s = time.perf_counter() - t0
        if cuda:
            sync(args.device)
            memory["allocated_after_build_bytes"] = torch.cuda.memory_allocated()
            memory["device_used_after_build_bytes"] = device_used_bytes()
        vocab = model.config.vocab_size
        gen = torch.Generator().manual_seed(args.seed)
        prompts = [torch.randint(0, vocab, (args.prompt,), generator=gen).tolist() for _ in range(args.repeats + 1)]
        pool = KvPool.for_model(model, capacity_tokens=256 * -(-(args.prompt + args.decode + 1) // 256))  # whole blocks
        runs = []
        for i, p in enumerate(prompts):
            if i == 1 and args.gc_freeze == "on":  # as the server: loaded and warmed, then the heap frozen
                gc_pauses.freeze_heap()
                frozen = True
            if args.nvml_sampler == "ab" and i % 2 == 0 and i > 0:  # measured prompts 2, 4, ...: the reads beside
                with NvmlLoad(args.nvml_scripted_read_s) as load:
                    run = one_prompt(model, pool, p, args.decode, args.device)
                runs.append({**run, "nvml": load.stats})
            else:
                runs.append({**one_prompt(model, pool, p, args.decode, args.device), "nvml": None})
        if cuda:
            memory["peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
            memory["peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
            memory["device_used_at_end_bytes"] = device_used_bytes()
    finally:
        paged_module.page_in_stream = _PAGE_IN_STREAM
        if frozen:  # the next cell's model is built unfrozen: this cell's objects go back to the collector
            gc_pauses.release_heap()
    measured = runs[1:]  # the first prompt warms the kernels up
    prefill_s = statistics.median(r["prefill_s"] for r in measured)
    bytes_paged = statistics.median(r["prefill"]["bytes_paged_in"] for r in measured)
    hits, misses = sum(r["decode_hits"] for r in measured), sum(r["decode_misses"] for r in measured)
    floor_s = bytes_paged / link_b_per_s if link_b_per_s and bytes_paged else None
    router_s = statistics.median(r["prefill"]["router_s"] for r in measured)
    copy_busy = [r["prefill"]["copy_busy_fraction"] or 0.0 for r in measured]

    def per_layer_ms(name: str) -> float | None:  # a prefill counter per paged layer-step, median over the prompts
        if cell.mode != "paged":
            return None
        return statistics.median(1e3 * r["prefill"][name] / max(1, r["prefill"]["layer_steps"]) for r in measured)

    return {
        **asdict(cell),
        "cell": cell.name,
        "build_s": build_s,
        "prefill_s": prefill_s,
        "prefill_s_min": min(r["prefill_s"] for r in measured),
        "prefill_s_max": max(r["prefill_s"] for r in measured),
        "prefill_bytes": bytes_paged,
        "floor_s": floor_s,
        "of_floor": prefill_s / floor_s if floor_s else None,
        "copy_busy": statistics.median(copy_busy) if cell.mode == "paged" else None,
        "waves_per_layer": statistics.median(
            r["prefill"]["waves"] / max(1, r["prefill"]["layer_steps"]) for r in measured
        ),
        "router_s": router_s,
        "idle_before_layer_ms": per_layer_ms("idle_before_layer_s"),
        "host_wait_ms": per_layer_ms("host_wait_s"),
        "host_plan_ms": per_layer_ms("host_plan_s"),
        "paging_of_floor": (prefill_s - router_s) / floor_s if floor_s else None,
        "issue_of_prefill": _median_of(r["issue_s"] / r["prefill_s"] for r in measured if r["issue_s"] is not None),
        "on_cpu": _median_of(r["issue_cpu_s"] / r["issue_s"] for r in measured if r["issue_s"]),
        "queued": _median_of(  # waiting for a CPU, of the issue time
            r["issue_run_delay_s"] / r["issue_s"]
            for r in measured
            if r["issue_s"] and r["issue_run_delay_s"] is not None
        ),
        "cpu_ids": sorted({r["cpu_id_last"] for r in measured if r["cpu_id_last"] is not None}),
        "gc_ms_max": 1e3 * max(r["gc_s"] for r in measured),  # the longest collection time inside one prefill
        "gc_full_collections": sum(r["gc_collections"][-1] for r in measured),
        # --nvml-sampler ab: the prompts with the sampler's reads beside them against those without
        "prefill_s_nvml_on": _median_of(r["prefill_s"] for r in measured if r["nvml"] is not None),
        "prefill_s_nvml_off": _median_of(r["prefill_s"] for r in measured if r["nvml"] is None)
        if args.nvml_sampler == "ab"
        else None,
        "nvml_read_ms_max": max((r["nvml"]["read_ms_max"] or 0.0 for r in measured if r["nvml"]), default=None),
        "decode_hit_rate": hits / (hits + misses) if hits + misses else None,
        "decode_tok_s_eager": args.decode * len(measured) / sum(r["decode_s"] for r in measured)
        if args.decode
        else None,
        "memory": memory or None,
        "runs": runs,
    }


def device_used_bytes() -> int:
    """Bytes in use on the device by every process, contexts included (what NVML's per-device count says)."""
    free, total = torch.cuda.mem_get_info()
    return total - free


_PAGE_IN_STREAM = paged_module.page_in_stream


def _median_of(values: Iterable[float]) -> float | None:
    present = list(values)
    return statistics.median(present) if present else None


def provenance() -> dict[str, Any]:
    from benchsuite.tools.machine import git_facts

    git = git_facts()
    return {
        "git_commit": git.commit, "git_dirty": git.dirty, "git_tree": git.tree, "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "cpu_count": os.cpu_count(), "python": sys.version.split()[0],
    }  # fmt: skip


def _fmt(value: float | None, spec: str) -> str:
    return format(value, spec) if value is not None else "-"


def _nvml_ratio(cell: dict[str, Any]) -> float | None:
    """The median prefill with the sampler's reads beside it over the median without (--nvml-sampler ab)."""
    on, off = cell.get("prefill_s_nvml_on"), cell.get("prefill_s_nvml_off")
    return on / off if on and off else None


def _cpu_ids(cpus: list[int] | None) -> str:
    return ",".join(str(c) for c in cpus) if cpus else "-"


def _peak_gb(cell: dict[str, Any], key: str) -> float | None:
    memory = cell.get("memory")
    return memory[key] / 1e9 if memory else None


def render(record: dict[str, Any]) -> str:
    link = record["link"].get("paging_gb_per_s")
    setting = f"expert_rows {record.get('expert_rows', 'split')}, staging rows {record.get('staging_rows', 0)}"
    shown = f"{link:.1f} GB/s" if link else record["link"].get("error")
    lines = [f"link (paging figure): {shown}; paged cells: {setting}",
             (f"{'cell':<40} {'prefill s':>9} {'min-max s':>11} {'GB':>6} {'floor s':>8} {'/floor':>7} {'busy':>5}"
              f" {'waves/L':>7} {'router s':>8} {'-router':>7} {'dec hit':>7} {'idle ms':>7} {'wait ms':>7}"
              f" {'plan ms':>7} {'issue':>5} {'cpu':>5} {'queued':>6} {'gc ms':>6} {'nvml/off':>8}"
              f" {'alloc GB':>8} {'peak GB':>7}  cpu ids")]  # fmt: skip
    for c in record["cells"]:
        if "error" in c:
            lines.append(f"{c['cell']:<40} {c['error']}")
            continue
        spread = f"{c['prefill_s_min']:.3f}-{c['prefill_s_max']:.3f}"
        figures = (
            f"{c['prefill_s']:>9.3f} {spread:>11} {c['prefill_bytes'] / 1e9:>6.1f} {_fmt(c['floor_s'], '8.3f'):>8}",
            f"{_fmt(c['of_floor'], '7.2f'):>7} {_fmt(c['copy_busy'], '5.2f'):>5} {c['waves_per_layer']:>7.1f}",
            f"{c['router_s']:>8.3f} {_fmt(c['paging_of_floor'], '7.2f'):>7} {_fmt(c['decode_hit_rate'], '7.3f'):>7}",
            f"{_fmt(c['idle_before_layer_ms'], '7.2f'):>7} {_fmt(c['host_wait_ms'], '7.2f'):>7}",
            f"{_fmt(c['host_plan_ms'], '7.2f'):>7} {_fmt(c.get('issue_of_prefill'), '5.2f'):>5}",
            f"{_fmt(c.get('on_cpu'), '5.2f'):>5} {_fmt(c.get('queued'), '6.2f'):>6}",
            f"{_fmt(c.get('gc_ms_max'), '6.1f'):>6} {_fmt(_nvml_ratio(c), '8.3f'):>8}",
            f"{_fmt(_peak_gb(c, 'peak_allocated_bytes'), '8.2f'):>8}",
            f"{_fmt(_peak_gb(c, 'peak_reserved_bytes'), '7.2f'):>7}",
            f" {_cpu_ids(c.get('cpu_ids'))}",
        )
        lines.append(f"{c['cell']:<40} " + " ".join(figures))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="JSON record (a .txt table is written beside it)")
    ap.add_argument("--preset", default="qwen3-30b-a3b-shape")
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--ks", default="16,32,64")
    ap.add_argument(
        "--routings", default="qwen3-30b-a3b,model", help="'model' and/or paged_experts.routing.sources specs"
    )
    ap.add_argument("--keeps", default="recent,lru", help="prefill residency policies (the first is the default path)")
    ap.add_argument("--paths", default="streamed,serial", help=f"page-in paths: {', '.join(PATHS)}")
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3, help="measured prompts per cell (after one warm-up prompt)")
    ap.add_argument("--decode", type=int, default=32, help="decode steps after each prompt")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--deadline-s", type=float, default=540.0, help="start no new cell after this many seconds")
    ap.add_argument("--nvml-sampler", choices=("off", "ab"), default="off",
                    help="ab: every other measured prompt runs beside the runner's memory sampler's NVML reads "
                         "(benchsuite.tools.nvml_load), the rest without")  # fmt: skip
    ap.add_argument("--gc-freeze", choices=("on", "off"), default="on",
                    help="on (as the server): the heap frozen for the garbage collector after each cell's warm-up "
                         "prompt; off: every collection walks the model")  # fmt: skip
    ap.add_argument("--rows-in-kernel", choices=("on", "off"), default="on",
                    help="on (the runtime's default): a host-planned FP8 wave's grouped launches read and write its "
                         "rows through the step's layout; off: a gather before them and an index copy after "
                         "(moe/waves.py ROWS_IN_KERNEL; A/B two processes with benchmarks/prefill_ab.py)")  # fmt: skip
    ap.add_argument("--expert-rows", choices=EXPERT_ROWS, default="auto",
                    help="the paged layers' expert layout (RuntimeConfig.expert_rows): packed = one byte row an "
                         "expert, one DMA a run of experts; auto = the runtime's (packed on CUDA, split on the "
                         "CPU); A/B: two processes")  # fmt: skip
    ap.add_argument(
        "--staging-rows",
        type=int,
        default=0,
        help="the paged cells' prefill staging rows (RuntimeConfig.prefill_staging_rows; 0: none)",
    )
    ap.add_argument("--nvml-scripted-read-s", type=float, default=None, help=argparse.SUPPRESS)  # the harness's test
    args = ap.parse_args(argv)
    waves_module.ROWS_IN_KERNEL = args.rows_in_kernel == "on"
    if args.nvml_sampler == "ab":
        try:
            with NvmlLoad(args.nvml_scripted_read_s):
                pass
        except RuntimeError as exc:
            ap.error(f"--nvml-sampler ab: {exc}")
    t_start = time.perf_counter()
    paths = [p for p in args.paths.split(",") if p]
    for path in paths:
        try:
            page_in, _ = path_page_in(path)
        except ValueError as exc:
            ap.error(f"--paths: {exc}")
        if page_in == "kernel" and args.device != "cuda":
            ap.error(f"--paths {path}: the kernel copy needs --device cuda")
    record: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION, "benchmark": "prefill_h200",
        "command": ["python", "benchmarks/prefill_h200.py", *(sys.argv[1:] if argv is None else argv)],
        "model": f"synth:{args.preset}?layers={args.layers}&seed={args.seed} (in-memory random weights)",
        "source_weights": source_weights(f"synth:{args.preset}?layers={args.layers}&seed={args.seed}"),
        "provenance": provenance(), "cells": [],
        "expert_rows": rows_layout(args), "staging_rows": args.staging_rows,  # the paged cells' layout and staging
    }  # fmt: skip
    cfg = synth_memory.config_for(synth_memory.SynthSpec(args.preset, args.layers, args.seed))
    t0 = time.perf_counter()
    silent = synth_memory.silent_ids(f"synth:{args.preset}")  # as the cells' models (MoeCausalLM.synthetic): one store
    synth_memory.host_weights(
        cfg, getattr(torch, args.dtype), args.seed, torch.device(args.device), silent, rows_layout(args) == "packed"
    )
    record["host_store_build_s"] = time.perf_counter() - t0
    record["link"] = measure_link(args.device)
    link = record["link"].get("paging_gb_per_s")
    link_b_per_s = link * 1e9 if link else None
    cells = plan_cells(
        [int(k) for k in args.ks.split(",") if k], args.routings.split(","), args.keeps.split(","), paths
    )
    txt = args.out.with_suffix(".txt")
    for cell in cells:
        if time.perf_counter() - t_start > args.deadline_s:
            record["cells"].append({**asdict(cell), "cell": cell.name, "error": "skipped: --deadline-s"})
            continue
        try:
            record["cells"].append(run_cell(cell, args, link_b_per_s))
        except Exception as exc:  # noqa: BLE001 - a failed cell is recorded, the rest still run
            record["cells"].append({**asdict(cell), "cell": cell.name, "error": repr(exc)})
        args.out.write_text(json.dumps(record, indent=2, default=str))
        txt.write_text(render(record) + "\n")
        print(render(record).splitlines()[-1], flush=True)
    print(render(record))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
