"""The runner's memory sampler alone, as a process: reads NVML's compute-process list every `--interval-s` (the
sampler's SAMPLE_INTERVAL_S by default) from the moment it prints `ready` until its stdin closes, then prints one
JSON line: how many reads it made and how long they took. Why: the sampler runs beside every cell, in the runner's
process, on the GPU the server uses (device_memory.sampler_record says why its reads are timed); this runs the
same reads beside an in-process benchmark (benchmarks/prefill_h200.py --nvml-sampler ab), so a prompt with the
reads can be set against one without them on one machine.

    python -m benchsuite.tools.nvml_load [--interval-s 0.15] [--scripted-read-s S]

`--scripted-read-s` replaces NVML by a read that sleeps S seconds (no GPU needed: the harness's own test).
Exit 2, with a one-line JSON error, where there is no NVML to read.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time

from benchsuite.tools import device_memory


class _Scripted:
    """A read that takes `read_s` (the harness without a GPU)."""

    def __init__(self, read_s: float) -> None:
        self.read_s = read_s

    def read(self) -> device_memory.DeviceSnapshot:
        time.sleep(self.read_s)
        return device_memory.DeviceSnapshot({}, 0)

    def close(self) -> None:
        pass


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--interval-s", type=float, default=device_memory.SAMPLE_INTERVAL_S)
    ap.add_argument("--scripted-read-s", type=float, default=None, help="a read that sleeps this long, not NVML")
    args = ap.parse_args(argv)
    reader = _Scripted(args.scripted_read_s) if args.scripted_read_s is not None else device_memory.open_reader()
    if reader is None:
        print(json.dumps({"error": f"no NVML to read ({device_memory.NVML_LIBRARY} or a GPU missing)"}), flush=True)
        return 2
    stop = threading.Event()

    def wait_for_eof() -> None:
        sys.stdin.read()  # the caller closes our stdin to stop us (also when it dies)
        stop.set()

    threading.Thread(target=wait_for_eof, daemon=True).start()
    print("ready", flush=True)
    seconds: list[float] = []
    try:
        while not stop.is_set():
            started_s = time.perf_counter()
            try:
                reader.read()
            except device_memory.NvmlError:
                pass  # a failed read took its time too
            seconds.append(time.perf_counter() - started_s)
            stop.wait(args.interval_s)
    finally:
        reader.close()
    ordered = sorted(seconds)
    print(json.dumps({
        "interval_s": args.interval_s, "reads": len(ordered),
        "read_ms_median": statistics.median(ordered) * 1e3 if ordered else None,
        "read_ms_max": ordered[-1] * 1e3 if ordered else None, "read_s_total": sum(ordered),
    }), flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
