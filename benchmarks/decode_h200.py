"""Decode tok/s of the 48-layer Qwen3-30B-A3B-shaped model in every mode, against its roofline.

The model is built in memory (`paged_experts.weights.synth_memory`: seeded random bf16 weights, one pinned
host store shared by every mode), so no 58 GB checkpoint is written. One process runs every cell:
for each mode a model is placed from the shared host store; for each routing source and batch B,
B prompts are prefilled, `--warmup` decode steps are discarded, then decode steps are timed
(`torch.cuda.synchronize` around; at most `--steps`, stopping early after `--cell-cap-s`).

Per cell: tok/s = B x steps / seconds; ms per step; hit rate, misses and bytes paged per token
from the runtime's own counters; and the roofline
    roofline_step_s = max(compute_step_s, misses_per_step x expert_bytes / link_B_per_s)
    serial_step_s = compute_step_s + misses_per_step x expert_bytes / link_B_per_s
(the second: the bound of a step that pages a layer's misses only after its router ran), where
compute_step_s is the resident mode's measured step time at the same B and routing (the
best the code does with nothing to page) and link_B_per_s the measured pinned host->device rate
of back-to-back expert copies (`--linkbw-json` from `python -m benchsuite linkbw`, else measured
here). `roofline_fraction = roofline_step_s / measured_step_s` (1.0 = at the roofline), likewise
`serial_fraction`. misses_per_step: the host LRU planner replayed over the cell's routed ids (graphed
cells), else the runtime's counters.
Resident cells also report the HBM bound: bytes of weights touched per step / measured device
copy bandwidth.

    python benchmarks/decode_h200.py --out decode.json [--layers 48] [--modes resident,paged:16,...]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from paged_experts.kernels import fused, moe_tiles
from paged_experts.kernels.fused import grouped_backend
from paged_experts.kv import KvPool
from paged_experts.model import MoeCausalLM, SeqChunk
from paged_experts.moe import waves as waves_module
from paged_experts.residency import pinned
from paged_experts.residency.page_in import resolve_expert_rows
from paged_experts.residency.planner import LayerResidency
from paged_experts.residency.store import ExpertTensors
from paged_experts.runtime import RuntimeConfig
from paged_experts.weights import synth_memory
from paged_experts.weights.weights_id import source_weights

SCHEMA_VERSION = 1
DEFAULT_MODES = (  # most important first: a --deadline-s cut drops the tail
    "resident/graphs+compile+triton,resident/graphs+compile,resident/graphs,resident,"
    "paged:16/graphs+compile+triton,paged:30/graphs+compile+triton,paged:32/graphs+compile+triton,"
    "paged:64/graphs+compile+triton,paged:92/graphs+compile+triton,paged:16/graphs+compile+triton+prefetch,"
    "paged:32/graphs+compile+triton+prefetch,paged:64/graphs+compile+triton+prefetch,"
    "paged:92/graphs+compile+triton+prefetch,offload,cpu-experts:12,cpu-experts:24,"
    "cpu-experts:48,paged:32/graphs+compile,paged:64/graphs+compile,paged:32/host,paged:64/host,paged:16/host,"
    "paged:92/host,resident/loop"
)


VARIANT_OPTIONS = ("host", "graphs", "compile", "overlap", "loop", "triton", "prefetch", "torchplan", "pertensor")
VARIANT_OPTIONS += ("fused", "kernelcopy", "batchcopy", "devtables", "unfusedglu", "gathered", "deqattn", "packed")
VARIANT_OPTIONS += ("split", "switch", "duel")
"""Options after '/' in a --modes entry (joined by '+'):
- host: paged steps planned on the host (device_planning='off'): the path before device planning;
- graphs: decode steps captured as CUDA graphs (--graphs batch sizes; for paged K only batch sizes
  with B x top_k <= K; synthetic routing draws each step's ids for every layer before the replay);
- compile: with graphs, the per-layer blocks go through torch.compile before capture;
- overlap: paged hits compute while the misses copy (overlap_page_in);
- switch: with overlap, the misses' copies on the copy engines, started by the captured step's SWITCH conditional
  nodes (overlap_copies='switch'; eager steps copy by the kernel);
- prefetch: with graphs, each paged layer's experts are predicted from the previous layer's
  residual stream (its router on it) and paged in on a second stream while that layer computes
  (prefetch_next_layer); the layer then pages in only what the prediction missed;
- loop: the per-expert reference kernel instead of the fused grouped matmuls;
- torchplan: device-planned paged layers plan with the torch ops instead of the fused plan kernel;
- pertensor: device-planned page-ins launch the copy kernel once per tensor, not once for all six;
- kernelcopy: host-planned page-ins (prefill waves) as one copy-kernel launch per group (page_in='kernel');
- batchcopy: host-planned page-ins as one cuMemcpyBatchAsync per group (page_in='batch');
- devtables: host-planned FP8 waves build their grouped kernel's block table by a launch a wave (before
  f5cadb7), not laid out with the plan;
