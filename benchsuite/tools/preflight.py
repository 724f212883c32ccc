"""Preflight arithmetic: every formula of DESIGN.md section 3, written once, units in names.

The model's shape and its byte sizes (expert per format, slot, KV per token, non-expert weights)
have one owner, `paged_experts.shape.ModelShape`; this module reads it for the CLI (errors as
UserError) and names its sizes per published format. Owns the K that fits a memory budget, the
one-wave batch cap, pinned host memory, prefill page-in cost, the all-miss bytes per token, the
miss-rate bound implied by a measured decode speed. Pure functions of frozen values;
`preflight_report.py` puts them together into the per-format report and its verdict, and the CLI
(`benchsuite preflight`) only parses flags and prints.

Units: `_bytes` are bytes, `_b_per_s` bytes per second, `_gb` decimal gigabytes (1e9) unless the
name says `_gib` (2**30). Published sizes (2.43 MB, 117 MB) are decimal megabytes.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from benchsuite.errors import UserError
from paged_experts.shape import REQUIRED_FIELDS, ModelShape

GIB_BYTES = 2**30
GB_BYTES = 10**9
MB_BYTES = 10**6

RANDOM_MISS_REUSE_FACTOR = 0.8  # published analysis: reuse implied when bound < 0.8 x random_miss
WSL2_PINNED_FRACTION = 0.5  # WSL2 caps pinned (page-locked) memory at about half of system RAM

EXPERT_FORMATS = ("bf16", "fp8", "int4")


def shape_from_config(cfg: dict, name: str = "") -> ModelShape:
    """Read the fields of an HF MoE config.json (paged_experts.shape: qwen3_moe / qwen2_moe / mixtral naming)."""
    cfg = cfg["text_config"] if isinstance(cfg.get("text_config"), dict) else cfg
    missing = next((key for key in REQUIRED_FIELDS if key not in cfg), None)
    try:
        if missing is not None:
            raise ValueError(f"config.json lacks MoE field {missing!r} (not a MoE model?)")
        return ModelShape.from_hf_config(cfg, name)
    except ValueError as exc:
        raise UserError(str(exc)) from None


def load_shape(path: str | Path) -> ModelShape:
    """`path` is a config.json or a checkpoint directory holding one."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise UserError(f"no config.json at {p}")
    try:
        cfg = json.loads(p.read_text())
    except json.JSONDecodeError as exc:
        raise UserError(f"{p} is not valid JSON: {exc}") from None
    return shape_from_config(cfg, name=p.parent.name)


# ---------------------------------------------------------------- expert and slot sizes (paged_experts.shape)


def expert_bytes_by_format(shape: ModelShape) -> dict[str, int]:
    """One expert in each published format: bf16, block-FP8 with its scales, symmetric GPTQ int4."""
    if not shape.has_dims:
        return {}
    bf16, fp8, int4 = shape.expert_bytes("bfloat16"), shape.expert_bytes_fp8_block(), shape.expert_bytes_int4_gptq()
    return {"bf16": bf16, "fp8": fp8, "int4": int4}


def slot_bytes(expert_bytes: float, num_moe_layers: int) -> float:
    """One resident expert in every MoE layer: `slot_bytes = expert_bytes x num_moe_layers`
    (ModelShape.slot_bytes for a stored format; this form for an explicit --expert-mb)."""
    return expert_bytes * num_moe_layers


