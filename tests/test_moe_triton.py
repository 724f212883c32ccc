"""The decode kernels of moe_triton (routing; gate+up per pair; down with the top-k combine) and
attn_triton (GQA decode attention over a KV row table) against plain torch, in the Triton interpreter (TRITON_INTERPRET=1, CPU, fp32). Skipped where Triton is
absent (the CPU torch wheel has none); tests/cuda/test_device_paging_cuda.py runs the same checks
compiled, in bf16, on a GPU (`check_kernels(device="cuda", ...)`, `check_attention(...)`).

Triton reads TRITON_INTERPRET when it is imported, so the checks run in a child interpreter
started with it set (this process may already hold a compiled Triton)."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace

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
    from paged_experts.kernels import moe_triton
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
        want = reference_moe(x, rows.reshape(-1), topw, gate, up, down, k)
        saved = moe_triton.CONFIGS["down"]
        try:  # the down pass both ways: pairs one after another, and a token's pairs loaded together
            moe_triton.CONFIGS["down"] = replace(saved, pair_vector=True)
            vec = moe_triton.moe_pairs(x, rows.reshape(-1), topw, gate, up, down, k)
        finally:
            moe_triton.CONFIGS["down"] = replace(saved, pair_vector=False)
        try:
            got = moe_triton.moe_pairs(x, rows.reshape(-1), topw, gate, up, down, k)
        finally:
            moe_triton.CONFIGS["down"] = saved
        assert got.shape == (t, h) and got.dtype == dtype and vec.shape == got.shape
        torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol * max(1.0, want.abs().max().item()))
        torch.testing.assert_close(vec.float(), want, rtol=tol, atol=tol * max(1.0, want.abs().max().item()))
        # a slot table holding the same experts in other rows gives the same bits (paged == resident)
        perm = torch.randperm(e, generator=gen).to(device)
        slot_of = torch.argsort(perm)  # expert -> its row in the permuted table
        paged = moe_triton.moe_pairs(x, slot_of[rows.reshape(-1)], topw, gate[perm], up[perm], down[perm], k)
        assert torch.equal(paged, got)
        print("ok", (t, e, k, h, i))


# (batch, query heads, KV heads, head dim, context bucket L, positions): GQA groups of 1, 4 and 8,
# contexts inside one block, across blocks, and a sequence that has only its first token.
ATTENTION_CASES = ((1, 8, 2, 16, 64, (5,)), (3, 4, 4, 32, 128, (0, 70, 127)), (2, 32, 4, 128, 64, (63, 9)))


def check_attention(device: str = "cpu", dtype: torch.dtype = torch.float32, tol: float = 1e-4) -> None:
    from paged_experts.kernels.attn_triton import decode_attention
    from paged_experts.attention import attend

    gen = torch.Generator().manual_seed(0)
    for b, nh, kvh, d, length, pos in ATTENTION_CASES:
        slots = b * length + 7
        kv_k = torch.randn(slots, kvh, d, generator=gen).to(device, dtype)  # [slots, kvh, D]
        kv_v = torch.randn(slots, kvh, d, generator=gen).to(device, dtype)
        positions = torch.tensor(pos, device=device)  # [B]
        # each sequence's rows scattered over the pool; positions past its own repeat its last row
        table = torch.stack([torch.randperm(slots, generator=gen)[:length] for _ in range(b)]).to(device)  # [B, L]
        cols = torch.arange(length, device=device)[None, :]
        table = torch.where(cols <= positions[:, None], table, table.gather(1, positions[:, None]))
        mask = torch.where(cols <= positions[:, None], 0.0, torch.finfo(dtype).min).to(dtype)  # [B, L]
        q = torch.randn(b, nh, d, generator=gen).to(device, dtype)
        got = decode_attention(q, kv_k, kv_v, table, positions, 1)  # blocks of one row: the table is the row table
        want = attend(q.float()[:, None], kv_k.float(), kv_v.float(), table, mask.float()[:, None, :])[:, 0]  # [B, nh*D]
        assert got.shape == (b, nh * d) and got.dtype == dtype
        torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)
        print("ok", (b, nh, kvh, d, length, pos))


@pytest.mark.parametrize(("check", "cases"), [("check_kernels", CASES), ("check_attention", ATTENTION_CASES)])
def test_decode_kernels_match_torch_in_the_interpreter(check: str, cases: tuple) -> None:
    pytest.importorskip("triton")
    code = f"import sys; sys.path.insert(0, sys.argv[1]); import test_moe_triton as t; t.{check}()"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, "-c", code, os.path.dirname(__file__)], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert done.stdout.count("ok ") == len(cases)
