"""One projection, whatever its weight's storage: dense (`F.linear`) or block-FP8 with its scales.

`linear(x, weight, scale)`: scale None -> `F.linear(x, weight)`; else weight [N, K] float8_e4m3fn with
float32 128 x 128 block scales [ceil(N/128), ceil(K/128)] (fp8.py's layout): on CUDA Triton's
kernels/linear_fp8 (decode steps read the FP8 bytes in place; larger ones dequantize into a scratch buffer
for cuBLAS), elsewhere the weight dequantized to x's dtype
for the call (fp8.dequantize, then `F.linear`: the CPU reference). Inside torch.compile the FP8 path is
the opaque op `paged_experts::fp8_linear`, so a compiled attention block calls the kernel as it is
(Dynamo does not trace into the launcher) and one compiled function still serves every layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from paged_experts import fp8
from paged_experts.kernels import linear_fp8


def _fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., K] -> [..., N] through the block-FP8 weight."""
    flat = x.reshape(-1, x.shape[-1])  # [M, K]
    if flat.is_cuda and linear_fp8.available():
        out = linear_fp8.fp8_linear(flat, weight, scale)  # [M, N]
    else:
        out = F.linear(flat, fp8.dequantize(weight, scale, x.dtype))  # [M, N]
    return out.reshape(*x.shape[:-1], weight.shape[0])


@torch.library.custom_op("paged_experts::fp8_linear", mutates_args=())
def _fp8_linear_op(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return _fp8_linear(x, weight, scale)


@_fp8_linear_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight^T -> [..., N]; `scale` given: weight is block-FP8 (see the module)."""
    if scale is None:
        return F.linear(x, weight)
    if torch.compiler.is_compiling():
        return torch.ops.paged_experts.fp8_linear(x, weight, scale)
    return _fp8_linear(x, weight, scale)
