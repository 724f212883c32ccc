"""A prefill chunk's q/k RMSNorm and RoPE in one Triton kernel, from the fused QKV projection's output.

Why: eager, `attention.project_qkv` runs the per-head norms and the rotation as ~20 elementwise kernels over
[T, nh + kvh, D] (fp32 casts, pow, mean, rsqrt, the scale, cos, `rotate_half`'s negation and cat, sin, the
sum), each reading and writing the whole chunk: ~0.37 ms of a 2,048-token layer on the H200, in the serial
chain at every paged layer's boundary (`benchmarks/prefill_timeline.py`, 2026-12-03) and in every resident
prefill. Here one program takes one (token, head) row of D values and writes the rotated row once.

Numerics are the eager functions' step by step (`attention.rms_norm`, then the rotation in the model dtype):
the mean square in fp32, x * rsqrt(ms + eps) rounded to the model dtype, times the norm weight rounded,
x * cos and rotate_half(x) * sin each rounded, and their sum rounded. Only the fp32 mean's summation order
(and the reciprocal square root's last bit) can differ from torch's, so a value can differ by one rounding
of the model dtype; the static decode step (torch.compile of the eager functions) keeps its own kernels.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the CPU torch wheel ships no Triton
    triton = None

MIN_TOKENS = 64  # chunks from this many tokens take the kernel (attention.FUSED_MIN_QUERIES: prefill, not decode)
ENABLED = True
"""False: every chunk norms and rotates with the eager torch ops (benchmarks/profile_step.py's 'eagerrope' A/B)."""


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _qk_norm_rope(  # pragma: no cover - runs on a GPU or in TRITON_INTERPRET=1
        qkv,
        q_norm,
        k_norm,
        cos,
        sin,
        q_out,
        k_out,
        row_stride,
        eps,
        NH: tl.constexpr,
        KVH: tl.constexpr,
        D: tl.constexpr,
    ):
        """qkv [T, >= (NH + KVH) D] (row stride row_stride), norms [D], cos / sin [T, D] -> q_out [T, NH, D],
        k_out [T, KVH, D]: program (t, h) normalises and rotates head h of token t (h < NH: a query head)."""
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        half: tl.constexpr = D // 2
        i = tl.arange(0, D)  # [D]
        j = (i + half) % D  # [D] the element rotate_half moves to i
        dt = q_out.dtype.element_ty
        src = qkv + t * row_stride + h * D
        x = tl.load(src + i).to(tl.float32)  # [D]
        xj = tl.load(src + j).to(tl.float32)  # [D]
        is_q = h < NH
        w = tl.where(is_q, tl.load(q_norm + i), tl.load(k_norm + i)).to(tl.float32)  # [D]
        wj = tl.where(is_q, tl.load(q_norm + j), tl.load(k_norm + j)).to(tl.float32)
        r = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)  # the row's reciprocal RMS, fp32 (torch.rsqrt's)
        y = (w * (x * r).to(dt).to(tl.float32)).to(dt).to(tl.float32)  # [D] normalised, as rms_norm rounds
        yj = (wj * (xj * r).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        rot = tl.where(i < half, -yj, yj)  # rotate_half(y)
        c = tl.load(cos + t * D + i).to(tl.float32)
        s = tl.load(sin + t * D + i).to(tl.float32)
        out = ((y * c).to(dt).to(tl.float32) + (rot * s).to(dt).to(tl.float32)).to(dt)
        if is_q:
            tl.store(q_out + (t * NH + h) * D + i, out)
        else:
            tl.store(k_out + (t * KVH + (h - NH)) * D + i, out)


def qk_norm_rope(
    qkv: torch.Tensor,
    q_norm: torch.Tensor,
    k_norm: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """qkv [T, (nh + 2 kvh) D] (the fused projection's output), q_norm / k_norm [D], cos / sin [T, D] ->
    rotated q [T, nh, D] and k [T, kvh, D], as `attention.project_qkv` computes them (within one rounding)."""
    t = qkv.shape[0]
    if qkv.stride(1) != 1 or head_dim & (head_dim - 1):
        raise ValueError(f"qk_norm_rope needs a row-contiguous qkv and a power-of-two head_dim, got {head_dim}")
    q = qkv.new_empty(t, num_heads, head_dim)  # [T, nh, D]
    k = qkv.new_empty(t, num_kv_heads, head_dim)  # [T, kvh, D]
    if t:
        _qk_norm_rope[(t, num_heads + num_kv_heads)](
            qkv, q_norm, k_norm, cos.contiguous(), sin.contiguous(), q, k, qkv.stride(0), eps,
            NH=num_heads, KVH=num_kv_heads, D=head_dim,
        )  # fmt: skip
    return q, k
