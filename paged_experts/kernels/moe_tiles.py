"""Tile sizes of the Triton MoE decode kernels (moe_triton), per kernel and weight dtype.

`CONFIGS` (bf16 / fp16 experts) holds the fastest batch-1 tiles measured on the H200 and takes a
`PAGED_EXPERTS_MOE_TILES` override at import (`parse_tiles`; `tile_spec` writes one item back):
`benchmarks/moe_kernels_h200.py` sweeps them on a GPU and prints the best as that value.
FP8 experts (the kernels' scale path) take their tiles per shape and batch from `moe_tiles_fp8.json` beside
this module (`fp8_tiles`), which `benchmarks/fp8_tiles_h200.py` writes on a GPU; a shape or batch
the table lacks gets `FP8_CONFIGS`, and `PAGED_EXPERTS_FP8_TILES` (the same syntax) overrides both.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class TileConfig:
    block_n: int  # output features per program
    block_k: int  # reduction step
    num_warps: int
    # down only: load a token's k pairs' tiles together ([k, BN, BK]), not one pair after another
    pair_vector: bool = False


# The fastest batch-1 tiles of benchmarks/moe_kernels_h200.py on the H200 (results/h200/s3_call5):
# 8 rows x 512 columns per gate+up step with 2 warps; down with a token's 8 pairs loaded together.
CONFIGS: dict[str, TileConfig] = {
    "gate_up": TileConfig(block_n=8, block_k=512, num_warps=2),
    "down": TileConfig(block_n=4, block_k=128, num_warps=8, pair_vector=True),
}
TILES_ENV = "PAGED_EXPERTS_MOE_TILES"
"""`gate_up=16x256x4,down=8x512x4` (block_n x block_k x num_warps per kernel) overrides CONFIGS
at import: what `benchmarks/moe_kernels_h200.py` prints as the best tiles of a GPU."""


def tile_spec(name: str, c: TileConfig) -> str:
    """The PAGED_EXPERTS_MOE_TILES item of one kernel's tiles (parse_tiles reads it back)."""
    return f"{name}={c.block_n}x{c.block_k}x{c.num_warps}" + ("xv" if c.pair_vector else "")


def parse_tiles(spec: str, source: str = TILES_ENV) -> dict[str, TileConfig]:
    """'gate_up=16x256x4,down=8x128x4xv' -> {kernel: TileConfig}; names must be CONFIGS keys; a
    trailing 'xv' (down only) loads a token's pairs together."""
    out: dict[str, TileConfig] = {}
    for item in filter(None, (p.strip() for p in spec.split(","))):
        name, _, dims = item.partition("=")
        parts = dims.split("x")
        vector = name == "down" and len(parts) == 4 and parts[3] == "v"
        nums = parts[:3] if vector else parts
        if name not in CONFIGS or len(nums) != 3 or not all(p.isdigit() and int(p) > 0 for p in nums):
            raise ValueError(f"{source}: {item!r} is not <{'|'.join(CONFIGS)}>=<block_n>x<block_k>x<num_warps>[xv]")
        block_n, block_k, num_warps = (int(p) for p in nums)
        out[name] = TileConfig(block_n=block_n, block_k=block_k, num_warps=num_warps, pair_vector=vector)
    return out


CONFIGS.update(parse_tiles(os.environ.get(TILES_ENV, "")))

# Untuned FP8 defaults, reasoned for the H200 (132 SMs, ~4.8 TB/s): at batch 1 a layer reads 8 experts
# x 3 x 2048 x 768 FP8 bytes = 37.7 MB (7.9 us at full bandwidth), so every SM must keep tens of KB
# of loads in flight. gate_up 8 x 512 gives 8 x 96 = 768 programs (~6 per SM), each streaming 8 KB
# (gate + up) per step; down with a token's 8 pairs loaded together over 4-row tiles gives 512
# programs streaming 8 KB per step ([8, 4, 256]). Rows per tile divide the 128-row scale blocks.
FP8_CONFIGS: dict[str, TileConfig] = {
    "gate_up": TileConfig(block_n=8, block_k=512, num_warps=4),
    "down": TileConfig(block_n=4, block_k=256, num_warps=8, pair_vector=True),
}
FP8_TILES_ENV = "PAGED_EXPERTS_FP8_TILES"
"""`gate_up=8x512x4,down=4x256x8xv` overrides the FP8 tiles at every shape and batch (block_n must
divide 128)."""
FP8_TABLE_PATH = Path(__file__).with_name("moe_tiles_fp8.json")
"""The tuned FP8 tiles: {"tiles": {shape_key: {batch: tile spec}}} plus how they were measured."""


def parse_fp8_tiles(spec: str, source: str = FP8_TILES_ENV) -> dict[str, TileConfig]:
    """parse_tiles, with each tile's rows inside one 128-row scale block (block_n divides 128)."""
    tiles = parse_tiles(spec, source)
    for name, c in tiles.items():
        if 128 % c.block_n:
            raise ValueError(f"{source}: {name} block_n {c.block_n} must divide the 128-row FP8 scale blocks")
    return tiles


def shape_key(hidden: int, inter: int, top_k: int) -> str:
    """The table's key of an expert shape (E does not change the tiles: it only offsets rows)."""
    return f"H{hidden}_I{inter}_k{top_k}"


