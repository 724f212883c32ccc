"""benchmarks/copy_overlap.py on a GPU, at Qwen3-30B-A3B's expert shape (its tuned FP8 tiles) with 24 experts: every
arm's copy replayed from its CUDA graph lands its rows and touches no other slot (the script checks after the warm-up
and after the last timed run, the rows cleared before it), the compute's graph replays beside it on a second stream,
and every row carries its figures, none an error. A graph keeps no reference to the tensors it reads: this is where
a replay reading freed memory would show.

Plain functions, so the module also runs as a script: `python tests/cuda/test_copy_overlap_cuda.py`.
"""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

import torch
from _script import load_benchmark  # tests/cuda is on sys.path (pytest's rootdir import, or script mode)

try:
    import pytest

    pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
except ImportError:  # script mode
    pass


def test_every_copy_arm_lands_its_rows_from_its_graph_beside_the_compute() -> None:
    bench = load_benchmark("copy_overlap")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "co.json"
        # fmt: off
        status = bench.main([
            "--out", str(out), "--experts", "24", "--slots", "16", "--m", "2,5", "--tokens", "4", "--programs", "2,8",
            "--wide", "2", "--repeats", "3", "--warmup", "1",
        ])
        # fmt: on
        record = json.loads(out.read_text())
    errors = [(r["copy"], r["m"], r.get("error")) for r in record["rows"] if "error" in r]
    assert status == 0 and not errors, errors
    assert [(r["copy"], r["m"]) for r in record["rows"]] == [
        (c, m) for m in (2, 5) for c in ("dma", "kernel", "kernel:2", "kernel:8", "wide:2", "proxy")
    ]  # `proxy` (the DMA proxy's thread, 8557e5c) last: this list missed it until 2026-12-06's whole-suite run
    assert record["concurrent"] is True
    for r in record["rows"]:
        assert r["copy_gbps"] > 0 and r["compute_ms"] > 0
        for order in ("copy_first", "compute_first"):
            both = r[order]
            assert both["span_ms"] > 0 and math.isfinite(both["hidden"])
            # the span is the later end: neither side can end after it
            assert both["span_ms"] >= max(both["copy_ms"], both["compute_ms"]) - 1e-9


if __name__ == "__main__":
    test_every_copy_arm_lands_its_rows_from_its_graph_beside_the_compute()
    print("ok")
