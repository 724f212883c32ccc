"""The `bench` step of llamacpp_h200.py: llama.cpp decode tok/s per --n-cpu-moe N, batch 1 and 4.

One `llama-batched-bench` process per configuration (one model load) runs
    -c CTX -kvu -npp P -ntg G -npl 1,4,1,4 -ngl 99 --n-cpu-moe N -t T --output-format jsonl -lv 4
Each batch size runs twice; the first row is warmup (CUDA graph capture, first touch of mmap'd
CPU experts) and is discarded. Per cell:
    tok_per_s = B x G / t_tg   (batched-bench's S_TG: decode tokens of all B sequences per second
                                of the G decode steps, prompt excluded)
    gpu_mem_bytes = sum of llama.cpp's CUDA* model + KV + compute + output buffers (its load log)
The fit cell runs llama.cpp's own fitting: `llama-fit-params -c CTX -np 4 --fit-target M` with M
= free MiB of GPU 0 - budget MiB + 1024 MiB, so it packs the model into (budget - llama.cpp's
default 1024 MiB margin), as on a GPU of that size; the budget is decimal GB like the matrix's
`vram_budget_gb`. The fitted `-ngl` and `-ot` patterns run unchanged (llama.cpp fills full layers
front to back, so its host experts are the LAST layers, possibly one partially); its N is the
number of layers with expert tensors on the host.

DIR/llamacpp_h200.json is rewritten after every cell, so a timeout loses nothing:
  {"schema_version": 1, "benchmark": "llamacpp_h200", "command": [...],
   "provenance": {git_commit, git_dirty, gpu, cpu_count, llama_cpp_python_version,
                  llama_version_text, build_flags, build_s, threads, ...},
   "gguf": {path, bytes, layers, expert_type, expert_bytes, write_s, seed},
   "fit": {budget_gb, n_cpu_moe, command, output_tail, ...} or null,
   "cells": [{n_cpu_moe, label, batch, tok_per_s, gpu_mem_bytes, prompt_tokens, gen_tokens,
              command, raw, error?}]}
and DIR/llamacpp_h200.txt gets one line per step.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import llamacpp_h200_cells as cells

from benchsuite.engines.llamacpp.build import (
    LLAMA_CPP_PYTHON_VERSION,
    binary_version,
    install_dir,
    read_stamp,
)

SCHEMA_VERSION = 1
MIB = 2**20
GB = 10**9
LLAMA_DEFAULT_MARGIN_MIB = 1024
MIN_CONFIG_S = 30.0  # no launch with less time than this left before the deadline


def run_process(argv: list[str], timeout_s: float) -> tuple[int | None, str, float]:
    """(exit status or None on timeout, stdout+stderr, seconds); the process group dies on timeout."""
    started = time.perf_counter()
    try:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                errors="replace", start_new_session=True)  # fmt: skip
    except OSError as exc:
        return 127, f"cannot start {argv[0]}: {exc}", 0.0
    try:
        out, _ = proc.communicate(timeout=max(1.0, timeout_s))
        return proc.returncode, out, time.perf_counter() - started
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return (None, f"{out}\n[timed out after {timeout_s:.0f} s]", time.perf_counter() - started)


def gpu_free_mib() -> int | None:
    argv = ["nvidia-smi", "--query-gpu=memory.free", "--format=csv,noheader,nounits", "-i", "0"]
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=True)
        return int(p.stdout.split()[0])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def physical_cores() -> int:
    """Physical cores among the CPUs this process may use (what llama.cpp's default -t counts)."""
    cpus = sorted(os.sched_getaffinity(0))
    cores = set()
    for c in cpus:
        topo = Path(f"/sys/devices/system/cpu/cpu{c}/topology")
        try:
            cores.add(((topo / "physical_package_id").read_text(), (topo / "core_id").read_text()))
        except OSError:
            return len(cpus)
    return len(cores) or len(cpus)


def run_fit(spec: argparse.Namespace, shape: cells.Shape, bin_dir: Path) -> tuple[dict[str, Any], cells.Config | None]:
    """llama-fit-params for a GPU of --fit-budget-gb: (the record's "fit", the cell's config)."""
    free = gpu_free_mib()
    budget_mib = int(spec.fit_budget_gb * GB / MIB)
    target = LLAMA_DEFAULT_MARGIN_MIB if free is None else max(0, free - budget_mib + LLAMA_DEFAULT_MARGIN_MIB)
    argv = cells.fit_argv(bin_dir, spec.gguf, shape, target)
    rc, out, seconds = run_process(argv, spec.fit_timeout_s)
    # The fit's reasoning and its answer, not the loader's tensor dump.
    tail = [line for line in out.splitlines() if "fit" in line or "memory" in line or line.startswith("-c ")]
    fit: dict[str, Any] = {
        "budget_gb": spec.fit_budget_gb, "n_cpu_moe": None, "command": argv, "output_tail": "\n".join(tail[-40:]),
        "gpu_free_mib": free, "fit_target_mib": target, "rc": rc, "seconds": round(seconds, 2),
    }  # fmt: skip
    if rc != 0:
        fit["error"] = f"llama-fit-params exit status {rc}"
        return fit, None
    fitted = cells.parse_fit_args(out, gguf_facts(spec.gguf).get("layers"))
    cfg = cells.fit_config(fitted, spec.fit_budget_gb, spec.ngl, use_fit_ngl=not spec.cpu)
    fit |= {"n_cpu_moe": cfg.n_cpu_moe, "ngl": fitted.ngl, "overrides": list(fitted.overrides),
            "host_layers": list(fitted.host_layers), "partial_layers": list(fitted.partial_layers)}  # fmt: skip
    return fit, cfg


def provenance(spec: argparse.Namespace, bin_dir: Path, build: dict[str, Any]) -> dict[str, Any]:
    git: dict[str, Any] = {}
    gpus: list[dict[str, Any]] = []
    try:  # machine.py needs psutil; its absence must not cost the measurement
        from benchsuite.machine import git_facts, gpu_facts

        git, gpus = git_facts(), gpu_facts()
    except ImportError:
        pass
    return {
        "git_commit": git.get("commit"), "git_dirty": git.get("dirty"), "gpu": gpus[0] if gpus else None,
        "cpu_count": os.cpu_count(), "cpu_affinity": len(os.sched_getaffinity(0)), "threads": spec.threads,
        "llama_cpp_python_version": LLAMA_CPP_PYTHON_VERSION,
        "llama_version_text": binary_version(bin_dir / "llama-batched-bench"),
        "build_flags": build.get("flags") or read_stamp(bin_dir), "build_s": build.get("build_s"),
        "build": {k: v for k, v in build.items() if k not in ("flags", "log_tail")}, "bin_dir": str(bin_dir),
    }  # fmt: skip


def gguf_facts(path: Path) -> dict[str, Any]:
    """What `llamacpp_h200.py gguf` recorded next to the file, else only its path and size."""
    side = path.with_name(path.name + ".json")
    size = path.stat().st_size if path.is_file() else None
    if side.is_file():
        return json.loads(side.read_text()) | {"path": str(path), "bytes": size}
    unknown = dict.fromkeys(("layers", "expert_type", "expert_bytes", "write_s", "seed"))
    return {"path": str(path), "bytes": size, **unknown}


def resolve_binaries(spec: argparse.Namespace) -> tuple[Path, dict[str, Any]]:
    """(bin dir, build record) from --bin-dir, --cpu (the CPU build cache) or --build (waits)."""
    if spec.bin_dir:
        return Path(spec.bin_dir), {}
    if spec.cpu and not spec.build:
        return install_dir(cuda=False) / "bin", {}
    build_dir = Path(spec.build)
    status = build_dir / "build.json"
    until = time.monotonic() + spec.wait_build_s
    if not status.is_file() and (build_dir / "build.started").is_file():
        print(f"waiting up to {spec.wait_build_s:.0f} s for the build in {build_dir}", file=sys.stderr, flush=True)
        while not status.is_file() and time.monotonic() < until:
            time.sleep(5)
    if not status.is_file():
        raise SystemExit(f"{status} missing: run `llamacpp_h200.py build --out {build_dir}` first")
    build = json.loads(status.read_text())
    if build.get("status") != "ok":
        raise SystemExit(f"the build in {build_dir} failed: {build.get('error')}")
    return Path(build["bin_dir"]), build


class Recorder:
    """The result JSON, rewritten atomically after every change, and the short text log."""

    def __init__(self, out_dir: Path, record: dict[str, Any]) -> None:
        out_dir.mkdir(parents=True, exist_ok=True)
        self.path = out_dir / "llamacpp_h200.json"
        self.text_path = out_dir / "llamacpp_h200.txt"
        self.record = record
        self.save()

    def save(self) -> None:
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text(json.dumps(self.record, indent=1) + "\n")
        os.replace(tmp, self.path)

    def say(self, line: str) -> None:
        print(line, flush=True)
        with open(self.text_path, "a") as f:
            f.write(f"{time.strftime('%H:%M:%S')} {line}\n")

    def add_cells(self, new: list[dict[str, Any]]) -> None:
        self.record["cells"].extend(new)
        self.save()
        for c in new:
            mem = f"{c['gpu_mem_bytes'] / GB:.2f} GB GPU" if c["gpu_mem_bytes"] else "no GPU buffers"
            res = f"{c['tok_per_s']:.2f} tok/s" if c["tok_per_s"] is not None else f"ERROR {c['error'].splitlines()[0]}"
            self.say(f"{c['label']:>22} batch {c['batch']}: {res}; {mem}")


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="llamacpp_h200.py bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", required=True, type=Path)
    ap.add_argument("--out", required=True, type=Path, help="directory for llamacpp_h200.json / .txt")
    where = ap.add_mutually_exclusive_group()
    where.add_argument("--build", help="the `build --out` directory (waits for a running build)")
    where.add_argument("--bin-dir", help="a directory holding llama-batched-bench and llama-fit-params")
    ap.add_argument("--cpu", action="store_true", help="no GPU: -ngl 0 (and the cached CPU build by default)")
    ap.add_argument("--n-cpu-moe", default="0,12,24,48", help="comma-separated N")
    ap.add_argument("--fit-budget-gb", type=float, default=16.0, help="decimal GB; 0 = no fit cell")
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--gen-tokens", type=int, default=32)
    ap.add_argument("--ctx", type=int, default=1024, help="-c: KV cells shared by the sequences (-kvu)")
    ap.add_argument("--threads", type=int, default=None, help="-t (default: physical cores)")
    ap.add_argument("--ngl", type=int, default=99)
    ap.add_argument("--cell-timeout-s", type=float, default=240.0, help="per llama-batched-bench process")
    ap.add_argument("--fit-timeout-s", type=float, default=120.0)
    ap.add_argument("--deadline-s", type=float, default=None, help="no launch that could end after this")
    ap.add_argument("--wait-build-s", type=float, default=600.0)
    ap.add_argument("--extra", default="", help="llama.cpp args for every process, e.g. '--load-mode none'")
    spec = ap.parse_args(argv)
    spec.threads = spec.threads or physical_cores()
    if spec.cpu:
        spec.ngl = 0
    return spec