def load_fp8_table(path: Path) -> dict[str, dict[int, dict[str, TileConfig]]]:
    """shape key -> {batch: {kernel: TileConfig}}; a missing file is an empty table."""
    if not path.exists():
        return {}
    raw = json.loads(path.read_text())
    out: dict[str, dict[int, dict[str, TileConfig]]] = {}
    for key, per_batch in raw.get("tiles", {}).items():
        out[key] = {}
        for batch, spec in per_batch.items():
            out[key][int(batch)] = {**FP8_CONFIGS, **parse_fp8_tiles(spec, f"{path.name}: {key} batch {batch}")}
    return out


FP8_TABLE = load_fp8_table(FP8_TABLE_PATH)
FP8_OVERRIDE = parse_fp8_tiles(os.environ.get(FP8_TILES_ENV, ""))


def fp8_tiles(hidden: int, inter: int, top_k: int, tokens: int) -> dict[str, TileConfig]:
    """The FP8 kernels' tiles for a step of `tokens` tokens: the table's entry of the smallest tuned
    batch >= tokens (else its largest), FP8_CONFIGS where the shape is not tuned, the env override on top."""
    per_batch = FP8_TABLE.get(shape_key(hidden, inter, top_k), {})
    tiles = dict(FP8_CONFIGS)
    if per_batch:
        fits = [b for b in per_batch if b >= tokens]
        tiles = dict(per_batch[min(fits) if fits else max(per_batch)])
    tiles.update(FP8_OVERRIDE)
    return tiles


@dataclass(frozen=True)
class GroupedTiles:
    """Tiles of moe_grouped_fp8 (FP8 steps larger than moe_triton.MAX_PAIRS: prefill)."""

    block_m: int  # pair rows per program (one group's)
    block_n: int  # output features per program (divides 128)
    block_k: int  # reduction step (divides 128: one scale block per step)
    num_warps: int
    num_stages: int


# The large-M FP8 tiles of the published fused-MoE configs for this GPU class (64 x 128 x 128, 4 warps):
# a step reads one 128 x 128 scale block of a weight, the MMA fills the tensor cores from 64 rows.
GROUPED_FP8 = GroupedTiles(block_m=64, block_n=128, block_k=128, num_warps=4, num_stages=3)
FP8_PREFILL_ENV = "PAGED_EXPERTS_FP8_PREFILL"
"""`dequant` (the step's experts dequantized to bf16, then the grouped GEMM) or `triton:64x128x128x4x3`
(block_m x block_n x block_k x num_warps x num_stages of moe_grouped_fp8): the FP8 path of steps
above MAX_PAIRS at every shape, over the table's choice."""


def parse_prefill(spec: str, source: str = FP8_PREFILL_ENV) -> GroupedTiles | None:
    """'dequant' -> None; 'triton' -> GROUPED_FP8; 'triton:BMxBNxBKxWxS' -> those tiles."""
    kind, _, dims = spec.partition(":")
    nums = dims.split("x") if dims else []
    if kind == "dequant" and not dims:
        return None
    if kind == "triton" and not dims:
        return GROUPED_FP8
    if kind == "triton" and len(nums) == 5 and all(v.isdigit() and int(v) > 0 for v in nums):
        t = GroupedTiles(*(int(v) for v in nums))
        if 128 % t.block_n == 0 and 128 % t.block_k == 0:
            return t
    raise ValueError(f"{source}: {spec!r} is not 'dequant' or 'triton[:BMxBNxBKxWARPSxSTAGES]' (BN, BK divide 128)")


def prefill_spec(tiles: GroupedTiles | None) -> str:
    """parse_prefill's inverse."""
    if tiles is None:
        return "dequant"
    return f"triton:{tiles.block_m}x{tiles.block_n}x{tiles.block_k}x{tiles.num_warps}x{tiles.num_stages}"


def _prefill_table(path: Path) -> dict[str, GroupedTiles | None]:
    raw = json.loads(path.read_text()) if path.exists() else {}
    return {key: parse_prefill(spec, f"{path.name}: prefill {key}") for key, spec in raw.get("prefill", {}).items()}


FP8_PREFILL_TABLE = _prefill_table(FP8_TABLE_PATH)
_PREFILL_OVERRIDE = os.environ.get(FP8_PREFILL_ENV, "")
FP8_PREFILL_OVERRIDE = parse_prefill(_PREFILL_OVERRIDE) if _PREFILL_OVERRIDE else GROUPED_FP8


def fp8_prefill(hidden: int, inter: int) -> GroupedTiles | None:
    """The FP8 path of large steps at this shape: moe_grouped_fp8's tiles, or None to dequantize.
    One choice per shape, never per step size: a resident step and a paged wave must compute a pair alike."""
    if _PREFILL_OVERRIDE:
        return FP8_PREFILL_OVERRIDE
    return FP8_PREFILL_TABLE.get(prefill_key(hidden, inter), GROUPED_FP8)


def prefill_key(hidden: int, inter: int) -> str:
    """The table's key of the large-step path (top_k does not change a grouped matmul)."""
    return f"H{hidden}_I{inter}"
