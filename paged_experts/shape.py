"""`ModelShape`: a MoE model's shape and every byte size derived from it, written once, units in names.

Owns the reading of an HF `config.json` (qwen3_moe / qwen2_moe / mixtral / deepseek_v3 naming, a
VLM's `text_config`) into one frozen value, its construction from a GGUF's metadata (llama.cpp) or from
a generated preset, and the byte formulas of DESIGN.md section 3 that depend on the model alone:
one expert per stored format, one slot (an expert in every MoE layer), KV per token, the weights
that stay on the device, all experts (the pinned host store).

Latent attention (MLA, DeepSeek-V2/V3) caches one compressed latent per token and layer instead of
K and V heads: `kv_lora_rank + qk_rope_head_dim` values (DeepSeek-V3: 512 + 64), read from
config.json; its projections (a low-rank query, the latent's down- and up-projections) are counted
in the weights that stay on the device. Dense first layers (`first_k_dense_replace`) are not MoE
layers, and shared experts (`n_shared_experts` x `moe_intermediate_size`) sit in MoE layers only,
beside the routed ones, on the device. Formulas that combine these with a
machine (the K that fits a budget, miss rates, the link) live in `benchsuite.tools.preflight`; the
runtime's own config (`paged_experts.config.MoeModelConfig`) takes its sizes from here.

No torch: the suite reads shapes at matrix load and in the report without importing it.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

FP8_BLOCK = 128  # block-FP8: one float32 scale per 128 x 128 weight block
GPTQ_GROUP = 128  # GPTQ int4: one fp16 scale (and, if asymmetric, one 4-bit zero) per 128 inputs
FP8 = "float8_e4m3fn"  # the expert dtype of block-FP8 checkpoints
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
E_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")  # qwen / mixtral / deepseek naming
TOP_K_KEYS = ("num_experts_per_tok", "top_k", "moe_topk")
REQUIRED_FIELDS = ("num_hidden_layers", "hidden_size")  # what byte sizes need beyond E and top_k


def dtype_bytes(dtype: str) -> int:
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(DTYPE_BYTES)}")
    return DTYPE_BYTES[dtype]


@dataclass(frozen=True)
class ModelShape:
    """The shape facts of a MoE model. Expert projections are hidden <-> moe_intermediate; a field
    that is 0 was not given (a shape known only by E / top_k / layers has no byte sizes)."""

    num_layers: int  # all decoder layers (KV lives in every one)
    num_moe_layers: int
    num_experts: int
    top_k: int
    hidden_size: int = 0
    moe_intermediate_size: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    num_attention_heads: int = 0
    vocab_size: int = 0
    tie_word_embeddings: bool = False
    dense_intermediate_size: int = 0  # dense MLP width of non-MoE layers
    shared_expert_intermediate_size: int = 0  # all shared experts of one MoE layer together
    # latent attention (MLA); kv_lora_rank 0 = K/V heads (num_kv_heads x head_dim) are cached
    kv_lora_rank: int = 0  # width of the compressed KV latent that is cached
    qk_rope_head_dim: int = 0  # the decoupled RoPE key, one per token (not per head), cached beside it
    q_lora_rank: int = 0  # the query's low-rank width; 0 = a full-rank query projection
    qk_nope_head_dim: int = 0  # per head: query/key width without RoPE, recovered from the latent
    v_head_dim: int = 0  # per head: value width, recovered from the latent
    name: str = ""

    @property
    def has_dims(self) -> bool:
        return self.hidden_size > 0 and self.moe_intermediate_size > 0

    @property
    def kv_latent_size(self) -> int:
        """Values cached per token per layer by latent attention (`kv_lora_rank + qk_rope_head_dim`);
        0 for attention that caches K and V heads."""
        return self.kv_lora_rank + self.qk_rope_head_dim if self.kv_lora_rank else 0

    @property
    def knows_kv_size(self) -> bool:
        return self.kv_latent_size > 0 or (self.num_kv_heads > 0 and self.head_dim > 0)

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], name: str = "") -> ModelShape:
        """The fields of an HF MoE config.json; ValueError naming a missing MoE field (E, top_k).
        A field it lacks beyond those is 0 (`required_fields` says which a caller needs)."""
        cfg = cfg["text_config"] if isinstance(cfg.get("text_config"), dict) else cfg
        experts = next((cfg[k] for k in E_KEYS if cfg.get(k)), None)
        top_k = next((cfg[k] for k in TOP_K_KEYS if cfg.get(k)), None)
        if experts is None or top_k is None:
            missing = E_KEYS[-1] if experts is None else TOP_K_KEYS[0]
            raise ValueError(f"config.json lacks MoE field {missing!r} (not a MoE model?)")
        num_layers = int(cfg.get("num_hidden_layers") or 0)
        hidden = int(cfg.get("hidden_size") or 0)
        heads = int(cfg.get("num_attention_heads", 0))
        moe_intermediate = int(cfg.get("moe_intermediate_size") or cfg.get("intermediate_size") or 0)
        kv_lora = int(cfg.get("kv_lora_rank") or 0)
        rope, nope = int(cfg.get("qk_rope_head_dim") or 0), int(cfg.get("qk_nope_head_dim") or 0)
        # a DeepSeek config names no head_dim: its query/key head is nope + rope wide
        head_dim = int(cfg.get("head_dim") or (nope + rope if kv_lora else 0) or (hidden // heads if heads else 0))
        shared = int(cfg.get("shared_expert_intermediate_size") or 0) or (
            int(cfg.get("n_shared_experts") or 0) * moe_intermediate
        )
        return cls(
            num_layers=num_layers,
            num_moe_layers=_moe_layer_count(cfg, num_layers),
            num_experts=int(experts),
            top_k=int(top_k),
            hidden_size=hidden,
            moe_intermediate_size=moe_intermediate,
            num_kv_heads=int(cfg.get("num_key_value_heads", heads)),
            head_dim=head_dim,
            num_attention_heads=heads,
            vocab_size=int(cfg.get("vocab_size", 0)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            dense_intermediate_size=int(cfg.get("intermediate_size", 0)),
            shared_expert_intermediate_size=shared,
            kv_lora_rank=kv_lora,
            qk_rope_head_dim=rope if kv_lora else 0,
            q_lora_rank=int(cfg.get("q_lora_rank") or 0) if kv_lora else 0,
            qk_nope_head_dim=nope if kv_lora else 0,
            v_head_dim=int(cfg.get("v_head_dim") or 0) if kv_lora else 0,
            name=name or str(cfg.get("_name_or_path", "") or cfg.get("model_type", "")),
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelShape:
        """`path` is a checkpoint directory holding config.json, or the file itself."""
        p = Path(path).expanduser()
        config = p / "config.json" if p.is_dir() else p
        return cls.from_hf_config(json.loads(config.read_text()), name=config.parent.name)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    # ---------------------------------------------------------------- expert and slot sizes

    @property
    def expert_params(self) -> int:
        """gate + up ([I, H] each) and down ([H, I]): 3 x H x I weights per expert per layer."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    def expert_bytes_fp8_block(self) -> int:
        """1 byte per weight + one float32 scale per 128 x 128 block of each of the three matrices."""
        h, i = self.hidden_size, self.moe_intermediate_size
        return self.expert_params + 3 * 4 * math.ceil(h / FP8_BLOCK) * math.ceil(i / FP8_BLOCK)

    def expert_bytes_int4_gptq(self, zero_points: bool = False) -> int:
        """Half a byte per weight + one fp16 scale per group of 128 inputs per output column.

        Symmetric GPTQ (the Marlin path SGLang uses) keeps no zero points on the device: that is the
        published 2.43 MB. Asymmetric checkpoints add one packed 4-bit zero per group.
        """
        h, i = self.hidden_size, self.moe_intermediate_size
        groups = i * math.ceil(h / GPTQ_GROUP) * 2 + h * math.ceil(i / GPTQ_GROUP)  # gate+up, down
        per_group_bytes = 2.0 + (0.5 if zero_points else 0.0)
        return self.expert_params // 2 + int(groups * per_group_bytes)

    def expert_bytes(self, dtype: str) -> int:
        """One expert's gate, up and down projections stored as `dtype` (a torch dtype name, or
        `float8_e4m3fn`: block-FP8 with its float32 scales)."""
        if dtype == FP8:
            return self.expert_bytes_fp8_block()
        return self.expert_params * dtype_bytes(dtype)

    def slot_bytes(self, dtype: str) -> int:
        """One resident expert in every MoE layer: `slot_bytes = expert_bytes x num_moe_layers`."""
        return self.expert_bytes(dtype) * self.num_moe_layers

    def all_experts_bytes(self, dtype: str) -> int:
        """Every expert of every MoE layer (what the pinned host store holds): `E x slot_bytes`."""
        return self.num_experts * self.slot_bytes(dtype)

    def kv_bytes_per_token(self, kv_dtype_bytes: int) -> int:
        """`2 x layers x kv_heads x head_dim x kv_dtype_bytes` (K and V in every layer); with latent
        attention `layers x (kv_lora_rank + qk_rope_head_dim) x kv_dtype_bytes` (one latent per layer:
        DeepSeek-V3 bf16 61 x 576 x 2 = 70,272)."""
        if self.kv_latent_size:
            return self.num_layers * self.kv_latent_size * kv_dtype_bytes
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * kv_dtype_bytes

    def non_expert_weight_bytes(self, dtype_size_bytes: float = 2.0, fp8_attention: bool = False) -> int:
        """Weights that stay on the GPU: embeddings, LM head, attention, norms, routers, dense/shared MLPs.
        `fp8_attention`: the attention projections are block-FP8 (1 byte a weight + one float32 scale per
        128 x 128 block of each matrix, as SGLang and the built-in runtime keep a block-FP8 checkpoint's),
        the rest `dtype_size_bytes` a weight."""
        h, layers = self.hidden_size, self.num_layers
        if self.kv_latent_size:
            attention, norms = self._latent_attention_params()
            matrices: tuple[tuple[int, int], ...] = ()
        else:
            q_out = self.num_attention_heads * self.head_dim
            kv_out = self.num_kv_heads * self.head_dim
            attention = h * q_out * 2 + h * kv_out * 2  # q, o and k, v projections
            norms = 2 * h + 2 * self.head_dim  # input/post norms, q/k norms (qwen3)
            matrices = ((q_out, h), (kv_out, h), (kv_out, h), (h, q_out))
        fp8_bytes = 0
        if fp8_attention and matrices:  # the projections leave the dtype-sized params for their FP8 bytes
            blocks = sum(math.ceil(o / FP8_BLOCK) * math.ceil(i / FP8_BLOCK) for o, i in matrices)
            fp8_bytes = (attention + 4 * blocks) * layers
            attention = 0
        router = h * self.num_experts
        shared = 3 * h * self.shared_expert_intermediate_size  # in MoE layers only, beside the routed experts
        per_moe_layer = router + shared
        dense_mlp = 3 * h * self.dense_intermediate_size * (layers - self.num_moe_layers)
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        params = (attention + norms) * layers + per_moe_layer * self.num_moe_layers + dense_mlp + embeddings + h
        return int(params * dtype_size_bytes) + fp8_bytes

    def _latent_attention_params(self) -> tuple[int, int]:
        """(projections, norms) of one MLA layer: the query (low-rank down and up, or full rank), the
        latent's down-projection with the RoPE key, its up-projection to every head's key and value,
        the output; RMS norms on the layer's input and output, the query latent and the KV latent."""
        h, heads = self.hidden_size, self.num_attention_heads
        qk_head = self.qk_nope_head_dim + self.qk_rope_head_dim
        if self.q_lora_rank:
            query = h * self.q_lora_rank + self.q_lora_rank * heads * qk_head
        else:
            query = h * heads * qk_head
        latent_down = h * (self.kv_lora_rank + self.qk_rope_head_dim)
        latent_up = self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim)
        output = heads * self.v_head_dim * h
        norms = 2 * h + self.q_lora_rank + self.kv_lora_rank
        return query + latent_down + latent_up + output, norms


def _moe_layer_count(cfg: dict[str, Any], num_layers: int) -> int:
    """Layers with routed experts: qwen's `decoder_sparse_step` / `mlp_only_layers`, DeepSeek's dense
    first `first_k_dense_replace` layers and `moe_layer_freq` (as the HF models place them)."""
    step = int(cfg.get("decoder_sparse_step", 1) or 1)
    mlp_only = set(cfg.get("mlp_only_layers", []) or [])
    dense_first = int(cfg.get("first_k_dense_replace") or 0)
    freq = int(cfg.get("moe_layer_freq") or 1)
    return sum(
        1 for i in range(num_layers) if i not in mlp_only and (i + 1) % step == 0 and i >= dense_first and i % freq == 0
    )
