"""benchmarks/profile_step.py on the CPU (tiny model) as a process: decode steps and, with
--prefill-tokens, one fresh prompt per profiled step (paged above K / top_k tokens: the host-planned
waves), each variant's header and kernel table written."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_profile_step_runs_decode_and_prefill_on_the_cpu(tmp_path: Path) -> None:
    cases = (
        ([], "batch 1, the model's own routing"),
        (["--prefill-tokens", "40", "--host-profile", "5"], "one 40-token prompt, the model's own routing"),
        (["--routing", "qwen3-30b-a3b", "--prefill-tokens", "40"],
         "one 40-token prompt, routing qwen3-30b-a3b (synthetic)"),
        (["--routing", "qwen3-30b-a3b"], "batch 1, routing qwen3-30b-a3b (synthetic)"),
    )  # fmt: skip
    for extra, what in cases:
        out = tmp_path / "prof.txt"
        argv = [sys.executable, str(ROOT / "benchmarks" / "profile_step.py"), "--device", "cpu", "--preset", "tiny",
                "--layers", "2", "--variants", "resident,paged:8", "--steps", "2", "--rows", "5", "--out", str(out),
                *extra]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        proc = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=300, cwd=ROOT, env=env)
        assert proc.returncode == 0, proc.stderr[-2000:]
        text = out.read_text()
        for variant in ("resident", "paged:8"):
            assert f"=== {variant}: 2 layers, {what}," in text, text[:500]
        assert text.count("Self CPU time total") == 2
        if "--host-profile" in extra:  # each variant's host functions, by own time
            assert text.count("more steps under cProfile") == 2 and text.count("tottime") == 2, text[-1500:]
