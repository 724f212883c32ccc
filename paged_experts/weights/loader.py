"""HF checkpoint directory (config.json + safetensors, sharded or not) -> host store + device weights.

Expert tensors are read one expert at a time straight into the host store (pinned on CUDA for
layers that page or offload); only the slots (paged), the whole layer (resident) or nothing
(offload, cpu) goes to the device, so all experts are never materialised on the device unless
the mode asks for it. Reads the per-expert layout published checkpoints use
(`model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight`) and the fused layout
transformers 5 may save (`mlp.experts.gate_up_proj [E, 2I, H]`, `mlp.experts.down_proj [E, H, I]`).

Block-FP8 checkpoints (`quantization_config.quant_method: fp8`, fp8.py): each FP8 weight has its
`weight_scale_inv`; expert weights and scales are copied as they are into an FP8 host store (and
slots), so pages move FP8 bytes; the attention projections stay FP8 on the device with their scales
(projection.linear reads them; `RuntimeConfig.dequantize_attention`, or q / k rows off the 128-row blocks,
dequantize them to the runtime dtype at load, as every other FP8 weight is). A missing scale, a scale
of the wrong shape or a weight of the wrong dtype is refused with one line naming the tensor.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from paged_experts import fp8
from paged_experts.config import MoeModelConfig
from paged_experts.kernels.copy_kernel import copy_planned, graph_safe
from paged_experts.moe import MoeLayer, MoeShared, make_layer
from paged_experts.moe.staging import StagingRows
from paged_experts.residency.batch_copy import BatchCopy, BatchCopyUnavailable, driver_batch_copy
from paged_experts.residency.counters import PagingCounters
from paged_experts.residency.store import ExpertTensors, PageInEngine, SlotArena
from paged_experts.runtime import RuntimeConfig


@dataclass(frozen=True)
class AttentionWeights:
    """One layer's attention. The projections are dense in the compute dtype, or (a block-FP8 checkpoint's,
    unless `RuntimeConfig.dequantize_attention`) float8_e4m3fn with float32 128 x 128 block scales in the
    `*_scale` fields (None for dense ones): projection.linear takes either."""

    input_norm: torch.Tensor  # [H]
    q_proj: torch.Tensor  # [nh*D, H]
    k_proj: torch.Tensor  # [kvh*D, H]
    v_proj: torch.Tensor  # [kvh*D, H]
    o_proj: torch.Tensor  # [H, nh*D]
    q_norm: torch.Tensor  # [D]
    k_norm: torch.Tensor  # [D]
    post_norm: torch.Tensor  # [H]
    q_scale: torch.Tensor | None = None  # [nh*D/128, H/128] (FP8 projections only)
    k_scale: torch.Tensor | None = None  # [kvh*D/128, H/128]
    v_scale: torch.Tensor | None = None  # [kvh*D/128, H/128]
    o_scale: torch.Tensor | None = None  # [H/128, nh*D/128]
    qkv_proj: torch.Tensor = field(init=False, repr=False)  # [(nh + 2 kvh) D, H]
    qkv_scale: torch.Tensor | None = field(init=False, repr=False)  # [(nh + 2 kvh) D / 128, H / 128]

    def __post_init__(self) -> None:
        # q, k and v become views of one weight, so a step runs one projection GEMM instead of
        # three (three small GEMVs cost ~3x the launch and tail of one at decode), at no extra memory.
        scales = (self.q_scale, self.k_scale, self.v_scale, self.o_scale)
        if any(s is not None for s in scales) and not all(s is not None for s in scales):
            raise ValueError("block-FP8 attention needs the scales of all four projections")
        nq, nk = self.q_proj.shape[0], self.k_proj.shape[0]
        if self.q_scale is not None and (nq % fp8.BLOCK or nk % fp8.BLOCK):
            # the fused weight's scale rows must stay on 128-row block boundaries (loader.py checks first)
            raise ValueError(f"block-FP8 q/k/v rows {nq}, {nk} are not multiples of {fp8.BLOCK}: cannot fuse")
        qkv = torch.cat([self.q_proj, self.k_proj, self.v_proj])  # [(nh + 2 kvh) D, H]
        views: dict[str, torch.Tensor | None] = {
            "qkv_proj": qkv, "q_proj": qkv[:nq], "k_proj": qkv[nq : nq + nk], "v_proj": qkv[nq + nk :]
        }  # fmt: skip
        if self.q_scale is not None:
            assert self.k_scale is not None and self.v_scale is not None  # checked above
            qkv_s = torch.cat([self.q_scale, self.k_scale, self.v_scale])  # [(nh + 2 kvh) D / 128, H / 128]
            bq, bk = nq // fp8.BLOCK, nk // fp8.BLOCK
            views |= {"qkv_scale": qkv_s, "q_scale": qkv_s[:bq], "k_scale": qkv_s[bq : bq + bk],
                      "v_scale": qkv_s[bq + bk :]}  # fmt: skip
        else:
            views["qkv_scale"] = None
        for name, value in views.items():
            object.__setattr__(self, name, value)

    @property
    def fp8(self) -> bool:
        """Whether the projections are block-FP8."""
        return self.qkv_scale is not None

    def nbytes(self) -> int:
        """Device bytes of the layer's attention weights (projections, their scales, norms)."""
        tensors = (self.qkv_proj, self.o_proj, self.qkv_scale, self.o_scale, self.input_norm, self.q_norm,
                   self.k_norm, self.post_norm)  # fmt: skip
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


