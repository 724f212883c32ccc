"""benchmarks/prefill_h200.py on the CPU (tiny model): it runs end to end as a process, writes one record
per cell with its provenance, and its table; no link figure without CUDA, so no floor (never a 0)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from paged_experts.weights.weights_id import source_weights

ROOT = Path(__file__).resolve().parents[1]


def test_prefill_benchmark_runs_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "prefill.json"
    argv = [sys.executable, str(ROOT / "benchmarks" / "prefill_h200.py"), "--out", str(out), "--preset", "tiny",
            "--layers", "2", "--device", "cpu", "--dtype", "float32", "--ks", "6", "--routings", "qwen3-30b-a3b",
            "--prompt", "200", "--repeats", "1", "--decode", "3"]  # fmt: skip
    proc = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    record = json.loads(out.read_text())
    assert record["provenance"]["git_commit"] and record["link"]["error"].startswith("no CUDA device")
    assert record["source_weights"] == source_weights("synth:tiny?layers=2&seed=0")  # what a server of it records
    names = [c["cell"] for c in record["cells"]]
    assert names == ["resident/qwen3-30b-a3b", "paged:6/qwen3-30b-a3b/recent/streamed",
                     "paged:6/qwen3-30b-a3b/lru/streamed", "paged:6/qwen3-30b-a3b/recent/serial"]  # fmt: skip
    for cell in record["cells"]:
        assert "error" not in cell, cell
        assert cell["prefill_s"] > 0 and cell["floor_s"] is None and cell["router_s"] > 0
    paged = record["cells"][1]
    assert paged["prefill_bytes"] > 0 and paged["waves_per_layer"] > 1 and 0 <= paged["decode_hit_rate"] <= 1
    assert "paged:6/qwen3-30b-a3b/lru/streamed" in (out.with_suffix(".txt")).read_text()