def kv_tokens_per_slot(slot_size_bytes: float, kv_token_bytes: float) -> int:
    """KV tokens the memory of one slot would hold instead."""
    return int(slot_size_bytes // kv_token_bytes)


# ---------------------------------------------------------------- K, batches, host memory


@dataclass(frozen=True)
class MemoryBudget:
    vram_bytes: float
    mem_fraction_static: float  # share of VRAM the engine may use statically (SGLang's flag)
    non_expert_weight_bytes: float
    kv_bytes: float  # KV capacity in tokens x kv bytes per token
    overhead_bytes: float  # activations, CUDA graphs, allocator slack

    @property
    def static_budget_bytes(self) -> float:
        return self.vram_bytes * self.mem_fraction_static

    @property
    def expert_budget_bytes(self) -> float:
        return self.static_budget_bytes - self.non_expert_weight_bytes - self.kv_bytes - self.overhead_bytes


def k_that_fits(budget: MemoryBudget, slot_size_bytes: float, num_experts: int) -> int:
    """`K = (static_budget - non_expert_weights - kv_bytes - overheads) // slot_bytes`, capped at E."""
    return max(0, min(num_experts, int(budget.expert_budget_bytes // slot_size_bytes)))


def batch_cap(k: int, top_k: int) -> int:
    """Requests whose decode step fits one wave when they share no expert: `K // top_k`."""
    return k // top_k


def min_k_for_concurrency(concurrency: int, top_k: int) -> int:
    """Keep `K >= B x top_k` so B requests decode in one wave."""
    return concurrency * top_k


def random_miss(k: int, num_experts: int) -> float:
    """Miss rate if routing were uniform and independent between tokens: `1 - K / E`."""
    return 1.0 - k / num_experts


def all_miss_bytes_per_token(num_moe_layers: int, top_k: int, expert_bytes: float) -> float:
    """Bytes one token pages in if every routed expert misses: `layers x top_k x expert_bytes`."""
    return num_moe_layers * top_k * expert_bytes


def max_miss_allowed(link_b_per_s: float, tok_per_s: float, all_miss_token_bytes: float) -> float:
    """Highest average miss rate a measured decode speed allows on the link:
    `link_bytes_per_s / (tok_per_s x all_miss_bytes_per_token)`."""
    return link_b_per_s / (tok_per_s * all_miss_token_bytes)


def reuse_implied(max_miss: float, random_miss_rate: float) -> bool:
    """Speed proves reuse between tokens when the bound is well below random: `< 0.8 x random_miss`."""
    return max_miss < RANDOM_MISS_REUSE_FACTOR * random_miss_rate


def prefill_page_in_bytes(k: int, num_experts: int, slot_size_bytes: float) -> float:
    """A prefill touches nearly every expert: `(E - K) x slot_bytes` paged in once."""
    return (num_experts - k) * slot_size_bytes


def transfer_time_s(num_bytes: float, link_b_per_s: float) -> float:
    return num_bytes / link_b_per_s


def pinned_host_bytes(num_experts: int, num_moe_layers: int, expert_bytes: float) -> float:
    """All experts of all MoE layers in pinned host RAM: `E x layers x expert_bytes` (scales included)."""
    return num_experts * num_moe_layers * expert_bytes


def pinned_cap_bytes(ram_bytes: float, wsl2: bool) -> float:
    """Pinned memory the OS lets us lock: about half of RAM under WSL2, all of it otherwise."""
    return ram_bytes * (WSL2_PINNED_FRACTION if wsl2 else 1.0)


_PCIE_GT_PER_LANE = {3: 8.0, 4: 16.0, 5: 32.0, 6: 64.0}


def pcie_payload_b_per_s(gen: int, lanes: int) -> float:
    """Theoretical one-direction payload rate after 128b/130b encoding (gen 3-5; gen 6 approx)."""
    return _PCIE_GT_PER_LANE[gen] * 1e9 * lanes * (128 / 130) / 8


def parse_link(value: str) -> tuple[float, str]:
    """`--link-gbps`: a number in GB/s, `pcie5x16` (theoretical), or a `benchsuite linkbw` JSON path.

    Returns (bytes per second, where the figure came from).
    """
    m = re.fullmatch(r"pcie([3-6])x(\d+)", value.strip().lower())
    if m:
        gen, lanes = int(m.group(1)), int(m.group(2))
        return pcie_payload_b_per_s(gen, lanes), f"PCIe {gen}.0 x{lanes} theoretical payload"
    try:
        return float(value) * GB_BYTES, "given"
    except ValueError:
        pass
    p = Path(value)
    if not p.is_file():
        raise UserError(f"--link-gbps {value!r}: not a number, pcie<gen>x<lanes>, or a linkbw JSON file")
    from benchsuite.tools.linkbw import paging_b_per_s_from_json

    return paging_b_per_s_from_json(p), f"measured ({p})"