@dataclass(frozen=True)
class DenseWeights:
    embed: torch.Tensor  # [V, H]
    final_norm: torch.Tensor  # [H]
    lm_head: torch.Tensor  # [V, H]


@dataclass(frozen=True)
class LoadedModel:
    config: MoeModelConfig
    dense: DenseWeights
    attention: tuple[AttentionWeights, ...]
    moe: tuple[MoeLayer, ...]
    counters: PagingCounters


class CheckpointReader:
    """Tensor name -> safetensors file, across shards (model.safetensors.index.json) or single files."""

    def __init__(self, path: Path) -> None:
        self.path = path
        index = path / "model.safetensors.index.json"
        if index.is_file():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in path.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"no *.safetensors in {path}")
            weight_map = {}
        self._handles = {f: safe_open(str(path / f), framework="pt", device="cpu") for f in files}
        if not weight_map:
            for f, h in self._handles.items():
                for name in h.keys():
                    weight_map[name] = f
        self.weight_map = weight_map

    def has(self, name: str) -> bool:
        return name in self.weight_map

    def get(self, name: str) -> torch.Tensor:
        if name not in self.weight_map:
            raise KeyError(f"tensor {name!r} not found in checkpoint {self.path}")
        return self._handles[self.weight_map[name]].get_tensor(name)


