"""Fused expert compute: all routed (token, expert) pairs of one pass in three grouped matmuls.

The pairs are sorted by the weight row (expert in `[E, ...]` tensors, slot in `[K, ...]` slots)
that serves them; `offs[g]` is the cumulative count of pairs served by rows 0..g. Then
`gate = x @ W_gate[g]^T`, `up = x @ W_up[g]^T` and `y = (silu(gate) * up) @ W_down[g]^T` each run
as ONE grouped matmul over the slot table (`torch._grouped_mm`: a CUTLASS grouped GEMM on Hopper,
which reads only the rows that have pairs). Nothing is gathered or copied per expert.

Why paged and resident still agree bit for bit: a row's pairs are always the pairs routed to that
expert in increasing pair order (stable sorts), so each group is the same `[n, H] x [H, I]` product
whichever wave, slot or table holds the expert; group results do not depend on other groups.

Where `torch._grouped_mm` refuses a device/dtype (e.g. fp32 on CUDA), `grouped_mm` falls back:
on CUDA to a gathered batched matmul (no sync, graph-safe, copies the routed weights), on CPU to a
loop of per-group matmuls; each is the same computation in every mode, just slower.
`grouped_backend()` says which ran, for benchmark provenance.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from paged_experts.experts import route
from paged_experts.kernels import moe_tiles, moe_triton
from paged_experts.kernels.moe_grouped_fp8 import BlockTable, RowMap, block_table, grouped_fp8_glu, grouped_fp8_mm
from paged_experts.kernels.moe_tiles import GroupedTiles
from paged_experts.residency.store import ExpertTensors

GLU_ONE_LAUNCH = True
"""FP8 grouped steps (prefill) run gate, up, silu and their product as one launch (`grouped_fp8_glu`); False:
four, as before (benchmarks/profile_step.py's 'unfusedglu' A/B sets it per variant). Both compute a pair alike
in a resident step and in any paged wave, so paged stays bit-identical to resident either way."""

_BACKEND: dict[tuple[str, torch.dtype], str] = {}
"""(device type, dtype) -> 'grouped_mm', 'gather_bmm' (CUDA) or 'loop', decided on first use."""
_BACKEND_ERRORS: dict[tuple[str, torch.dtype], str] = {}


def grouped_backend() -> dict[str, str]:
    """Which grouped matmul ran per device/dtype, with the refusal that made it fall back."""
    out = {f"{dev}/{str(dt).removeprefix('torch.')}": b for (dev, dt), b in _BACKEND.items()}
    out.update({f"{dev}/{str(dt).removeprefix('torch.')}/refused": e for (dev, dt), e in _BACKEND_ERRORS.items()})
    return out


def _loop_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """a: [P, K], b: [G, K, N], offs: [G] cumulative rows -> [P, N] (reference semantics)."""
    out = a.new_empty(a.shape[0], b.shape[-1])  # [P, N]
    start = 0
    for g, end in enumerate(offs.tolist()):
        if end > start:
            out[start:end] = a[start:end] @ b[g]
        start = end
    return out


def _gather_bmm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Each row times its group's matrix as a batched [1, K] x [K, N] product: no host sync, but
    the weights of every pair are gathered (a copy): the CUDA fallback when grouped_mm refuses."""
    rows = torch.arange(a.shape[0], device=a.device, dtype=offs.dtype)  # [P]
    # [P] group of each row; rows past offs[-1] belong to no group (their output is unused)
    group = torch.searchsorted(offs, rows, right=True).clamp_(max=b.shape[0] - 1)
    return torch.bmm(a[:, None, :], b[group]).squeeze(1)  # [P, N]


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """a: [P, K] rows sorted by group, b: [G, K, N], offs: [G] int32 cumulative -> [P, N]."""
    key = (a.device.type, a.dtype)
    backend = _BACKEND.get(key)
    if backend is None:
        try:
            out = torch._grouped_mm(a, b, offs=offs)
            _BACKEND[key] = "grouped_mm"
            return out
        except (RuntimeError, NotImplementedError, AttributeError, TypeError) as exc:
            # fp32 keeps the per-group loop: the same mm shape per expert in every mode (bit-exact tests)
            backend = "gather_bmm" if a.device.type == "cuda" and a.dtype != torch.float32 else "loop"
            _BACKEND[key] = backend
            _BACKEND_ERRORS[key] = repr(exc)[:300]
    if backend == "grouped_mm":
        return torch._grouped_mm(a, b, offs=offs)
    if backend == "gather_bmm":
        return _gather_bmm(a, b, offs)
    return _loop_mm(a, b, offs)


# The kernel backend, a model's configuration (RuntimeConfig.kernel_backend), handed to every choice
# below: 'grouped' (torch._grouped_mm and its fallbacks) or 'triton' (moe_triton's per-pair decode
# kernels and routing kernel, for one-wave steps of at most moe_triton.MAX_PAIRS pairs:
# `experts_over_rows`, i.e. resident, offload and device-planned paged layers; larger or host-planned
# steps keep 'grouped').
EXPERT_BACKENDS: tuple[str, ...] = ("grouped", "triton")


def check_expert_backend(name: str) -> None:
    """Raises ValueError for a backend that does not exist or cannot run in this build."""
    if name not in EXPERT_BACKENDS:
        raise ValueError(f"expert backend must be one of {EXPERT_BACKENDS}, got {name!r}")
    if name == "triton" and not moe_triton.available():
        raise ValueError("the 'triton' expert backend needs Triton (a CUDA build of torch)")


def fp8_grouped_tiles(weights: ExpertTensors) -> GroupedTiles | None:
    """The tiles of moe_grouped_fp8 where FP8 `weights` run it (on CUDA with Triton, by the shape's
    measured choice: moe_tiles.fp8_prefill), else None (dequantize, then grouped GEMM)."""
    if not weights.is_fp8 or weights.gate.device.type != "cuda" or not moe_triton.available():
        return None
    inter, hidden = weights.gate.shape[1:]
    return moe_tiles.fp8_prefill(hidden, inter)


def fp8_expert_mlp(
    x_sorted: torch.Tensor,
    weights: ExpertTensors,
    offs: torch.Tensor,
    tiles: GroupedTiles,
    blocks: BlockTable | None = None,
    gather: RowMap | None = None,
    scatter: tuple[torch.Tensor, RowMap] | None = None,
) -> torch.Tensor:
    """`expert_mlp` of FP8 rows by moe_grouped_fp8 with the given tiles: x_sorted [P, H] -> [P, H].
    blocks: offs's block table for tiles.block_m where the caller laid it out (None: built here).
    gather: x_sorted is every token's activations [T, H], pair m's row gather.rows[gather.first + m] (P =
    gather.num; the gate and up launch reads them there, no gathered copy); scatter (y [R, H], rows): pair m's
    output goes to y's row rows.rows[rows.first + m] (the down launch writes it there, no copy after), and y is
    returned. The arithmetic is the same either way (moe_grouped_fp8)."""
    p = gather.num if gather is not None else x_sorted.shape[0]
    if blocks is None:
        blocks = block_table(offs, p, tiles.block_m)  # one table for the three matmuls
    if GLU_ONE_LAUNCH:
        gate_up = (weights.gate, weights.get("gate_scale")), (weights.up, weights.get("up_scale"))
        h = grouped_fp8_glu(x_sorted, *gate_up, blocks, tiles, gather)  # [P, I]
    else:
        if gather is not None:  # the four-launch reference reads sorted rows
            x_sorted, gather = x_sorted[gather.rows[gather.first : gather.first + gather.num]], None
        gate = grouped_fp8_mm(x_sorted, weights.gate, weights.get("gate_scale"), blocks, tiles)  # [P, I]
        up = grouped_fp8_mm(x_sorted, weights.up, weights.get("up_scale"), blocks, tiles)  # [P, I]
        h = F.silu(gate) * up  # [P, I]
    return grouped_fp8_mm(h, weights.down, weights.get("down_scale"), blocks, tiles, scatter)  # [P, H] or y


def expert_mlp(
    x_sorted: torch.Tensor, weights: ExpertTensors, offs: torch.Tensor, blocks: BlockTable | None = None
) -> torch.Tensor:
    """x_sorted: [P, H] pairs sorted by weight row; offs: [G] int32 over G = weights.num_rows -> [P, H].
    FP8 tables run moe_grouped_fp8 on FP8 rows where `fp8_grouped_tiles` says so (blocks: offs's block
    table for those tiles, laid out by the caller; None: built from offs); elsewhere they are
    dequantized whole first (no host read: graph-safe), and host-planned waves hand in only their
    own experts' rows (moe/waves.py)."""
    if x_sorted.shape[0] == 0:
        return torch.empty_like(x_sorted)
    tiles = fp8_grouped_tiles(weights)
    if tiles is not None:
        return fp8_expert_mlp(x_sorted, weights, offs, tiles, blocks)
    weights = weights.dense(x_sorted.dtype)
    gate = grouped_mm(x_sorted, weights.gate.transpose(1, 2), offs)  # [P, I]
    up = grouped_mm(x_sorted, weights.up.transpose(1, 2), offs)  # [P, I]
    return grouped_mm(F.silu(gate) * up, weights.down.transpose(1, 2), offs)  # [P, H]


def group_pairs(pair_rows: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """pair_rows: [P] weight row of each pair (on any device) -> order [P], offs [G] int32, counts [G].

    `order` lists pair indices sorted by row (stable); no host synchronization on CUDA.
    """
    order = torch.sort(pair_rows, stable=True).indices  # [P]
    # scatter_add, not bincount: CUDA bincount reads the max id on the host (a sync, and no graphs)
    counts = pairs_per_row(pair_rows, num_rows)  # [G]
    offs = torch.cumsum(counts, 0, dtype=torch.int32)  # [G]
    return order, offs, counts


def run_pairs(
    x: torch.Tensor, weights: ExpertTensors, order: torch.Tensor, offs: torch.Tensor, top_k: int, y_pairs: torch.Tensor
) -> None:
    """Computes the pairs `order` (flat t * k + j, sorted by row) and writes them into y_pairs [T*k, H]."""
    if order.numel() == 0:
        return
    tokens = torch.div(order, top_k, rounding_mode="floor")  # [P]
    y = expert_mlp(x[tokens], weights, offs)  # [P, H]
    y_pairs.index_copy_(0, order, y)


def combine_pairs(y_pairs: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """[T*k, H] per-pair outputs in pair order, weighted and summed over k in k order -> [T, H]."""
    t, k = topk_weights.shape
    w = topk_weights.to(device=y_pairs.device, dtype=y_pairs.dtype)  # [T, k]
    return (y_pairs.view(t, k, -1) * w[:, :, None]).sum(dim=1)  # [T, H]


def uses_triton(num_pairs: int, device: torch.device, backend: str) -> bool:
    """Whether a one-wave step of `num_pairs` pairs runs moe_triton's decode kernels."""
    return backend == "triton" and device.type == "cuda" and num_pairs <= moe_triton.MAX_PAIRS


def kernel_choice(is_fp8: bool, device_type: str, dtype: str, backend: str) -> dict[str, str]:
    """Which expert kernels serve which steps (recorded in the server's info and log)."""
    weights = "FP8 rows + float32 block scales" if is_fp8 else f"{dtype} rows"
    large = "grouped GEMM (torch._grouped_mm or its fallback)"
    if is_fp8:
        large = f"the step's (or wave's) experts dequantized to {dtype}, then grouped GEMM"
        if device_type == "cuda" and moe_triton.available():
            large = (
                "moe_grouped_fp8 (FP8 rows converted in registers, tensor-core MMA, block scales in fp32) "
                f"where the shape's measured choice is triton ({moe_tiles.FP8_PREFILL_ENV}), else {large}"
            )
    if backend == "triton" and device_type == "cuda":
        small = f"moe_triton per-pair kernels reading {weights}, fp32 accumulation"
        return {f"steps <= {moe_triton.MAX_PAIRS} pairs": small, "larger steps": large}
    return {"all steps": large}


def route_logits(
    logits: torch.Tensor, top_k: int, norm_topk_prob: bool, *, backend: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, E] router logits -> ids [T, k], weights [T, k]: moe_triton's one-kernel routing where the
    step's experts run as its decode kernels, else `experts.route` (the same semantics)."""
    if uses_triton(logits.shape[0] * top_k, logits.device, backend):
        return moe_triton.route(logits, top_k, norm_topk_prob)
    return route(logits, top_k, norm_topk_prob)


def pairs_per_row(pair_rows: torch.Tensor, num_rows: int) -> torch.Tensor:
    """[T*k] row of each pair -> [G] pair count per row (scatter_add: no host sync on CUDA)."""
    counts = torch.zeros(num_rows, dtype=torch.long, device=pair_rows.device)  # [G]
    return counts.scatter_add_(0, pair_rows, torch.ones_like(pair_rows))


def experts_over_rows(
    x: torch.Tensor,
    pair_rows: torch.Tensor,
    topk_weights: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    down: torch.Tensor,
    top_k: int,
    count_rows: bool = True,
    gate_scale: torch.Tensor | None = None,
    up_scale: torch.Tensor | None = None,
    down_scale: torch.Tensor | None = None,
    *,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The whole expert pass of a one-wave step, tensors only (compilable unless the 'triton'
    backend takes it): x [T, H], pair_rows [T*k] weight row (expert or slot) of each pair ->
    (out [T, H], pairs per row [G]; None where the triton kernels ran and count_rows is False).
    FP8 experts come with their block scales (`*_scale`): the triton kernels read FP8 rows and
    scales directly; the grouped path dequantizes the table first."""
    if uses_triton(pair_rows.shape[0], x.device, backend):
        out = moe_triton.moe_pairs(x, pair_rows, topk_weights, gate, up, down, top_k, gate_scale, up_scale, down_scale)
        return out, pairs_per_row(pair_rows, gate.shape[0]) if count_rows else None
    weights = ExpertTensors(gate, up, down, gate_scale, up_scale, down_scale)
    order, offs, counts = group_pairs(pair_rows, weights.num_rows)
    y_pairs = x.new_empty(pair_rows.shape[0], x.shape[1])  # [T*k, H]
    run_pairs(x, weights, order, offs, top_k, y_pairs)
    return combine_pairs(y_pairs, topk_weights), counts
