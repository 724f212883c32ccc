"""One attention implementation for every step: eager steps (ragged chunks of any length) and the
static decode step (one token per sequence, captured as a CUDA graph) call the same functions.

A layer's attention is three parts, each a pure function of the tensors it is given (so one
torch.compile of a part serves every layer):
- `attention_in`: input norm, fused QKV projection (dense or block-FP8: projection.linear), q/k norms,
  RoPE, and this step's keys and values written to their KV rows; returns the queries;
- the core, over KV rows gathered through a table: `attend` (torch: gather, GQA repeat, two
  matmuls and an fp32 softmax; for prefill chunks on CUDA torch's fused attention, which keeps no
  scores in memory) or, in the static decode step with the triton backend,
  `kernels.attn_triton.decode_attention` (the same function in one kernel, reading a block table);
- `attention_out`: output projection, residual, post-attention norm and (optionally) the router.
Numerics follow transformers' Qwen3-MoE (RMSNorm in fp32, RoPE cos/sin in the model dtype, softmax
in fp32), so its logits stay an outside oracle for this code.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from paged_experts.projection import linear


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3 RMSNorm: normalise in fp32, cast back, then scale."""
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def split_qkv(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int) -> tuple[torch.Tensor, ...]:
    """[T, (nh + 2 kvh) D] fused projection -> q [T, nh, D], k [T, kvh, D], v [T, kvh, D]."""
    t = qkv.shape[0]
    q, k, v = torch.split(qkv, [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    return q.view(t, num_heads, head_dim), k.view(t, num_kv_heads, head_dim), v.view(t, num_kv_heads, head_dim)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_tables(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T] (any float-convertible dtype, on inv_freq's device) -> cos, sin [T, D] in `dtype`."""
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # [T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def project_qkv(
    x: torch.Tensor,
    input_norm: torch.Tensor,
    qkv_proj: torch.Tensor,
    q_norm: torch.Tensor,
    k_norm: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    eps: float,
    qkv_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Residual stream x [T, H] -> rotated q [T, nh, D], rotated k [T, kvh, D], v [T, kvh, D].
    qkv_scale: the block scales of a block-FP8 qkv_proj (projection.linear), None for a dense one."""
    qkv = linear(rms_norm(x, input_norm, eps), qkv_proj, qkv_scale)  # [T, (nh + 2 kvh) D]
    q, k, v = split_qkv(qkv, num_heads, num_kv_heads, head_dim)
    q = rms_norm(q, q_norm, eps)  # [T, nh, D]
    k = rms_norm(k, k_norm, eps)  # [T, kvh, D]
    q = q * cos[:, None, :] + rotate_half(q) * sin[:, None, :]
    k = k * cos[:, None, :] + rotate_half(k) * sin[:, None, :]
    return q, k, v


def attention_in(
    x: torch.Tensor,
    input_norm: torch.Tensor,
    qkv_proj: torch.Tensor,
    q_norm: torch.Tensor,
    k_norm: torch.Tensor,
    kv_k: torch.Tensor,
    kv_v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    new_rows: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    eps: float,
    qkv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """`project_qkv`, with this step's keys and values written to their KV rows `new_rows` [T] of
    kv_k / kv_v [slots, kvh, D] (one pool); returns the queries [T, nh, D]."""
    q, k, v = project_qkv(
        x, input_norm, qkv_proj, q_norm, k_norm, cos, sin, num_heads, num_kv_heads, head_dim, eps, qkv_scale
    )
    kv_k.index_copy_(0, new_rows, k)  # [slots, kvh, D]
    kv_v.index_copy_(0, new_rows, v)
    return q


# A chunk of at least this many queries on CUDA attends through torch's fused attention: the explicit
# path holds [nh, n, L] scores several times over (bf16 scores, scores + mask, the fp32 softmax, bf16
# probs: ~1.3 GB for one 2,048-token prompt at 32 heads), device memory a budget would rather give to
# resident experts (the H200 headline: 2,048-token prompts raised paged FP8's peak by 1.7-2.3 GB).
FUSED_MIN_QUERIES = 64


def attend(
    q: torch.Tensor,
    kv_k: torch.Tensor,
    kv_v: torch.Tensor,
    table: torch.Tensor,
    mask: torch.Tensor,
    fused: bool | None = None,
) -> torch.Tensor:
    """q [B, n, nh, D] (n queries per sequence) over the KV rows `table` [B, L] with the additive
    mask [B, n, L] -> [B, n, nh * D]. Eager steps call it per chunk (B=1, n = chunk tokens), the
    static decode step once for the batch (n=1, L padded to a bucket).

    fused: torch's scaled_dot_product_attention (no scores in memory; on CUDA its memory-efficient
    kernel, which takes the mask) instead of the explicit matmuls; None: for chunks of at least
    FUSED_MIN_QUERIES queries on CUDA, so decode steps (and everything on the CPU) keep the explicit
    numerics."""
    b, n, num_heads, head_dim = q.shape
    if fused is None:
        fused = q.is_cuda and n >= FUSED_MIN_QUERIES
    groups = num_heads // kv_k.shape[1]
    # KV heads repeated per query head, not SDPA's enable_gqa (which not every fused CUDA kernel takes,
    # and this mask needs the memory-efficient one); [B, nh, L, D] is small beside the scores it saves
    keys = kv_k[table].repeat_interleave(groups, dim=2).transpose(1, 2)  # [B, nh, L, D]
    values = kv_v[table].repeat_interleave(groups, dim=2).transpose(1, 2)  # [B, nh, L, D]
    if fused:
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys, values, attn_mask=mask[:, None, :, :], scale=head_dim**-0.5
        )  # [B, nh, n, D]
        return out.transpose(1, 2).reshape(b, n, num_heads * head_dim)  # [B, n, nh*D]
    scores = torch.matmul(q.transpose(1, 2), keys.transpose(2, 3)) * head_dim**-0.5  # [B, nh, n, L]
    scores = scores + mask[:, None, :, :]
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)  # [B, nh, n, L]
    return torch.matmul(probs, values).transpose(1, 2).reshape(b, n, num_heads * head_dim)  # [B, n, nh*D]


def attention_out(
    x: torch.Tensor,
    attn: torch.Tensor,
    o_proj: torch.Tensor,
    post_norm: torch.Tensor,
    router: torch.Tensor | None,
    eps: float,
    o_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Residual [T, H] + o_proj(attention [T, nh*D]) -> (x [T, H], post-norm hidden [T, H], router
    logits [T, E] or None when no router is given). o_scale: a block-FP8 o_proj's scales (None: dense)."""
    x = x + linear(attn, o_proj, o_scale)  # [T, H]
    h = rms_norm(x, post_norm, eps)  # [T, H]
    return x, h, None if router is None else F.linear(h, router)


def causal_mask(start_pos: int, n: int, dtype: torch.dtype, device: torch.device | None = None) -> torch.Tensor:
    """[n, start_pos + n] additive mask of a chunk's queries over its sequence's keys, built on `device` (default
    the CPU): a 2,048-token chunk's mask built on the host took ~12 ms of the H200 host's time a step, and its 8 MB
    pageable copy blocked the host (benchmarks/results/h200/2026-12-05-headline-c)."""
    q_pos = torch.arange(start_pos, start_pos + n, device=device)[:, None]  # [n, 1]
    k_pos = torch.arange(start_pos + n, device=device)[None, :]  # [1, L]
    mask = torch.zeros(n, start_pos + n, dtype=dtype, device=device)  # [n, L]
    return mask.masked_fill_(k_pos > q_pos, torch.finfo(dtype).min)
