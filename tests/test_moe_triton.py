"""moe_triton's decode-sized grouped kernels against per-row matmuls, in the Triton interpreter
(TRITON_INTERPRET=1, CPU, fp32). Skipped where Triton is absent (the CPU torch wheel has none);
tests/cuda/test_device_paging_cuda.py runs them compiled, in bf16, on a GPU.

Triton reads TRITON_INTERPRET when it is imported, so the checks run in a child interpreter
started with it set (this process may already hold a compiled Triton)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

CASES = ([0, 3, 0, 1, 0], [20, 0, 0, 0, 1], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1])


def reference(x: torch.Tensor, rows: torch.Tensor, gate, up, down) -> torch.Tensor:
    out = torch.empty_like(x)
    for p, r in enumerate(rows.tolist()):
        out[p] = (F.silu(x[p] @ gate[r].T) * (x[p] @ up[r].T)) @ down[r].T
    return out


def check_all_cases() -> None:
    from paged_experts import moe_triton

    torch.manual_seed(0)
    for counts in CASES:
        g, h, i = len(counts), 160, 48  # H spans two K blocks, I a partial N block, 20 pairs > BLOCK_M
        gate, up, down = torch.randn(g, i, h) / 8, torch.randn(g, i, h) / 8, torch.randn(g, h, i) / 8
        rows = torch.repeat_interleave(torch.arange(g), torch.tensor(counts))  # [P] sorted by row
        x = torch.randn(rows.numel(), h)
        offs = torch.cumsum(torch.tensor(counts), 0).to(torch.int32)
        got = moe_triton.expert_mlp(x, gate, up, down, offs)
        assert got.shape == x.shape
        if rows.numel():
            torch.testing.assert_close(got, reference(x, rows, gate, up, down), rtol=1e-4, atol=1e-4)
        print("ok", counts)


def test_grouped_rows_match_per_row_matmuls_in_the_interpreter() -> None:
    code = "import sys; sys.path.insert(0, sys.argv[1]); import test_moe_triton as t; t.check_all_cases()"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, "-c", code, os.path.dirname(__file__)], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert done.stdout.count("ok ") == len(CASES)
