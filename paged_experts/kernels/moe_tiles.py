"""Tile sizes of the Triton MoE decode kernels (moe_triton, moe_triton_fp8), per kernel.

`CONFIGS` (bf16 / fp16 experts) holds the fastest batch-1 tiles measured on the H200 and takes a
`PAGED_EXPERTS_MOE_TILES` override at import (`parse_tiles`; `tile_spec` writes one item back):
`benchmarks/moe_kernels_h200.py` sweeps them on a GPU and prints the best as that value.
FP8 experts (moe_triton_fp8) take their tiles per shape and batch from `moe_tiles_fp8.json` beside
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
        out[name] = TileConfig(*(int(p) for p in nums), pair_vector=vector)
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