def shape_of(spec: argparse.Namespace) -> cells.Shape:
    batches = tuple(int(x) for x in spec.batches.split(",") if x.strip())
    return cells.Shape(spec.ctx, spec.prompt_tokens, spec.gen_tokens, batches, spec.threads, tuple(spec.extra.split()))


def bench_main(argv: list[str], command: list[str] | None = None) -> int:
    started = time.monotonic()
    spec = parse_args(argv)
    shape = shape_of(spec)
    bin_dir, build = resolve_binaries(spec)
    rec = Recorder(spec.out, {
        "schema_version": SCHEMA_VERSION, "benchmark": "llamacpp_h200", "command": command or [sys.argv[0], *argv],
        "provenance": provenance(spec, bin_dir, build), "gguf": gguf_facts(spec.gguf), "fit": None, "cells": [],
    })  # fmt: skip
    version = (rec.record["provenance"]["llama_version_text"] or "?").splitlines()[0]
    rec.say(f"llama.cpp {version}; {bin_dir}; gguf {spec.gguf}; -t {spec.threads}")
    configs = [cells.n_cpu_moe_config(int(n), spec.ngl) for n in spec.n_cpu_moe.split(",") if n.strip()]
    if spec.fit_budget_gb > 0:
        fit, fit_cfg = run_fit(spec, shape, bin_dir)
        rec.record["fit"] = fit
        rec.save()
        error = f" ERROR {fit['error']}" if "error" in fit else ""
        rec.say(f"fit {spec.fit_budget_gb:g} GB: N={fit['n_cpu_moe']} (--fit-target {fit['fit_target_mib']} MiB, "
                f"GPU free {fit['gpu_free_mib']} MiB){error}")  # fmt: skip
        if fit_cfg is not None:
            configs.insert(0, fit_cfg)  # the budget cell matters most: it runs first
    longest_s = 0.0
    for cfg in configs:
        argv_cfg = cells.batched_argv(bin_dir, spec.gguf, shape, cfg)
        left_s = spec.deadline_s - (time.monotonic() - started) if spec.deadline_s else spec.cell_timeout_s
        if spec.deadline_s and left_s < max(MIN_CONFIG_S, longest_s):
            why = f"{left_s:.0f} s left before the deadline; the longest launch took {longest_s:.0f} s"
            rec.add_cells(cells.skipped_cells(cfg, shape, argv_cfg, why))
            continue
        rc, out, seconds = run_process(argv_cfg, min(spec.cell_timeout_s, left_s))
        longest_s = max(longest_s, seconds)
        measured = cells.cells_from_output(cfg, shape, argv_cfg, out, rc)
        rec.add_cells([c | {"process_s": round(seconds, 1)} for c in measured])
    rec.say(f"done in {time.monotonic() - started:.0f} s -> {rec.path}")
    return 0 if all(c.get("error") is None for c in rec.record["cells"]) else 1
