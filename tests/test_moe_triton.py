"""moe_triton's decode kernels (routing; gate+up per pair; down with the top-k combine) against
plain torch, in the Triton interpreter (TRITON_INTERPRET=1, CPU, fp32). Skipped where Triton is
absent (the CPU torch wheel has none); tests/cuda/test_device_paging_cuda.py runs the same checks
compiled, in bf16, on a GPU (`check_kernels(device="cuda", ...)`).

Triton reads TRITON_INTERPRET when it is imported, so the checks run in a child interpreter
started with it set (this process may already hold a compiled Triton)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

# (tokens, experts, top_k, hidden, intermediate): H spans partial K blocks, I partial N blocks;
# the last case shares experts between tokens (rows read by several pairs).
CASES = ((1, 16, 4, 160, 48), (3, 10, 2, 300, 40), (4, 6, 3, 96, 24), (2, 128, 8, 64, 32))


def reference_moe(x, rows, topw, gate, up, down, top_k: int) -> torch.Tensor:
    """Per pair in fp32: silu(x W_g^T) * (x W_u^T) W_d^T, summed over k with the routing weights."""
    t = x.shape[0]
    out = torch.zeros(t, x.shape[1], dtype=torch.float32, device=x.device)
    for p, r in enumerate(rows.tolist()):
        xt = x[p // top_k].float()
        h = F.silu(xt @ gate[r].float().T) * (xt @ up[r].float().T)
        out[p // top_k] += topw.reshape(-1)[p].float() * (h @ down[r].float().T)
    return out


def check_kernels(device: str = "cpu", dtype: torch.dtype = torch.float32, tol: float = 1e-4) -> None:
    from paged_experts import moe_triton
    from paged_experts.experts import route

    gen = torch.Generator().manual_seed(0)
    for t, e, k, h, i in CASES:
        logits = torch.randn(t, e, generator=gen).to(device, dtype)
        for norm in (True, False):
            ids, w = moe_triton.route(logits, k, norm)
            ref_ids, ref_w = route(logits, k, norm)
            assert ids.dtype == torch.int64 and w.dtype == torch.float32
            # the same logits in the same (descending) order: ids may differ only between equal logits
            assert torch.equal(logits.gather(1, ids), logits.gather(1, ref_ids)), (ids, ref_ids)
            assert all(len(set(row)) == k for row in ids.tolist())
            torch.testing.assert_close(w, ref_w, rtol=1e-5, atol=1e-6)
        gate = (torch.randn(e, i, h, generator=gen) / 8).to(device, dtype)
        up = (torch.randn(e, i, h, generator=gen) / 8).to(device, dtype)
        down = (torch.randn(e, h, i, generator=gen) / 8).to(device, dtype)
        x = torch.randn(t, h, generator=gen).to(device, dtype)
        rows, topw = route(logits, k, True)
        if t > 1:  # token 1 reuses token 0's experts: a row serves several pairs
            rows[1] = rows[0]
        got = moe_triton.moe_pairs(x, rows.reshape(-1), topw, gate, up, down, k)
        assert got.shape == (t, h) and got.dtype == dtype
        want = reference_moe(x, rows.reshape(-1), topw, gate, up, down, k)
        torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol * max(1.0, want.abs().max().item()))
        # a slot table holding the same experts in other rows gives the same bits (paged == resident)
        perm = torch.randperm(e, generator=gen).to(device)
        slot_of = torch.argsort(perm)  # expert -> its row in the permuted table
        paged = moe_triton.moe_pairs(x, slot_of[rows.reshape(-1)], topw, gate[perm], up[perm], down[perm], k)
        assert torch.equal(paged, got)
        print("ok", (t, e, k, h, i))


def test_decode_kernels_match_torch_in_the_interpreter() -> None:
    pytest.importorskip("triton")
    code = "import sys; sys.path.insert(0, sys.argv[1]); import test_moe_triton as t; t.check_kernels()"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, "-c", code, os.path.dirname(__file__)], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert done.stdout.count("ok ") == len(CASES)