def _checked(reader: CheckpointReader, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Reads a tensor and insists on its shape: `copy_` would silently broadcast a wrong one."""
    t = reader.get(name)
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} has shape {tuple(t.shape)}, config.json implies {shape}")
    return t


def _scale_name(weight_name: str) -> str:
    return weight_name.removesuffix("weight") + fp8.SCALE_SUFFIX


def _checked_fp8(
    reader: CheckpointReader, name: str, shape: tuple[int, int], dense_hint: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """An FP8 weight and its block scales, dtype and shapes checked: ([O, I] fp8, [O/128, I/128] fp32).
    dense_hint: the refusal of a weight stored otherwise names the option that loads it dense (attention)."""
    w = _checked(reader, name, shape)
    if w.dtype != fp8.FP8_DTYPE:
        hint = " (--dequantize-attention loads a checkpoint whose attention is not FP8)" if dense_hint else ""
        raise ValueError(f"{name} is {w.dtype}, a block-FP8 checkpoint stores it as {fp8.FP8_DTYPE}{hint}")
    scale_name = _scale_name(name)
    if not reader.has(scale_name):
        raise ValueError(f"{scale_name} is missing: FP8 weight {name} has no block scales")
    scale = reader.get(scale_name)
    want = fp8.scale_shape(*shape)
    if tuple(scale.shape) != want:
        raise ValueError(
            f"{scale_name} has shape {tuple(scale.shape)}, "
            f"{fp8.BLOCK}x{fp8.BLOCK} blocks of {name} {shape} imply {want}"
        )
    return w, scale.to(torch.float32)


def _dense_weight(reader: CheckpointReader, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A non-expert weight in `dtype`: FP8 ones (those with block scales) dequantized."""
    t = reader.get(name) if reader.has(name) else None
    if t is not None and t.dtype == fp8.FP8_DTYPE and len(shape) == 2:
        w, scale = _checked_fp8(reader, name, (shape[0], shape[1]))
        return fp8.dequantize(w, scale, dtype)
    return _checked(reader, name, shape).to(dtype)


def _fill_host_experts(reader: CheckpointReader, layer: int, host: ExpertTensors, cfg: MoeModelConfig) -> None:
    prefix = f"model.layers.{layer}.mlp.experts"
    e_n, h, inter = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    if host.is_fp8:
        shapes = {"gate": (inter, h), "up": (inter, h), "down": (h, inter)}
        for e in range(e_n):
            for w, shape in shapes.items():
                q, scale = _checked_fp8(reader, f"{prefix}.{e}.{w}_proj.weight", shape)
                fp8.raw(host.get(w)[e]).copy_(fp8.raw(q))
                host.get(f"{w}_scale")[e].copy_(scale)
        return
    if reader.has(f"{prefix}.gate_up_proj"):
        gate_up = _checked(reader, f"{prefix}.gate_up_proj", (e_n, 2 * inter, h))  # [E, 2I, H]
        host.gate.copy_(gate_up[:, :inter])
        host.up.copy_(gate_up[:, inter:])
        host.down.copy_(_checked(reader, f"{prefix}.down_proj", (e_n, h, inter)))  # [E, H, I]
        return
    for e in range(e_n):
        host.gate[e].copy_(_checked(reader, f"{prefix}.{e}.gate_proj.weight", (inter, h)))  # [I, H]
        host.up[e].copy_(_checked(reader, f"{prefix}.{e}.up_proj.weight", (inter, h)))  # [I, H]
        host.down[e].copy_(_checked(reader, f"{prefix}.{e}.down_proj.weight", (h, inter)))  # [H, I]


def load(path: str | Path, runtime: RuntimeConfig) -> LoadedModel:
    path = Path(path)
    cfg = MoeModelConfig.from_dir(path)
    runtime.validate_for(cfg)
    reader = CheckpointReader(path)
    device, dtype = runtime.torch_device, runtime.torch_dtype

    def dense(name: str, *shape: int) -> torch.Tensor:
        return _dense_weight(reader, name, shape, dtype).to(device=device)

    h, v, d = cfg.hidden_size, cfg.vocab_size, cfg.head_dim
    embed = dense("model.embed_tokens.weight", v, h)
    tied = cfg.tie_word_embeddings or not reader.has("lm_head.weight")
    lm_head = embed if tied else dense("lm_head.weight", v, h)
    dense_weights = DenseWeights(embed=embed, final_norm=dense("model.norm.weight", h), lm_head=lm_head)

    shared, placements = build_shared(cfg, runtime)
    keep_fp8 = cfg.fp8_attention(runtime.dequantize_attention)

    attention, moe = [], []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}"
        a = f"{p}.self_attn"
        shapes = {"q": (cfg.num_heads * d, h), "k": (cfg.num_kv_heads * d, h), "v": (cfg.num_kv_heads * d, h),
                  "o": (h, cfg.num_heads * d)}  # fmt: skip
        names = {n: f"{a}.{n}_proj.weight" for n in shapes}
        # a block-FP8 checkpoint's projections stay FP8 (all four: the q/k/v weight is fused); _checked_fp8 refuses one
        # stored otherwise, so the memory projection and the weights' format fact (both from config.json) hold
        if keep_fp8:
            held = {n: _checked_fp8(reader, names[n], shapes[n], dense_hint=True) for n in shapes}
            projections = {f"{n}_proj": w.to(device) for n, (w, _) in held.items()}
            projections |= {f"{n}_scale": s.to(device) for n, (_, s) in held.items()}
        else:
            projections = {f"{n}_proj": dense(names[n], *shapes[n]) for n in shapes}
        attention.append(
            AttentionWeights(
                input_norm=dense(f"{p}.input_layernorm.weight", h),
                q_norm=dense(f"{a}.q_norm.weight", d),
                k_norm=dense(f"{a}.k_norm.weight", d),
                post_norm=dense(f"{p}.post_attention_layernorm.weight", h),
                **projections,
            )
        )
        placement = placements[i]
        # Only rows that cross the link need pinned memory; cpu layers compute from pageable RAM.
        pin = device.type == "cuda" and placement in ("paged", "offload")
        host = ExpertTensors.empty(
            cfg.num_experts,
            cfg.hidden_size,
            cfg.moe_intermediate_size,
            dtype,
            torch.device("cpu"),
            pin=pin,
            is_fp8=cfg.fp8_weights,
            packed=runtime.packs_rows(placement),
        )
        _fill_host_experts(reader, i, host, cfg)
        router = dense(f"{p}.mlp.gate.weight", cfg.num_experts, h)
        moe.append(make_layer(i, placement, router, host, shared, cfg, runtime))
    return LoadedModel(
        config=cfg, dense=dense_weights, attention=tuple(attention), moe=tuple(moe), counters=shared.counters
    )


