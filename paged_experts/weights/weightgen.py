"""The one seeded definition of a generated model's SOURCE weights, computed bit-identically by
torch (CPU or CUDA: the built-in engine's checkpoints and in-memory models) and by numpy (the
synthetic GGUF writer), so every engine given the same (shape, layers, seed) runs the same weights.

Element j of tensor `name` (flat index over its numpy-order shape; the experts of a layer are one
stacked `[E, O, I]` tensor per projection) is

    value = LUT[b] * 2**(exponent + offset[g])      (norms: 1 + (LUT[b] >> 2) * 2**-7)
    b     = byte (j % 4) (little-endian) of hash32(j // 4) for the tensor's keys (k1, k2)
    hash32(c) = mix(mix(c ^ k1) ^ k2),  mix = lowbias-style xor-shift-multiply on 32 bits
    g     = j // group_numel: the expert (stacked expert tensors), else 0 (one group)
    offset[g] = -(mix(mix(g ^ k2) ^ k1) & 1): each expert at sigma or sigma / 2
    lm_head rows of silent tokens are 0

`LUT` is 256 int8 values: the midpoint quantiles of N(0, 1) scaled so the largest is 127; its
standard deviation is LUT_STD (~44). `exponent` is the power of two nearest sigma / LUT_STD, sigma
the standard deviation `paged_experts.weights.synth` gives the tensor (1/sqrt(H) for q/k/v and expert
gate/up, 1/sqrt(I) for expert down, ...), so a tensor's spread is within a factor sqrt(2) of sigma.
Why this form:
- every value is an integer of at most 8 significant bits times a power of two: exact in bf16,
  fp16 (the exponents stay in its range), fp32, and in Q8_0 (the int8 quants ARE the LUT entries,
  every block's fp16 scale is its expert's power of two): a GGUF's Q8_0 experts are the bf16
  experts, bit for bit;
- a counter hash has no generator state: any chunk of any tensor is computed alone, so the GGUF
  writer's worker processes and a GPU both generate in parallel, in any order;
- the multipliers are below 2**31, so torch computes the 32-bit products in int64 without overflow
  (no reliance on wrapping signed arithmetic), numpy in uint32 (unsigned products wrap modulo
  2**32 by definition): the same integers on every device.
Silent tokens (`silent_token_ids`: specials, and byte tokens that alone are no valid UTF-8 text)
get an all-zero output row, so their logit is 0 against a top logit of tens: greedy decoding never
emits a token without visible text, and timing by text chunks and by tokens agree on these models.
The norms' values (0.75..1.24 in steps of 1/128) are exact in bf16 too. The per-expert offset
gives experts different magnitudes, as trained experts have: without it every 128 x 128 block holds
a +-127 LUT entry, so every FP8 block scale of a tensor would be the same, and a paged expert
served with another expert's scales (the bug class tests/test_fp8.py guards) could not be seen.

`recipe(...)` names a generated model's source weights (generator version, shape with its layers
and vocabulary, seed, silent tokens) and `recipe_id` hashes it: the fingerprint the manifest
records for generated models. The FP8 presets quantize these same source tensors per 128 x 128
block, so their recipe is the one of the dense preset of the same shape.
"""

from __future__ import annotations

import hashlib
import json
import math
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from statistics import NormalDist
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch
    from tokenizers import Tokenizer

    from paged_experts.config import MoeModelConfig

# an identity label hashed into every recipe id (weights_id), not an import path: it keeps the name the
# module had when the recipe was defined, so ids recorded before the module moved to weights/ still match
GENERATOR = "paged_experts.weightgen"
GENERATOR_VERSION = 1  # bump when any generated value changes
_M32 = 0xFFFFFFFF
_C1, _C2 = 0x7FEB352D, 0x446CA68B  # odd, below 2**31 (see the module docstring)
_SEED_TAG = 0x9E3779B9
NORM_SHIFT, NORM_EXPONENT = 2, -7  # norms: 1 + (q >> 2) / 128
LOGIT_STD = 16.0  # peaked logits (not near-uniform): greedy decoding stays stable across precisions
SLAB = 2**26  # elements per accelerator step: ~1 GB of int64 temporaries


