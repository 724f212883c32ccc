"""benchmarks/decode_h200.py on the CPU (tiny model): it runs end to end as a process and records which
weights its model name meant (the same source-weights record a server of that name records), so two
files that name one synthetic model but ran different generators are told apart."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from paged_experts.weights.weights_id import source_weights

ROOT = Path(__file__).resolve().parents[1]


def test_decode_benchmark_runs_on_the_cpu_and_records_its_weights(tmp_path: Path) -> None:
    out = tmp_path / "decode.json"
    argv = [sys.executable, str(ROOT / "benchmarks" / "decode_h200.py"), "--out", str(out), "--device", "cpu",
            "--preset", "tiny", "--layers", "2", "--seed", "3", "--modes", "resident,paged:8/graphs+prefetch",
            "--batches", "1", "--routings", "model", "--prompt", "4", "--warmup", "1", "--steps", "3",
            "--graphs", "1"]  # fmt: skip
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
    assert record["source_weights"] == source_weights("synth:tiny?layers=2&seed=3")
    assert record["source_weights"]["id"] != source_weights("synth:tiny?layers=2&seed=0")["id"]
    resident, paged = record["cells"]
    assert "error" not in resident and "error" not in paged
    assert resident["hit_rate"] == 1.0 and resident["steps"] == paged["steps"] == 3
    assert 0 <= paged["prefetch_used_per_step"] <= paged["prefetched_per_step"]
    assert paged["prefetch_accuracy"] is None or 0 <= paged["prefetch_accuracy"] <= 1