def build_shared(cfg: MoeModelConfig, runtime: RuntimeConfig) -> tuple[MoeShared, list[str]]:
    """What every MoE layer of a model shares (counters, page-in engine, offload buffer), and each
    layer's placement; one definition for checkpoints and for in-memory synthetic models."""
    device, dtype = runtime.torch_device, runtime.torch_dtype
    expert_bytes = cfg.expert_bytes(cfg.expert_dtype(runtime.dtype))  # FP8: weights + block scales
    counters = PagingCounters(cfg.num_moe_layers, expert_bytes, runtime.mode)
    placements = [runtime.layer_mode(i, cfg.num_moe_layers) for i in range(cfg.num_layers)]
    # the most rows one copy takes: a wave's page-ins (at most K), or a step's staged experts (page_in 'staged'
    # copies through buffers of this many rows, and a prefill stages up to prefill_staging_rows at once)
    max_slots = max(runtime.resident_experts or cfg.num_experts, runtime.prefill_staging_rows)
    h, inter, is_fp8 = cfg.hidden_size, cfg.moe_intermediate_size, cfg.fp8_weights
    row_kernel = copy_planned if graph_safe(device) else None  # FP8 scale rows of a direct page-in
    packed = runtime.rows_layout == "packed"  # the paged and offloaded layers' rows (RuntimeConfig.packs_rows)
    page_in = PageInEngine(
        device, runtime.page_in, h, inter, dtype, max_slots, is_fp8=is_fp8, row_kernel=row_kernel,
        batch_copy=_batch_copy(device) if runtime.page_in == "batch" else None, packed=packed,
    )  # fmt: skip
    staging = None
    if runtime.prefill_staging_rows:  # mode paged (RuntimeConfig): rows every paged layer shares
        rows = ExpertTensors.empty(runtime.prefill_staging_rows, h, inter, dtype, device, is_fp8=is_fp8, packed=packed)
        staging = StagingRows(rows)
    slots = None
    paged_layers = placements.count("paged")
    if packed and paged_layers:  # one allocation for every paged layer's slot rows (SlotArena says why)
        pitch = ExpertTensors.packed_layout(h, inter, dtype, is_fp8)[1]
        assert runtime.resident_experts is not None  # a paged layer's K (RuntimeConfig)
        slots = SlotArena(paged_layers, runtime.resident_experts, pitch, device)
    offload_buffer = None
    if "offload" in placements:
        offload_buffer = ExpertTensors.empty(cfg.num_experts, h, inter, dtype, device, is_fp8=is_fp8, packed=packed)
    shared = MoeShared(
        device=device,
        dtype=dtype,
        num_experts=cfg.num_experts,
        top_k=cfg.top_k,
        norm_topk_prob=cfg.norm_topk_prob,
        kernel_backend=runtime.kernel_backend,
        expert_bytes=expert_bytes,
        counters=counters,
        page_in=page_in,
        offload_buffer=offload_buffer,
        staging=staging,
        slots=slots,
    )
    return shared, placements


def _batch_copy(device: torch.device) -> BatchCopy | None:
    """page_in 'batch': the driver's batch copy on CUDA (a driver without one is a configuration error that names
    the driver's version), the engine's memmoves on the CPU."""
    if device.type != "cuda":
        return None
    try:
        return driver_batch_copy(device)
    except BatchCopyUnavailable as e:
        raise ValueError(f"page_in='batch': {e}") from e