- unfusedglu: FP8 grouped steps (prefill) run gate, up, silu and their product as four launches, as before
  the one-launch grouped_fp8_glu (kernels/fused.py GLU_ONE_LAUNCH);
- gathered: host-planned FP8 waves gather their pairs' activations before the grouped launches and index-copy the
  outputs after, as before the launches read and wrote through the layout (moe/waves.py ROWS_IN_KERNEL);
- fused: with triton, a one-token step's misses are read from the pinned host rows by the expert
  kernels and written through to their slots (fused_page_in), no copy kernel before the compute;
- triton: routing and the expert pass of one-wave steps (<= moe_triton.MAX_PAIRS pairs) as
  moe_triton's kernels (one routing kernel; per-pair gate+up+SiLU; down with the top-k combine);
- deqattn: a block-FP8 preset's attention projections dequantized to bf16 at load (dequantize_attention: the bytes of
  the layout before 2026-12-03, the FP8 values), against the default FP8 projections (kernels/linear_fp8.py);
- capN (cap16, cap32, ...): the page-in copy kernel's grid capped at N programs for this variant (copy_programs=N,
  device-planned paged modes; overrides --copy-programs), so capped and full-grid arms run in one process;
- duel: paged layers evict by `eviction_policy: duel` (LRU or the aging LFU per layer, by shadow caches) instead of
  the default policy, so the two policies' steps profile in one process;
- packed, split: paged layers' experts in packed rows (expert_rows='packed': one byte row an expert, one DMA a run)
  or split (a tensor each); neither: the runtime's default, 'auto' (packed for mode paged on CUDA, split elsewhere)."""


CAP = re.compile(r"cap([1-9][0-9]{0,3})")  # a variant's own copy grid cap: cap16 -> copy_programs=16


def variant_programs(options: frozenset[str], default: int | None) -> int | None:
    """The variant's copy_programs: its capN option's N, else `default` (--copy-programs); two caps are refused."""
    caps = [int(m.group(1)) for o in options if (m := CAP.fullmatch(o))]
    if len(caps) > 1:
        raise SystemExit(f"options {sorted(options)}: one capN a variant")
    return caps[0] if caps else default


def parse_variant(spec: str) -> tuple[str, frozenset[str]]:
    mode, _, opts = spec.partition("/")
    options = frozenset(o for o in opts.split("+") if o)
    unknown = {o for o in options if not CAP.fullmatch(o)} - set(VARIANT_OPTIONS)
    if unknown:
        raise SystemExit(
            f"--modes entry {spec!r}: unknown options {sorted(unknown)} (known: {VARIANT_OPTIONS} and capN)"
        )
    variant_programs(options, None)  # two caps refused here, before any mode builds
    return mode, options


