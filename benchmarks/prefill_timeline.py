"""Where the link idles at a paged prefill's layer boundary, from a torch.profiler Chrome trace of
`profile_step.py --prefill-tokens N --trace-dir DIR` (model routing: the planner reads each layer's routed
ids once, a device-to-host copy to pageable memory that the host waits for).

Per layer-step, from the last page-in of the layer before to the first page-in of this one (the link's
idle time before the layer, the `/metrics` `prefill_idle_before_layer` of a server), in four parts:

- `device_ms`: the previous page-in's end -> the ids' copy to the host ends (the tail wave, attention and
  the router on the device; `device_gap_ms` of it the compute stream ran nothing: it waited for the host);
- `read_ms`: the ids' copy ends -> the host's call returns (the synchronization's latency);
- `host_ms`: the host's call returns -> the host issues the layer's first page-in (plan, layout, launches);
- `wait_ms`: issued -> the copy starts on the device (it waited for the wave that last read its slot).

The four parts add up to the idle time when the link's last work before the layer ended before the ids' read
(with staging rows it can run past it: `device_ms` is then negative). Page-ins are the pinned host-to-device DMAs
of the page-in stream: a trace of `page_in: kernel` (a copy kernel
reads the host rows) has none, and gives no rows. The page-in before a layer's first may be a small upload of
the previous layer's copies (a scale kernel's row index): its end, not an expert's, then starts the idle time.

    python benchmarks/prefill_timeline.py traces/paged49.json.gz
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
from collections import Counter
from pathlib import Path
from typing import Any

Event = dict[str, Any]

PAGE_IN = "Memcpy HtoD (Pinned -> Device)"
PARTS = ("idle_ms", "device_ms", "device_gap_ms", "read_ms", "host_ms", "wait_ms")


def _end(e: Event) -> float:
    return float(e["ts"]) + float(e.get("dur", 0.0))


def _correlation(e: Event) -> Any:
    return (e.get("args") or {}).get("correlation")


def layer_boundaries(trace: dict) -> list[dict[str, float]]:
    """One row per layer-step whose ids were read (every field in ms, PARTS); [] without such reads.
    The ids' reads are the device-to-host copies of the most common size; page-ins are the pinned host-to-device
    copies on other streams than the reads' (the compute stream's pinned uploads, such as the waves' layout, are
    not); a layer's first page-in is the first to start after its read, the previous one the last to end before
    that start."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "ts" in e]
    reads = [e for e in events if e.get("cat") == "gpu_memcpy" and "DtoH" in str(e.get("name"))]
    if not reads:
        return []
    size, _ = Counter((e.get("args") or {}).get("bytes") for e in reads).most_common(1)[0]
    reads = sorted((e for e in reads if (e.get("args") or {}).get("bytes") == size), key=lambda e: float(e["ts"]))
    read_stream = reads[0].get("tid")
    # page-ins run on their own stream; a pinned upload on the compute stream (the waves' layout) is not one
    page_ins = sorted(
        (e for e in events if e.get("name") == PAGE_IN and e.get("tid") != read_stream), key=lambda e: float(e["ts"])
    )
    if not page_ins:
        return []
    calls = ("cuda_runtime", "cuda_driver")  # Triton launches are driver calls
    runtime = {_correlation(e): e for e in events if e.get("cat") in calls and _correlation(e) is not None}
    host_calls = sorted((e for e in events if e.get("cat") == "cuda_runtime"), key=lambda e: float(e["ts"]))
    issued_at = {id(c): float(runtime[_correlation(c)]["ts"]) for c in page_ins if _correlation(c) in runtime}
    # the compute stream's own work: kernels, and its copies and memsets (the read itself among them)
    work = ("kernel", "gpu_memcpy", "gpu_memset")
    compute = sorted(
        (e for e in events if e.get("cat") in work and e.get("tid") == read_stream), key=lambda e: float(e["ts"])
    )
    rows = []
    for read in reads:
        call = runtime.get(_correlation(read))
        if call is None:
            continue
        # the host's return: the end of the read's own call, or of a synchronization of that thread right after it
        returned = _end(call)
        for e in host_calls:
            near = 0 <= float(e["ts"]) - returned < 50 and e.get("tid") == call.get("tid")
            if near and "Synchronize" in str(e.get("name")):
                returned = _end(e)
                break
        # the layer's first page-in: issued after the host had the ids (a copy issued before, e.g. a staging
        # row's, is not this layer's planning) and running after the read
        first = next(
            (c for c in page_ins if float(c["ts"]) >= _end(read) and issued_at.get(id(c), -1.0) >= returned), None
        )
        before = [c for c in page_ins if _end(c) <= float(first["ts"])] if first is not None else []
        issued = runtime.get(_correlation(first)) if first else None
        if first is None or not before or issued is None:
            continue
        prev_end = max(_end(c) for c in before)
        busy = sum(
            min(_end(k), _end(read)) - max(float(k["ts"]), prev_end)
            for k in compute
            if _end(k) > prev_end and float(k["ts"]) < _end(read)
        )
        device = _end(read) - prev_end
        row = {
            "idle_ms": float(first["ts"]) - prev_end,
            "device_ms": device,
            "device_gap_ms": max(0.0, device - busy),
            "read_ms": returned - _end(read),
            "host_ms": float(issued["ts"]) - returned,
            "wait_ms": float(first["ts"]) - float(issued["ts"]),
        }
        rows.append({k: v / 1e3 for k, v in row.items()})
    return rows


def summary(rows: list[dict[str, float]]) -> str:
    """The medians of PARTS over the rows, and how many rows are over twice the median idle time: a step's first
    layer, whose boundary holds the previous step's tail (the trace marks no steps, so they are counted, not
    dropped)."""
    if not rows:
        return "  layer boundaries: no ids read and page-ins in the trace"
    med = ", ".join(f"{p} {statistics.median(r[p] for r in rows):.3f}" for p in PARTS)
    idle = statistics.median(r["idle_ms"] for r in rows)
    long = [r["idle_ms"] for r in rows if r["idle_ms"] > 2 * idle]
    tail = f"; {len(long)} over twice the median idle ({', '.join(f'{v:.2f}' for v in long)} ms)" if long else ""
    return f"  layer boundaries ({len(rows)}): medians {med}{tail}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("traces", type=Path, nargs="+", help="Chrome traces (.json or .json.gz)")
    ap.add_argument("--rows", action="store_true", help="also every layer-step's row")
    args = ap.parse_args(argv)
    for path in args.traces:
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt") as f:
            rows = layer_boundaries(json.load(f))
        print(f"{path}:\n{summary(rows)}")
        for r in rows if args.rows else []:
            print("   " + ", ".join(f"{k} {v:.3f}" for k, v in r.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
