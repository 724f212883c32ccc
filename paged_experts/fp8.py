"""Block-FP8 weights: the layout of published FP8 checkpoints (Qwen3-30B-A3B-FP8, DeepSeek-V3).

A weight `W [O, I]` is stored as `float8_e4m3fn` values `q [O, I]` and one float32 `weight_scale_inv`
per 128 x 128 block, `s [ceil(O / 128), ceil(I / 128)]`, with `W[o, i] = q[o, i] * s[o // 128, i // 128]`
(the last blocks may be partial). `config.json` declares it as
`quantization_config: {quant_method: fp8, weight_block_size: [128, 128]}` (`fmt: e4m3`, dynamic
activations: activations stay in the compute dtype here, only weights are FP8).

Owns the format facts (block size, dtype, scale shapes), the check of a checkpoint's declaration,
dequantization (the CPU compute path and non-expert weights at load) and the quantizer our own
synthetic checkpoints use (per-block amax / 448, round to nearest FP8).
"""

from __future__ import annotations

from typing import Any

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
BLOCK = 128
SCALE_SUFFIX = "weight_scale_inv"
QUANTIZATION_CONFIG: dict[str, Any] = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [BLOCK, BLOCK],
}


def blocks(n: int) -> int:
    return -(-n // BLOCK)


def scale_shape(out_features: int, in_features: int) -> tuple[int, int]:
    """[ceil(O / 128), ceil(I / 128)]: one scale per weight block."""
    return blocks(out_features), blocks(in_features)


def fp8_declared(hf_config: dict[str, Any]) -> bool:
    """Whether config.json declares block-FP8 weights; raises ValueError (one line) on a declaration
    this runtime cannot serve (another method, another block size)."""
    q = hf_config.get("quantization_config")
    if not q:
        return False
    method = q.get("quant_method")
    if method != "fp8":
        raise ValueError(f"config.json quantization_config.quant_method {method!r} is not supported (only 'fp8')")
    block = q.get("weight_block_size")
    if list(block or []) != [BLOCK, BLOCK]:
        raise ValueError(
            f"config.json quantization_config.weight_block_size {block!r}: only [{BLOCK}, {BLOCK}] is supported"
        )
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"config.json quantization_config.fmt {fmt!r}: only 'e4m3' (float8_e4m3fn) is supported")
    return True


def expand_scales(scale: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """[..., SO, SI] block scales -> [..., O, I], each scale over its block (partial edges cut)."""
    full = scale.repeat_interleave(BLOCK, dim=-2).repeat_interleave(BLOCK, dim=-1)  # [..., SO*128, SI*128]
    return full[..., :out_features, :in_features]


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q [..., O, I] float8_e4m3fn, scale [..., SO, SI] float32 -> [..., O, I] in `dtype`: the product
    in fp32, rounded once. Elementwise, so a row's result never depends on where it is stored."""
    o, i = q.shape[-2:]
    return (q.to(torch.float32) * expand_scales(scale.to(torch.float32), o, i)).to(dtype)


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., O, I] (any float) -> (q [..., O, I] float8_e4m3fn, scale_inv [..., SO, SI] float32) with
    scale = block amax / 448 (1 for an all-zero block), q = round(w / scale)."""
    o, i = w.shape[-2:]
    so, si = scale_shape(o, i)
    w32 = w.to(torch.float32)
    padded = torch.nn.functional.pad(w32, (0, si * BLOCK - i, 0, so * BLOCK - o))  # [..., SO*128, SI*128]
    tiles = padded.unflatten(-1, (si, BLOCK)).unflatten(-3, (so, BLOCK))  # [..., SO, 128, SI, 128]
    amax = tiles.abs().amax(dim=(-3, -1))  # [..., SO, SI]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (w32 / expand_scales(scale, o, i)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def raw(t: torch.Tensor) -> torch.Tensor:
    """FP8 tensors as their bytes (uint8): copies and index ops the CPU lacks for float8 work on bytes."""
    return t.view(torch.uint8) if t.dtype == FP8_DTYPE else t