def _lut() -> list[int]:
    nd = NormalDist()
    top = nd.inv_cdf(255.5 / 256)
    return [round(127 * nd.inv_cdf((k + 0.5) / 256) / top) for k in range(256)]


LUT: tuple[int, ...] = tuple(_lut())
LUT_STD = float(np.asarray(LUT, dtype=np.float64).std())


@dataclass(frozen=True)
class SourceTensor:
    """One source tensor: its name (HF, experts stacked), numpy-order shape and value rule."""

    name: str
    shape: tuple[int, ...]
    kind: str  # "normal" (LUT * 2**exponent) or "norm" (1 + (LUT >> 2) * 2**-7)
    exponent: int
    group_numel: int = 0  # elements per power-of-two group (one expert); 0: the whole tensor, no offset
    zero_rows: tuple[int, ...] = ()  # rows (first axis) that are all zero: the silent tokens' lm_head rows

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def exponent_for(sigma: float) -> int:
    """The power of two nearest sigma / LUT_STD (in log scale)."""
    return round(math.log2(sigma / LUT_STD))


def expert_name(layer: int, proj: str) -> str:
    """The stacked expert tensor of one projection (`gate`, `up`, `down`) of a layer: [E, O, I]."""
    return f"model.layers.{layer}.mlp.experts.{proj}_proj.weight"


def source_tensors(hf: Mapping[str, Any], silent_ids: tuple[int, ...] = ()) -> list[SourceTensor]:
    """Every source tensor of a qwen3_moe HF config, in checkpoint order, with its value rule;
    `silent_ids`: the tokens whose lm_head rows are zero (`silent_token_ids` of the tokenizer)."""
    h, inter, v = int(hf["hidden_size"]), int(hf["moe_intermediate_size"]), int(hf["vocab_size"])
    heads, kv, d = int(hf["num_attention_heads"]), int(hf["num_key_value_heads"]), int(hf["head_dim"])
    e_n = int(hf["num_experts"])

    def normal(name: str, shape: tuple[int, ...], sigma: float) -> SourceTensor:
        return SourceTensor(name, shape, "normal", exponent_for(sigma))

    def experts(layer: int, proj: str, out_in: tuple[int, int], sigma: float) -> SourceTensor:
        return SourceTensor(expert_name(layer, proj), (e_n, *out_in), "normal", exponent_for(sigma), math.prod(out_in))

    def norm(name: str, n: int) -> SourceTensor:
        return SourceTensor(name, (n,), "norm", NORM_EXPONENT)

    out = [normal("model.embed_tokens.weight", (v, h), 1.0)]
    for layer in range(int(hf["num_hidden_layers"])):
        pre = f"model.layers.{layer}"
        out += [
            norm(f"{pre}.input_layernorm.weight", h),
            norm(f"{pre}.post_attention_layernorm.weight", h),
            normal(f"{pre}.self_attn.q_proj.weight", (heads * d, h), 1 / math.sqrt(h)),
            normal(f"{pre}.self_attn.k_proj.weight", (kv * d, h), 1 / math.sqrt(h)),
            normal(f"{pre}.self_attn.v_proj.weight", (kv * d, h), 1 / math.sqrt(h)),
            normal(f"{pre}.self_attn.o_proj.weight", (h, heads * d), 0.5 / math.sqrt(heads * d)),
            norm(f"{pre}.self_attn.q_norm.weight", d),
            norm(f"{pre}.self_attn.k_norm.weight", d),
            # Router logits with std ~2 give distinct, stable top-k choices.
            normal(f"{pre}.mlp.gate.weight", (e_n, h), 2 / math.sqrt(h)),
            experts(layer, "gate", (inter, h), 1 / math.sqrt(h)),
            experts(layer, "up", (inter, h), 1 / math.sqrt(h)),
            experts(layer, "down", (h, inter), 1 / math.sqrt(inter)),
        ]
    lm_head = SourceTensor("lm_head.weight", (v, h), "normal", exponent_for(LOGIT_STD / math.sqrt(h)), 0, silent_ids)
    return [*out, norm("model.norm.weight", h), lm_head]


