"""The per-layer functions of the static decode step (paged_experts/decode/graphs.py): each a pure function
of the tensors it is given, so one torch.compile serves every layer, and the captured graph holds
their kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from paged_experts.attention import attend, attention_in, attention_out, rms_norm
from paged_experts.kernels.fused import route_logits


def attention_block(
    x: torch.Tensor,
    input_norm: torch.Tensor,
    qkv_proj: torch.Tensor,
    o_proj: torch.Tensor,
    q_norm: torch.Tensor,
    k_norm: torch.Tensor,
    post_norm: torch.Tensor,
    router: torch.Tensor,
    kv_k: torch.Tensor,
    kv_v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    new_rows: torch.Tensor,
    table: torch.Tensor,
    mask: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    eps: float,
    qkv_scale: torch.Tensor | None = None,
    o_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One layer's attention (KV row written in place) over padded KV rows and its router logits,
    all tensors passed in (one compiled function serves every layer):
    x [B, H] -> (x + attention [B, H], post-norm hidden [B, H], router logits [B, E]).
    qkv_scale / o_scale: block-FP8 projections' scales (None: dense)."""
    q = attention_in(
        x, input_norm, qkv_proj, q_norm, k_norm, kv_k, kv_v, cos, sin, new_rows, num_heads, num_kv_heads, head_dim, eps,
        qkv_scale,
    )  # fmt: skip
    attn = attend(q[:, None], kv_k, kv_v, table, mask[:, None, :])[:, 0]  # [B, nh*D]
    x, h, logits = attention_out(x, attn, o_proj, post_norm, router, eps, o_scale)
    assert logits is not None  # a router was given
    return x, h, logits


def predict_logits(x: torch.Tensor, post_norm: torch.Tensor, router: torch.Tensor, eps: float) -> torch.Tensor:
    """Residual stream x [B, H] -> a layer's router logits [B, E] as if x were its MoE input."""
    return F.linear(rms_norm(x, post_norm, eps), router)


def resident_union_stats(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """ids [R, B, k] of R resident layers -> [R, 3] (union, hits = union, misses = 0) per layer."""
    r = ids.shape[0]
    flat = ids.reshape(r, -1).to(torch.long)  # [R, B*k]
    seen = torch.zeros(r, num_experts, dtype=torch.long, device=ids.device)  # [R, E]
    union = seen.scatter_(1, flat, 1).sum(dim=1)  # [R]
    return torch.stack([union, union, torch.zeros_like(union)], dim=1)


def route_block(
    logits: torch.Tensor, top_k: int, norm_topk_prob: bool, planned_ids: torch.Tensor | None, backend: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [B, E] -> expert ids [B, k], weights [B, k]. `planned_ids` [B, k]: a synthetic
    router's ids for this layer, whose weights are the softmax of the model's logits over them."""
    from paged_experts.routing.sources import planned_weights

    if planned_ids is not None:  # synthetic routing: ids drawn for the step on the device, weights from the model
        return planned_ids, planned_weights(logits, planned_ids)
    return route_logits(logits, top_k, norm_topk_prob, backend=backend)
