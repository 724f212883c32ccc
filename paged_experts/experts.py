"""Routing and expert compute over stacked expert tensors (slots, the whole store, or host rows).

Why the merge is wave-independent, bit for bit: every (token, k) pair is sorted by expert id once
per layer-step (stable sort), so an expert always sees the same rows in the same order and runs
the same three matmuls whichever wave or slot serves it. Each pair's output lands in its own row of
a `[T * k, H]` buffer; only after all waves are the rows weighted and summed over k in a fixed
order. No result depends on how the experts were split into waves.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from paged_experts.residency.store import ExpertTensors


def route(router_logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """E-wide softmax, top-k, optional renormalisation of the k weights (Qwen3-MoE semantics)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)  # [T, E]
    weights, ids = torch.topk(probs, top_k, dim=-1)  # [T, k], [T, k]
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)  # [T, k]
    return ids, weights


@dataclass(frozen=True)
class Dispatch:
    """The (token, k) pairs of one layer-step grouped by expert."""

    order: torch.Tensor  # [T*k] flat pair index (t * k + j), sorted by expert id, on the compute device
    tokens: torch.Tensor  # [T*k] token of each sorted pair, on the compute device
    offsets: tuple[int, ...]  # [E+1] expert e owns sorted rows offsets[e] : offsets[e+1]
    num_tokens: int
    top_k: int

    def rows(self, expert: int) -> slice:
        return slice(self.offsets[expert], self.offsets[expert + 1])


def build_dispatch(topk_ids_cpu: torch.Tensor, num_experts: int, device: torch.device) -> Dispatch:
    num_tokens, top_k = topk_ids_cpu.shape
    flat = topk_ids_cpu.reshape(-1)  # [T*k]
    order = torch.sort(flat, stable=True).indices  # [T*k]
    counts = torch.bincount(flat, minlength=num_experts)  # [E]
    offsets = [0] + torch.cumsum(counts, 0).tolist()
    order_dev = order.to(device)
    return Dispatch(
        order=order_dev,
        tokens=torch.div(order_dev, top_k, rounding_mode="floor"),
        offsets=tuple(int(o) for o in offsets),
        num_tokens=num_tokens,
        top_k=top_k,
    )


def run_experts(
    x_sorted: torch.Tensor,
    weights: ExpertTensors,
    dispatch: Dispatch,
    experts: Sequence[int],
    rows_of: Sequence[int],
    y_sorted: torch.Tensor,
) -> None:
    """Reference loop: expert `experts[i]` is read from row `rows_of[i]` of `weights`.

    x_sorted: [T*k, H] inputs in dispatch order; y_sorted: [T*k, H] written in place.
    """
    for expert, row in zip(experts, rows_of):
        sel = dispatch.rows(expert)
        if sel.start == sel.stop:
            continue
        xe = x_sorted[sel]  # [n, H]
        dt = xe.dtype  # FP8 rows are dequantized here, one expert at a time
        gate = F.linear(xe, weights.dense_row("gate", row, dt))  # [n, I]
        up = F.linear(xe, weights.dense_row("up", row, dt))  # [n, I]
        y_sorted[sel] = F.linear(F.silu(gate) * up, weights.dense_row("down", row, dt))  # [n, H]


def combine(y_sorted: torch.Tensor, dispatch: Dispatch, topk_weights: torch.Tensor) -> torch.Tensor:
    """Weights each pair by its router weight and sums over k in k order: [T*k, H] -> [T, H]."""
    hidden = y_sorted.shape[-1]
    per_pair = torch.empty_like(y_sorted)  # [T*k, H]
    per_pair[dispatch.order] = y_sorted
    per_pair = per_pair.view(dispatch.num_tokens, dispatch.top_k, hidden)  # [T, k, H]
    w = topk_weights.to(device=y_sorted.device, dtype=y_sorted.dtype)  # [T, k]
    return (per_pair * w[:, :, None]).sum(dim=1)  # [T, H]