def by_name(hf: Mapping[str, Any], silent_ids: tuple[int, ...] = ()) -> dict[str, SourceTensor]:
    return {t.name: t for t in source_tensors(hf, silent_ids)}


def silent_token_ids(tokenizer: Tokenizer) -> tuple[int, ...]:
    """Ids whose text alone is not visible: special (added) tokens, which engines render as no
    text, and tokens that decode to nothing, to U+FFFD (a byte of a multi-byte UTF-8 character:
    a streaming server holds it back) or to control characters other than whitespace."""
    specials = {int(i) for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
    silent = set(specials)
    for i in range(tokenizer.get_vocab_size(with_added_tokens=True)):
        if i in specials:
            continue
        text = tokenizer.decode([i], skip_special_tokens=False)
        if not text or "\ufffd" in text or not all(c.isprintable() or c.isspace() for c in text):
            silent.add(i)
    return tuple(sorted(silent))


def hf_shape(cfg: MoeModelConfig) -> dict[str, int]:
    """The HF config keys `source_tensors` and `recipe` read, from a runtime config."""
    return {
        "num_hidden_layers": cfg.num_layers, "hidden_size": cfg.hidden_size,
        "moe_intermediate_size": cfg.moe_intermediate_size, "num_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.top_k, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "vocab_size": cfg.vocab_size,
    }  # fmt: skip


# ---- the hash ------------------------------------------------------------------------------------


def _mix_int(x: int) -> int:
    x ^= x >> 16
    x = (x * _C1) & _M32
    x ^= x >> 15
    x = (x * _C2) & _M32
    return x ^ (x >> 16)


def keys(seed: int, name: str) -> tuple[int, int]:
    """(k1, k2) of a tensor: from the seed and the CRC-32 of its name."""
    base = _mix_int((seed * 0x2545F491 + _SEED_TAG) & _M32)
    k1 = _mix_int(base ^ zlib.crc32(name.encode()))
    return k1, _mix_int(k1 ^ 0x68E31DA4)


def _mix_np(x: np.ndarray) -> np.ndarray:
    """In place on uint32: numpy's unsigned products wrap modulo 2**32, which is the `& _M32`
    torch needs in int64."""
    x ^= x >> np.uint32(16)
    x *= np.uint32(_C1)
    x ^= x >> np.uint32(15)
    x *= np.uint32(_C2)
    x ^= x >> np.uint32(16)
    return x


def indices_np(seed: int, name: str, start: int, count: int) -> np.ndarray:
    """[count] uint8 LUT indices of elements start .. start+count-1 of tensor `name` (numpy)."""
    k1, k2 = keys(seed, name)
    c0, c1 = start // 4, -(-(start + count) // 4)
    if c1 > 2**32:
        raise ValueError(f"{name}: {start + count} elements, past the 2**34 one tensor can have here")
    x = np.arange(c0, c1, dtype=np.uint32)
    x ^= np.uint32(k1)
    x = _mix_np(x)
    x ^= np.uint32(k2)
    x = _mix_np(x)
    raw = x.astype("<u4", copy=False).view(np.uint8)  # [4 * counters], byte 0 of each counter first
    lo = start - 4 * c0
    return raw[lo : lo + count]


def _mix_torch(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = (x * _C1) & _M32
    x = x ^ (x >> 15)
    x = (x * _C2) & _M32
    return x ^ (x >> 16)


def indices_torch(seed: int, name: str, start: int, count: int, device: torch.device | str) -> torch.Tensor:
    """[count] int64 LUT indices, the same integers as `indices_np` (int64 arithmetic, no overflow)."""
    import torch

    k1, k2 = keys(seed, name)
    c0, c1 = start // 4, -(-(start + count) // 4)
    x = torch.arange(c0, c1, dtype=torch.int64, device=device)  # [counters]
    x = _mix_torch(_mix_torch(x ^ k1) ^ k2)
    shifts = torch.tensor([0, 8, 16, 24], dtype=torch.int64, device=device)
    raw = ((x[:, None] >> shifts) & 0xFF).reshape(-1)  # [4 * counters], little-endian bytes
    lo = start - 4 * c0
    return raw[lo : lo + count]


# ---- values --------------------------------------------------------------------------------------


def lut_values(t: SourceTensor) -> np.ndarray:
    """[256] float32: the value of each LUT index for tensor `t` before its group offset (every
    one exact in bf16)."""
    q = np.asarray(LUT, dtype=np.int64)
    if t.kind == "norm":
        return (1.0 + (q >> NORM_SHIFT).astype(np.float64) * 2.0**NORM_EXPONENT).astype(np.float32)
    return (q.astype(np.float64) * 2.0**t.exponent).astype(np.float32)


def group_offsets(seed: int, t: SourceTensor) -> np.ndarray:
    """[groups] int: each group's power-of-two offset, 0 or -1 (a single 0 for ungrouped tensors)."""
    if not t.group_numel:
        return np.zeros(1, dtype=np.int64)
    k1, k2 = keys(seed, t.name)
    x = np.arange(t.numel // t.group_numel, dtype=np.uint32) ^ np.uint32(k2)
    x = _mix_np(x) ^ np.uint32(k1)
    return -(_mix_np(x) & np.uint32(1)).astype(np.int64)


def group_factors(seed: int, t: SourceTensor, start: int, count: int, step: int = 1) -> np.ndarray:
    """[ceil(count / step)] float32 factors 2**offset of elements start, start+step, .. (exact
    multipliers; `step` 32: one per Q8_0 block)."""
    factors = np.ldexp(np.float32(1), group_offsets(seed, t)).astype(np.float32)  # [groups]
    n = -(-count // step)
    if not t.group_numel:
        return np.broadcast_to(factors[0], (n,))
    return factors[(start + step * np.arange(n, dtype=np.int64)) // t.group_numel]


def values_np(seed: int, t: SourceTensor, start: int = 0, count: int | None = None) -> np.ndarray:
    """[count] float32 values of elements start.. of `t` (flat, numpy order)."""
    n = t.numel - start if count is None else count
    out = lut_values(t)[indices_np(seed, t.name, start, n)]
    if t.group_numel:  # one exact power of two per group, applied to each group's slice
        offsets = group_offsets(seed, t)
        for g in range(start // t.group_numel, -(-(start + n) // t.group_numel)):
            lo, hi = max(g * t.group_numel, start) - start, min((g + 1) * t.group_numel, start + n) - start
            if offsets[g]:
                out[lo:hi] *= np.float32(2.0 ** int(offsets[g]))
    for lo, hi in zero_spans(t, start, n):
        out[lo:hi] = 0
    return out


def zero_spans(t: SourceTensor, start: int, count: int) -> Iterator[tuple[int, int]]:
    """[lo, hi) spans, relative to `start`, of the zero rows within elements start .. start+count."""
    row = t.numel // t.shape[0] if t.zero_rows else 0
    for r in t.zero_rows:
        lo, hi = max(r * row, start), min((r + 1) * row, start + count)
        if lo < hi:
            yield lo - start, hi - start


def values_torch(
    seed: int,
    t: SourceTensor,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    start: int = 0,
    count: int | None = None,
) -> torch.Tensor:
    """`t`'s values as a torch tensor of its shape (or `count` flat elements from `start`) in
    `dtype` (default float32); the cast is exact for bf16, fp16 and fp32. On the CPU the values
    come from `values_np` (the same integers, ~10x faster than torch's int64 ops there); on an
    accelerator from `indices_torch` in slabs of SLAB elements (bounded temporary memory)."""
    import torch

    n = t.numel - start if count is None else count
    dtype = dtype or torch.float32
    if torch.device(device).type == "cpu":
        out = torch.from_numpy(values_np(seed, t, start, n)).to(dtype)
    else:
        out = values_slabs(seed, t, device, dtype, start, n)
    return out.reshape(t.shape) if count is None and start == 0 else out


def values_slabs(seed: int, t: SourceTensor, device: torch.device | str, dtype: torch.dtype, start: int,
                 count: int) -> torch.Tensor:  # fmt: skip
    """[count] flat values of `t` from `start`, computed on `device` by `indices_torch` in slabs of
    SLAB elements: `values_torch`'s accelerator path (any device runs it; tests compare it with numpy
    on the CPU)."""
    import torch

    lut = torch.from_numpy(lut_values(t)).to(device)  # [256]
    factors = torch.from_numpy(np.ldexp(np.float32(1), group_offsets(seed, t)).astype(np.float32)).to(device)
    out = torch.empty(count, dtype=dtype, device=device)
    for first in range(0, count, SLAB):
        m = min(SLAB, count - first)
        v = lut[indices_torch(seed, t.name, start + first, m, device)]  # [m] float32
        if t.group_numel:
            j = torch.arange(start + first, start + first + m, device=device)
            v *= factors[j // t.group_numel]
        out[first : first + m] = v.to(dtype)
    for lo, hi in zero_spans(t, start, count):
        out[lo:hi] = 0
    return out


def iter_torch(
    seed: int, hf: Mapping[str, Any], dtype: torch.dtype, silent_ids: tuple[int, ...] = ()
) -> Iterator[tuple[SourceTensor, torch.Tensor]]:
    """Every source tensor on the CPU, in checkpoint order."""
    for t in source_tensors(hf, silent_ids):
        yield t, values_torch(seed, t, "cpu", dtype)


# ---- identity ------------------------------------------------------------------------------------

RECIPE_SHAPE_KEYS = (
    "num_hidden_layers", "hidden_size", "moe_intermediate_size", "num_experts", "num_experts_per_tok",
    "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
)  # fmt: skip


def recipe(hf: Mapping[str, Any], seed: int, silent_ids: tuple[int, ...]) -> dict[str, Any]:
    """What a generated model's source weights are a function of (the preset's name is not: the
    FP8 preset of a shape quantizes the dense preset's tensors)."""
    ids = ",".join(map(str, silent_ids)).encode()
    return {
        "generator": GENERATOR,
        "generator_version": GENERATOR_VERSION,
        "seed": int(seed),
        "shape": {k: int(hf[k]) for k in RECIPE_SHAPE_KEYS},
        "silent_tokens": {"count": len(silent_ids), "sha256_16": hashlib.sha256(ids).hexdigest()[:16]},
    }


def recipe_id(r: Mapping[str, Any]) -> str:
    """`gen-` + 16 hex digits of the recipe's canonical JSON."""
    text = json.dumps(dict(r), sort_keys=True, separators=(",", ":"))
    return "gen-" + hashlib.sha256(text.encode()).hexdigest()[:16]


RECIPE_FILE = "source_weights.json"  # beside a checkpoint `paged_experts.weights.synth` wrote: its recipe record
RECIPE_COVERS = "the generator's recipe (the weights are a function of it), not the bytes in memory or on disk"


def recipe_record(hf: Mapping[str, Any], seed: int, silent_ids: tuple[int, ...]) -> dict[str, Any]:
    """{id, kind: recipe, covers, recipe}: a generated model's source-weights record."""
    r = recipe(hf, seed, silent_ids)
    return {"id": recipe_id(r), "kind": "recipe", "covers": RECIPE_COVERS, "recipe": r}
