"""The built-in engine's device-memory projection per K, for the paged `resident_experts` search.

`projections(...)` -> K -> `KProjection`: the bytes a paged server must hold on the device whatever
else it does, from benchsuite.tools.preflight's formulas and the runtime's own model shape
(paged_experts.shape, through the runtime's config: expert bytes in the served format, FP8 scales included):
`non_expert_weight_bytes + kv_capacity_tokens x kv_bytes_per_token + K x slot_bytes + R x expert_bytes`
(R: the server's prefill staging rows, one expert of one layer each, shared by all layers).
It is a lower bound: no CUDA context, allocator caches, CUDA graph pools, activations or
synthetic-router tables. The search rules a K out only when this bound exceeds the budget, and
guesses the rest (its `overhead_mib`) until a launch measures the peak (benchsuite.run.search_propose).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from benchsuite.errors import UserError
from benchsuite.tools import preflight
from paged_experts.config import MoeModelConfig
from paged_experts.shape import dtype_bytes

SOURCE = "preflight"


@dataclass(frozen=True)
class KProjection:
    k: int
    non_expert_bytes: int  # embeddings, LM head, attention (FP8 where the server keeps it so), norms, routers
    kv_bytes: int  # kv_capacity_tokens x kv_bytes_per_token
    slot_bytes: int  # one resident expert in every MoE layer
    staging_bytes: int = 0  # the prefill staging rows (RuntimeConfig.prefill_staging_rows), one expert each
    source: str = SOURCE

    @property
    def gpu_total_bytes(self) -> int:
        return self.non_expert_bytes + self.kv_bytes + self.k * self.slot_bytes + self.staging_bytes

    def fits(self, budget_bytes: int, margin_bytes: int) -> bool:
        return self.gpu_total_bytes + margin_bytes <= budget_bytes


def k_range(num_experts: int, top_k: int, max_concurrency: int, min_k: int | None, max_k: int | None) -> range:
    """The K a search may choose: from min_k (default max_concurrency x top_k, every batch of the
    matrix in one wave on the captured graph path; never below top_k) to max_k (default E)."""
    low = max(top_k, min_k if min_k is not None else preflight.min_k_for_concurrency(max_concurrency, top_k))
    high = min(num_experts, max_k if max_k is not None else num_experts)
    if low > high:
        why = "min_k" if min_k is not None else f"max concurrency {max_concurrency} x top_k {top_k}"
        raise UserError(f"resident_experts search: K from {low} ({why}) exceeds the largest K {high}")
    return range(low, high + 1)


def projections(
    model_dir: Path,
    compute_dtype: str,
    kv_capacity_tokens: int,
    ks: range,
    staging_rows: int = 0,
    dequantize_attention: bool = False,
) -> dict[int, KProjection]:
    """The projection of every K in `ks` for the checkpoint's runtime config (its shape owns the sizes);
    `staging_rows`: the prefill staging rows the server holds (RuntimeConfig.prefill_staging_rows);
    a block-FP8 checkpoint's attention projections count as FP8 with their scales unless
    `dequantize_attention` (MoeModelConfig.fp8_attention)."""
    cfg = MoeModelConfig.from_dir(model_dir)
    shape = cfg.shape
    expert_dtype = cfg.expert_dtype(compute_dtype)
    slot = shape.slot_bytes(expert_dtype)
    kv = kv_capacity_tokens * shape.kv_bytes_per_token(dtype_bytes(compute_dtype))
    fp8_attention = cfg.fp8_attention(dequantize_attention)
    non_expert = shape.non_expert_weight_bytes(dtype_bytes(compute_dtype), fp8_attention=fp8_attention)
    staging = staging_rows * shape.expert_bytes(expert_dtype)  # one expert of one layer a row
    return {k: KProjection(k, non_expert, kv, slot, staging) for k in ks}
