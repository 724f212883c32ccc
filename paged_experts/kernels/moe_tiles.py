"""Tile sizes of the Triton MoE decode kernels (moe_triton, moe_triton_fp8), per kernel.

`CONFIGS` (bf16 / fp16 experts) holds the fastest batch-1 tiles measured on the H200 and takes a
`PAGED_EXPERTS_MOE_TILES` override at import (`parse_tiles`; `tile_spec` writes one item back):
`benchmarks/moe_kernels_h200.py` sweeps them on a GPU and prints the best as that value.
`FP8_CONFIGS` holds the FP8 kernels' tiles (`benchmarks/fp8_h200.py` measures them).
"""

from __future__ import annotations

import os
from dataclasses import dataclass


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


def parse_tiles(spec: str) -> dict[str, TileConfig]:
    """'gate_up=16x256x4,down=8x128x4xv' -> {kernel: TileConfig}; names must be CONFIGS keys; a
    trailing 'xv' (down only) loads a token's pairs together."""
    out: dict[str, TileConfig] = {}
    for item in filter(None, (p.strip() for p in spec.split(","))):
        name, _, dims = item.partition("=")
        parts = dims.split("x")
        vector = name == "down" and len(parts) == 4 and parts[3] == "v"
        nums = parts[:3] if vector else parts
        if name not in CONFIGS or len(nums) != 3 or not all(p.isdigit() and int(p) > 0 for p in nums):
            raise ValueError(f"{TILES_ENV}: {item!r} is not <{'|'.join(CONFIGS)}>=<block_n>x<block_k>x<num_warps>[xv]")
        out[name] = TileConfig(*(int(p) for p in nums), pair_vector=vector)
    return out


CONFIGS.update(parse_tiles(os.environ.get(TILES_ENV, "")))

FP8_CONFIGS: dict[str, TileConfig] = {
    "gate_up": TileConfig(block_n=16, block_k=128, num_warps=4),
    "down": TileConfig(block_n=16, block_k=128, num_warps=4),
}
"""Tiles of the FP8 kernels (block_k must divide moe_triton_fp8.QUANT_BLOCK, 128); `benchmarks/fp8_h200.py`
measures them."""
