"""What device memory a paged model holds once built, as the built-in server builds it (synthetic weights generated
on the device, then placed), before any step: torch's allocated and reserved bytes and the driver's used bytes, then
the same after an empty_cache (what the first graph capture does). One fresh process a cell, so every build starts
from the generator's own blocks. Arms: `trim` (today: the generator's cached blocks returned before placement,
`synth_memory.release_generation_blocks`) and `keep` (that call made a no-op: the blocks stay cached, as before).

Written for the ~1.9 GB step in a paged server's peak between K=55 and 57 (h100-headline-g, per-layer slot tables):
a replay of the generator's allocations through a model of torch's caching allocator put it in the tables landing in
the generator's cached 512 and 768 MiB blocks, which fit three (or two) tables up to K=56 and fewer at K=57, and put
~0.35 GB of partly used segments at every K after SlotArena. `reserved_after_empty_cache - allocated` is that hole.

    PYTHONPATH=$PWD python3 benchmarks/build_memory.py [--ks 54,55,56,57] [--arms keep,trim] [--out build_memory.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_h200 import provenance  # noqa: E402

GB = 1e9
PRESET, LAYERS = "qwen3-30b-a3b-fp8-shape", 48


def cell(k: int, arm: str, preset: str, layers: int) -> dict[str, Any]:
    """Builds one paged model in this process and reads its memory (the child's work)."""
    import torch

    from paged_experts.model import MoeCausalLM
    from paged_experts.runtime import RuntimeConfig
    from paged_experts.weights import synth_memory

    if arm == "keep":
        synth_memory.release_generation_blocks = lambda: None  # the generator's blocks stay cached, as before
    runtime = RuntimeConfig(mode="paged", resident_experts=k, device="cuda", dtype="bfloat16")
    model = MoeCausalLM.synthetic(preset, runtime, layers=layers)
    torch.cuda.synchronize()

    def read() -> dict[str, int]:
        free, total = torch.cuda.mem_get_info()
        return {
            "allocated_bytes": torch.cuda.memory_allocated(),
            "reserved_bytes": torch.cuda.memory_reserved(),
            "device_used_bytes": total - free,
        }

    built = read()
    torch.cuda.empty_cache()  # what torch.cuda.graph's __enter__ does before the first capture
    after = read()
    del model
    return {
        "k": k,
        "arm": arm,
        "built": built,
        "after_empty_cache": after,
        "hole_bytes": after["reserved_bytes"] - after["allocated_bytes"],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ks", default="54,55,56,57")
    ap.add_argument("--arms", default="keep,trim", help="comma-separated: keep, trim")
    ap.add_argument("--preset", default=PRESET)
    ap.add_argument("--layers", type=int, default=LAYERS)
    ap.add_argument("--out", default="build_memory.json")
    ap.add_argument("--cell-timeout-s", type=float, default=240.0, help="one build's limit (a 48-layer build: ~40 s)")
    ap.add_argument("--cell", help=argparse.SUPPRESS)  # K:ARM, run in a child process
    args = ap.parse_args(argv)
    if args.cell:
        k, arm = args.cell.split(":")
        print(json.dumps(cell(int(k), arm, args.preset, args.layers)))
        return 0
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("build_memory.py: needs a CUDA device (it reads the device's allocations)")
    arms = [a for a in args.arms.split(",") if a]
    bad = [a for a in arms if a not in ("keep", "trim")]
    if bad:
        raise SystemExit(f"build_memory.py: --arms takes keep and trim, got {bad}")
    cells: list[dict[str, Any]] = []
    record = {
        "benchmark": "build_memory",
        "argv": sys.argv,
        "preset": args.preset,
        "layers": args.layers,
        "provenance": provenance(),
        "cells": cells,
    }
    print(" K  arm   allocated GB  reserved GB  used GB | after empty_cache: reserved GB  used GB  hole GB")
    for k in (int(v) for v in args.ks.split(",")):
        for arm in arms:
            cmd = [sys.executable, __file__, "--cell", f"{k}:{arm}", "--preset", args.preset]
            try:
                done = subprocess.run(
                    [*cmd, "--layers", str(args.layers)], capture_output=True, text=True, check=False,
                    timeout=args.cell_timeout_s,
                )  # fmt: skip
            except subprocess.TimeoutExpired:
                print(f"{k:>2}  {arm}: no result within {args.cell_timeout_s} s")
                cells.append({"k": k, "arm": arm, "error": f"timeout {args.cell_timeout_s} s"})
                Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
                continue
            if done.returncode != 0:
                print(f"{k:>2}  {arm}: failed ({done.returncode}): {done.stderr.strip().splitlines()[-1:]}")
                cells.append({"k": k, "arm": arm, "error": done.stderr[-2000:]})
                Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
                continue
            c = json.loads(done.stdout.strip().splitlines()[-1])
            cells.append(c)
            b, a = c["built"], c["after_empty_cache"]
            print(
                f"{k:>2}  {arm:<4}  {b['allocated_bytes'] / GB:12.3f}  {b['reserved_bytes'] / GB:11.3f}  "
                f"{b['device_used_bytes'] / GB:7.3f} | {a['reserved_bytes'] / GB:29.3f}  "
                f"{a['device_used_bytes'] / GB:7.3f}  {c['hole_bytes'] / GB:7.3f}",
                flush=True,
            )
            Path(args.out).write_text(json.dumps(record, indent=2) + "\n")  # after every cell: a cut call keeps them
    return 0 if all("error" not in c for c in cells) else 1


if __name__ == "__main__":
    raise SystemExit(main())
