"""What device memory a paged layer's slot table really costs: 48 buffers of K packed FP8 expert rows each (one per
layer, as `to_device_rows` allocated them before `SlotArena`), for several K, by the driver's free-memory count
(mem_get_info) against the bytes asked for and torch's reserved count, and the same bytes as ONE buffer (the arena's
allocation). Written to test whether a paged server's ~1.9 GB peak step from K=55 to K=57 (h100-headline-g), where
each table crosses 256 MiB, was the driver's rounding; run it twice, once with
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True. Measured (one H100, 2026-12-06, h100-capcopy): no step, 48 tables
20-92 MiB over at every K (torch's caching allocator rounding each to 2 MiB), one buffer 0-2 (default allocator).

    python3 benchmarks/alloc_probe.py [--pitch 4720128] [--layers 48] [--ks 54,55,56,57,58,64]
"""

from __future__ import annotations

import argparse
import os

import torch

MIB = 2**20


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pitch", type=int, default=4_720_128, help="bytes a packed expert row (the 48-layer FP8 shape's)")
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--ks", default="54,55,56,57,58,64")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("alloc_probe.py: needs a CUDA device (it measures the driver's allocations)")
    print(f"{torch.cuda.get_device_name()}; PYTORCH_CUDA_ALLOC_CONF={os.environ.get('PYTORCH_CUDA_ALLOC_CONF', '')!r}")
    warm = torch.empty(args.pitch, dtype=torch.uint8, device="cuda")  # the allocator's one-time costs, outside the rows
    del warm
    print(" K  table MiB  asked MiB  device used MiB  reserved MiB  used - asked MiB  one buffer: used - asked MiB")
    for k in (int(v) for v in args.ks.split(",")):
        torch.cuda.empty_cache()
        free_before, _ = torch.cuda.mem_get_info()
        tables = [torch.empty(k * args.pitch, dtype=torch.uint8, device="cuda") for _ in range(args.layers)]
        torch.cuda.synchronize()
        free_after, _ = torch.cuda.mem_get_info()
        used, asked = free_before - free_after, args.layers * k * args.pitch
        reserved = torch.cuda.memory_reserved()
        del tables
        torch.cuda.empty_cache()
        free_before, _ = torch.cuda.mem_get_info()
        one = torch.empty(asked, dtype=torch.uint8, device="cuda")  # every layer's table in one allocation
        torch.cuda.synchronize()
        one_used = free_before - torch.cuda.mem_get_info()[0]
        del one
        print(f"{k:2d} {k * args.pitch / MIB:10.2f} {asked / MIB:10.0f} {used / MIB:16.0f} {reserved / MIB:13.0f} "
              f"{(used - asked) / MIB:17.0f} {(one_used - asked) / MIB:29.0f}", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