def apply_plan_option(model: MoeCausalLM, options: frozenset[str]) -> None:
    """Before graphs: 'torchplan', the device-planned paged layers plan with the torch ops
    (`device.plan_step`) instead of the fused kernel (`plan_triton`); 'pertensor', their page-ins
    launch the copy kernel once per tensor instead of once for all (the A/Bs of the two); 'devtables', the
    host-planned waves build their grouped FP8 block tables by a launch a wave, not laid out with the plan;
    'unfusedglu', FP8 grouped steps run gate, up, silu and product as four launches (set for every variant);
    'gathered', host-planned FP8 waves gather their activations and index-copy their outputs around the grouped
    launches instead of reading and writing through the layout (waves.ROWS_IN_KERNEL, set for every variant)."""
    fused.GLU_ONE_LAUNCH = "unfusedglu" not in options
    waves_module.ROWS_IN_KERNEL = "gathered" not in options
    for moe in model.moe_layers:
        waves = getattr(moe, "waves", None)
        if waves is not None and "devtables" in options:
            waves.lay_out_block_tables = False
        lru = getattr(moe, "device_lru", None)
        if lru is None:
            continue
        if "torchplan" in options:
            lru.residency.fused = False
        if "pertensor" in options:
            lru.one_launch = False


def runtime_for(
    mode: str, device: str, options: frozenset[str] = frozenset(), copy_programs: int | None = None
) -> RuntimeConfig:
    """copy_programs: RuntimeConfig.copy_programs of device-planned paged modes (None elsewhere)."""
    name, _, n = mode.partition(":")
    if {"kernelcopy", "batchcopy"} <= options:
        raise SystemExit(f"{mode}: kernelcopy and batchcopy are two page-in copies; a variant takes one")
    backend = "triton" if "triton" in options else "grouped"
    deq = "deqattn" in options  # a block-FP8 model's attention dequantized at load (the layout before 2026-12-03)
    if name == "paged":
        return RuntimeConfig(
            mode="paged",
            resident_experts=int(n),
            device=device,
            dtype="bfloat16",
            device_planning="off" if "host" in options else "on",
            overlap_page_in="overlap" in options,
            overlap_copies="switch" if "switch" in options else "kernel",
            fused_page_in="fused" in options,
            prefetch_next_layer="prefetch" in options,
            kernel_backend=backend,
            copy_programs=None if "host" in options else copy_programs,
            page_in="kernel" if "kernelcopy" in options else "batch" if "batchcopy" in options else "auto",
            dequantize_attention=deq,
            expert_rows="packed" if "packed" in options else "split" if "split" in options else "auto",
            **({"eviction_policy": "duel"} if "duel" in options else {}),
        )
    if name == "cpu-experts":
        return RuntimeConfig(
            mode="cpu-experts", cpu_expert_layers=int(n), device=device, dtype="bfloat16", kernel_backend=backend,
            dequantize_attention=deq,
        )  # fmt: skip
    return RuntimeConfig(
        mode=name,
        device=device,
        dtype="bfloat16",
        kernel_backend=backend,
        dequantize_attention=deq,  # type: ignore[arg-type]
    )


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def measure_link(device: str, expert_bytes: int, linkbw_json: str | None) -> dict[str, Any]:
    """Pinned host->device B/s of back-to-back expert copies (the paging rate) and device copy B/s."""
    out: dict[str, Any] = {}
    if linkbw_json and Path(linkbw_json).is_file():
        try:
            from benchsuite.tools.linkbw import paging_b_per_s_from_json

            out["link_B_per_s"] = paging_b_per_s_from_json(linkbw_json)
            out["link_source"] = linkbw_json
        except Exception as exc:  # noqa: BLE001 - a broken probe file must not lose the decode figures
            out["linkbw_json_error"] = repr(exc)
    if device != "cuda":
        return out
    n = 64
    host = torch.empty(n, expert_bytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(n, expert_bytes, dtype=torch.uint8, device="cuda")
    for _ in range(2):
        dev.copy_(host, non_blocking=True)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(3):
        for i in range(n):
            dev[i].copy_(host[i], non_blocking=True)
    sync(device)
    out["expert_copy_B_per_s_here"] = 3 * n * expert_bytes / (time.perf_counter() - t0)
    out.setdefault("link_B_per_s", out["expert_copy_B_per_s_here"])
    out.setdefault("link_source", "measured here: 3 x 64 back-to-back pinned expert copies")
    big = torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda")
    big2 = torch.empty_like(big)
    big2.copy_(big)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(5):
        big2.copy_(big)
    sync(device)
    out["hbm_copy_B_per_s"] = 5 * 2 * big.numel() / (time.perf_counter() - t0)  # read + write
    del big, big2, host, dev
    return out


def measure_pagein_paths(host: ExpertTensors, expert_bytes: int, slots_n: int = 64) -> list[dict[str, Any]]:
    """Page-in rate of m experts into `slots_n` slots: the DMA engines (`copy_` per run of rows,
    host-planned) against the device-planned Triton kernel reading pinned memory (plan padded to
    `slots_n` entries as in a graph). CUDA events around 5 repetitions after a warm-up."""
    from paged_experts.kernels.copy_kernel import copy_planned, graph_safe
    from paged_experts.residency.store import PageInEngine

    dev = torch.device("cuda")
    e = host.num_rows
    packed = host.packed is not None  # slots in the store's layout (a page-in copies between one layout)
    h, inter, dtype = host.gate.shape[2], host.gate.shape[1], host.gate.dtype
    slots = ExpertTensors.empty(slots_n, h, inter, dtype, dev, is_fp8=host.is_fp8, packed=packed)
    engine = PageInEngine(dev, "direct", h, inter, dtype, slots_n, is_fp8=host.is_fp8, packed=packed)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for m in (1, 4, 8, 16, 32, 64):
        experts = torch.randperm(e, generator=gen)[:m]
        targets = torch.randperm(slots_n, generator=gen)[:m]
        pairs = list(zip(experts.tolist(), targets.tolist()))
        plan_e = torch.full((slots_n,), e, dtype=torch.long)
        plan_s = torch.full((slots_n,), slots_n, dtype=torch.long)
        plan_e[:m], plan_s[:m] = experts, targets
        plan_e, plan_s = plan_e.to(dev), plan_s.to(dev)
        row: dict[str, Any] = {"experts": m}
        paths = {"dma_copy": lambda pairs=pairs: engine.copy_rows(host, slots, pairs)}
        if graph_safe(dev):
            paths["triton_kernel"] = lambda plan_e=plan_e, plan_s=plan_s: copy_planned(host, slots, plan_e, plan_s)
        for name, fn in paths.items():
            fn()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(5):
                fn()
            end.record()
            end.synchronize()
            row[f"{name}_GB_per_s"] = 5 * m * expert_bytes / (start.elapsed_time(end) / 1e3) / 1e9
        rows.append(row)
    return rows


def run_cell(model: MoeCausalLM, batch: int, args: argparse.Namespace) -> dict[str, Any]:
    vocab = model.config.vocab_size
    per_seq = -(-(args.prompt + args.warmup + args.steps + 1) // 16) * 16
    pool = KvPool.for_model(model, capacity_tokens=batch * per_seq)
    seqs = [pool.new_sequence() for _ in range(batch)]
    prompts = [[(31 * b + 7 * i + 1) % vocab for i in range(args.prompt)] for b in range(batch)]
    t0 = time.perf_counter()
    logits = model.forward([SeqChunk(s, p, 0) for s, p in zip(seqs, prompts)])
    prefill_s = time.perf_counter() - t0

    def step() -> None:
        nonlocal logits
        ids = [int(lg[-1].argmax()) for lg in logits]
        logits = model.forward([SeqChunk(s, [t], s.num_tokens) for s, t in zip(seqs, ids)])

    t0 = time.perf_counter()
    for _ in range(args.warmup):
        step()
        if time.perf_counter() - t0 > args.cell_cap_s / 2:
            break
    sync(args.device)
    model.counters.reset()
    replays0 = model.graph_replays
    replay = LruReplay.start(model)  # the LRU planner's misses for exactly the routing this cell runs
    steps = 0
    t0 = time.perf_counter()
    while steps < args.steps:
        step()
        steps += 1
        if time.perf_counter() - t0 > args.cell_cap_s:
            break
    sync(args.device)
    decode_s = time.perf_counter() - t0
    for s in seqs:
        pool.free(s)
    total = model.counters.snapshot().total
    tokens = steps * batch
    lru = replay.finish(model, steps) if replay is not None else None
    return {
        **({} if lru is None else {"lru_misses_per_step": lru / steps}),
        "prefetched_per_step": total.prefetched / steps,
        "prefetch_used_per_step": total.prefetch_used / steps,
        "prefetch_accuracy": total.prefetch_used / total.prefetched if total.prefetched else None,
        "batch": batch,
        "steps": steps,
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "tok_per_s": tokens / decode_s,
        "ms_per_step": 1e3 * decode_s / steps,
        "ms_per_token": 1e3 * decode_s / tokens,
        "hit_rate": total.hit_rate,
        "misses_per_step": total.misses / steps,
        "misses_per_token": total.misses / tokens,
        "bytes_paged_per_token": total.bytes_paged_in / tokens,
        "bytes_h2d_per_token": total.bytes_h2d / tokens,
        "union_per_layer_step": total.union_sum / max(total.steps, 1),
        "waves_per_layer_step": total.waves / max(total.steps, 1),
        "copy_time_s": total.copy_time_s,
        "graphed_steps": model.graph_replays - replays0,
    }


class LruReplay:
    """The host LRU planner (`LayerResidency`, what the simulator runs) replayed over the routed ids
    a graphed paged cell recorded (`GraphedDecoder.trace`), from the device state the timed steps
    began with: the misses plain LRU paging takes for exactly this routing. It equals the runtime's
    own count without prefetch (checked per cell) and is the roofline's miss count with it."""

    def __init__(self, start: list[LayerResidency]) -> None:
        self.start = start

    @classmethod
    def start(cls, model: MoeCausalLM) -> LruReplay | None:
        graphs, states = model.decode_graphs, model.lru_states()
        if graphs is None or states is None or model.expert_planning != "device":
            return None
        graphs.trace = []
        return cls(states)

    def finish(self, model: MoeCausalLM, steps: int) -> int | None:
        graphs = model.decode_graphs
        assert graphs is not None and graphs.trace is not None
        trace, graphs.trace = graphs.trace, None
        if len(trace) != steps or not trace:  # some step ran eager: no exact replay
            return None
        ids = torch.stack(trace).to("cpu")  # [steps, layers, B, k]
        return sum(
            lr.plan_step(ids[s, i].reshape(-1).tolist()).misses
            for s in range(ids.shape[0])
            for i, lr in enumerate(self.start)
        )


def add_rooflines(cells: list[dict[str, Any]], link: dict[str, Any], expert_bytes: int, dense_bytes: int) -> None:
    link_bps = link.get("link_B_per_s")
    hbm_bps = link.get("hbm_copy_B_per_s")
    compute: dict[tuple[str, int], float] = {}  # best resident step time (any kernel, eager or graphed)
    for c in cells:
        if c["mode"] == "resident" and "ms_per_step" in c:
            key = (c["routing"], c["batch"])
            compute[key] = min(compute.get(key, float("inf")), c["ms_per_step"] / 1e3)
    for c in cells:
        if "ms_per_step" not in c:
            continue
        comp = compute.get((c["routing"], c["batch"]))
        # the LRU planner's misses for the routing the cell ran (the simulator's count); the
        # runtime's own count where no replay was possible (eager steps)
        misses = c.get("lru_misses_per_step", c.get("misses_per_step"))
        if comp is not None and link_bps and misses is not None:
            c["roofline_misses_source"] = "lru_replay" if "lru_misses_per_step" in c else "runtime_counters"
            link_s = misses * expert_bytes / link_bps
            c["roofline_link_step_s"] = link_s
            c["roofline_step_s"] = max(comp, link_s)
            c["roofline_fraction"] = c["roofline_step_s"] / (c["ms_per_step"] / 1e3)
            # A step that pages each layer's misses only once its router ran cannot overlap the two:
            # compute + link is its bound (no prediction); the rest of the measured step is overhead.
            c["serial_step_s"] = comp + link_s
            c["serial_fraction"] = c["serial_step_s"] / (c["ms_per_step"] / 1e3)
        if c["mode"] == "resident" and hbm_bps:
            touched = c["union_per_layer_step"] * c["layers"] * expert_bytes + dense_bytes
            c["hbm_bound_step_s"] = touched / hbm_bps
            c["hbm_bound_tok_per_s"] = c["batch"] / c["hbm_bound_step_s"]
            c["hbm_fraction"] = c["hbm_bound_step_s"] / (c["ms_per_step"] / 1e3)


def provenance() -> dict[str, Any]:
    from benchsuite.tools.machine import git_facts

    git = git_facts()
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {
        "git_commit": git.commit,
        "git_dirty": git.dirty,
        "git_tree": git.tree,  # names the code even where .git lags the files (see git_facts)
        "torch": torch.__version__,
        "gpu": gpu,
        "cpu_count": os.cpu_count(),
        "python": sys.version.split()[0],
    }


# Over 80 lines on purpose: one benchmark's flags, then its cells in the order they run; a reader
# follows one GPU call top to bottom here, and split helpers would only hand the same locals around.
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument(
        "--modes",
        default=DEFAULT_MODES,
        help="mode[/option+option], options: " + ", ".join(VARIANT_OPTIONS) + ", capN (copy_programs=N)",
    )
    ap.add_argument("--batches", default="1,4")
    ap.add_argument(
        "--routings", default="model,qwen3-30b-a3b", help="'model' and/or paged_experts.routing.sources specs"
    )
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--cell-cap-s", type=float, default=6.0, help="stop timing a cell after this many seconds")
    ap.add_argument("--graphs", default="1,2,3,4", help="batch sizes captured by '/graphs' variants")
    ap.add_argument(
        "--deadline-s", type=float, default=1e9, help="start no new mode after this many seconds from start"
    )
    ap.add_argument("--linkbw-json", default=None)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--copy-programs", type=int, default=None,
                    help="paged modes planned on the device: the page-in copy kernel's grid cap")  # fmt: skip
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--preset", default="qwen3-30b-a3b-shape", help="synth preset ('tiny' for a CPU smoke run)")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()  # --deadline-s counts from here (host store build included)
    if args.device == "cpu":
        torch.set_num_threads(os.cpu_count() or 1)
    preset = args.preset
    record: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "benchmark": "decode_h200",
        "command": ["python", "benchmarks/decode_h200.py", *(sys.argv[1:] if argv is None else argv)],
        "model": f"synth:{preset}?layers={args.layers}&seed={args.seed} (in-memory random bf16 weights)",
        # which weights the name meant: they changed under the same name (088c29a, 2121aa7), and with them the routing
        "source_weights": source_weights(f"synth:{preset}?layers={args.layers}&seed={args.seed}"),
        "provenance": provenance(),
        "cells": [],
    }
    cfg = synth_memory.config_for(synth_memory.SynthSpec(preset, args.layers, args.seed))
    # what a page-in moves per expert: block-FP8 rows (1 byte a weight and their scales) for an FP8 preset
    expert_bytes = cfg.shape.expert_bytes_fp8_block() if cfg.fp8_weights else cfg.expert_bytes("bfloat16")
    t0 = time.perf_counter()
    # the store the cells' models place (MoeCausalLM.synthetic: the preset's silent tokens): one store, not two
    silent = synth_memory.silent_ids(f"synth:{preset}")
    packed = resolve_expert_rows("auto", "paged", args.device) == "packed"  # the default cells' layout
    hw = synth_memory.host_weights(cfg, torch.bfloat16, args.seed, torch.device(args.device), silent, packed)
    record["host_store_build_s"] = time.perf_counter() - t0
    record["pinned"] = asdict(pinned.stats())  # how the store was page-locked (exact size or torch's rounding)
    print(f"host store built in {record['host_store_build_s']:.1f} s; pinned {record['pinned']}", flush=True)
    record["link"] = measure_link(args.device, expert_bytes, args.linkbw_json)
    print(json.dumps(record["link"]), flush=True)
    if args.device == "cuda":
        try:
            record["pagein_paths"] = measure_pagein_paths(hw.experts[0], expert_bytes)
        except Exception as exc:  # noqa: BLE001 - the decode cells still run
            record["pagein_paths"] = [{"error": repr(exc)}]
        print(json.dumps(record["pagein_paths"]), flush=True)
    h, v = cfg.hidden_size, cfg.vocab_size
    attn = h * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim + cfg.num_heads * cfg.head_dim * h
    dense_bytes = 2 * (cfg.num_layers * (attn + cfg.num_experts * h) + v * h)  # attention + routers + lm_head
    record["bytes"] = {"expert": expert_bytes, "dense_touched_per_step": dense_bytes}
    batches = [int(b) for b in args.batches.split(",")]
    graphs = [int(b) for b in args.graphs.split(",") if b]
    variants = [parse_variant(v) for v in args.modes.split(",") if v]

    def write() -> None:
        add_rooflines(record["cells"], record["link"], expert_bytes, dense_bytes)
        record["grouped_backend"] = grouped_backend()
        record["moe_triton_tiles"] = {name: asdict(c) for name, c in moe_tiles.CONFIGS.items()}
        args.out.write_text(json.dumps(record, indent=2, default=str))

    for mode, options in variants:
        kernel = "loop" if "loop" in options else "fused"
        graph = "graphs" if "graphs" in options else ""
        variant = "+".join(sorted(options)) or "default"
        ident = {"mode": mode, "variant": variant, "kernel": kernel, "graphs": graph}
        if time.perf_counter() - t_start > args.deadline_s:
            record["cells"].append({**ident, "error": "skipped: --deadline-s"})
            print(f"{mode}/{variant}: skipped (deadline)", flush=True)
            continue
        t_build = time.perf_counter()
        if args.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        try:
            rt = runtime_for(mode, args.device, options, variant_programs(options, args.copy_programs))
            model = MoeCausalLM.synthetic(preset, rt, layers=args.layers, seed=args.seed, expert_kernel=kernel)
            apply_plan_option(model, options)
            if graph:
                model.enable_cuda_graphs(graphs, compile_layers="compile" in options)
            sync(args.device)
        except Exception as exc:  # noqa: BLE001 - a failed mode is recorded, the rest still run
            record["cells"].append({**ident, "error": f"build: {exc!r}"})
            write()
            print(f"{mode}/{variant}: build failed: {exc!r}", flush=True)
            continue
        build_s = time.perf_counter() - t_build
        planning = model.expert_planning
        for routing in args.routings.split(","):
            if routing == "model":
                model.router_override = None
            else:
                from paged_experts.routing.sources import make_router

                model.router_override = make_router(routing, cfg, args.seed)
            for b in batches:
                base = {
                    **ident,
                    "routing": routing,
                    "layers": args.layers,
                    "build_s": build_s,
                    "planning": planning if mode.startswith("paged") else None,
                    "overlap_page_in": rt.overlap_page_in,
                    "overlap_copies": rt.overlap_copies,
                    "copy_programs": rt.copy_programs,
                    "prefetch_next_layer": rt.prefetch_next_layer,
                    "expert_backend": rt.kernel_backend,
                }
                try:
                    cell = {**base, **run_cell(model, b, args)}
                except Exception as exc:  # noqa: BLE001 - recorded as the cell's error
                    cell = {**base, "batch": b, "error": repr(exc)}
                if graph:
                    cell["captured_graphs"] = model.captured_graphs
                if args.device == "cuda":
                    cell["gpu_mem_peak_bytes"] = torch.cuda.max_memory_allocated()
                record["cells"].append(cell)
                write()
                keys = ("tok_per_s", "ms_per_step", "hit_rate", "misses_per_token", "steps", "error")
                brief = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in cell.items() if k in keys}
                print(f"{mode:14s} {variant:15s} {routing:14s} B={b}: {brief}", flush=True)
        del model
        gc.collect()  # the graphed decoder and the model reference each other: free 58 GB now, not later
        if args.device == "cuda":
            torch.cuda.empty_cache()
    write()
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
