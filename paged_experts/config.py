"""`MoeModelConfig`: the model facts the runtime needs, read from a Hugging Face `config.json`.

Owns the mapping from HF field names (qwen3_moe) to the runtime's names and what the runtime
refuses (dense layers, attention bias, scaled RoPE). The byte sizes (one expert, one slot across
all MoE layers, KV per token) are the shape's (`paged_experts.shape.ModelShape`, via `.shape`);
preflight formulas that combine them with a machine's budget live in `benchsuite.tools.preflight`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from paged_experts import fp8
from paged_experts.shape import FP8, ModelShape, dtype_bytes

SUPPORTED_MODEL_TYPES = ("qwen3_moe",)

# fields the runtime cannot default (ModelShape reads a missing one as 0)
_REQUIRED = (
    "vocab_size",
    "hidden_size",
    "num_attention_heads",
    "moe_intermediate_size",
    "num_experts",
    "num_experts_per_tok",
)
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class MoeModelConfig:
    """A Qwen3-MoE model's shape. Every decoder layer is an MoE layer (no dense MLP layers)."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    moe_intermediate_size: int
    num_experts: int
    top_k: int
    norm_topk_prob: bool
    rms_norm_eps: float
    rope_theta: float
    bos_token_id: int | None
    eos_token_id: int | None
    tie_word_embeddings: bool
    torch_dtype: str
    max_position_embeddings: int = 40960
    model_type: str = "qwen3_moe"
    fp8_weights: bool = False  # quantization_config declares block-FP8 (fp8.py): experts stay FP8 on host and device

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k must be in [1, num_experts={self.num_experts}], got {self.top_k}")
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> MoeModelConfig:
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported model_type {model_type!r}; supported: {SUPPORTED_MODEL_TYPES}")
        num_layers = int(hf["num_hidden_layers"])
        sparse_step = int(hf.get("decoder_sparse_step", 1))
        mlp_only = list(hf.get("mlp_only_layers") or [])
        if sparse_step != 1 or mlp_only:
            raise ValueError(
                "dense MLP layers are not supported: need decoder_sparse_step == 1 and empty mlp_only_layers, "
                f"got decoder_sparse_step={sparse_step}, mlp_only_layers={mlp_only}"
            )
        if hf.get("attention_bias", False):
            raise ValueError("attention_bias=true is not supported (Qwen3-MoE has none)")
        rope_scaling = hf.get("rope_scaling")
        if rope_scaling not in (None, {}) and rope_scaling.get("rope_type", rope_scaling.get("type")) != "default":
            raise ValueError(f"rope_scaling {rope_scaling!r} is not supported; only plain RoPE")
        rope_theta = hf.get("rope_theta")
        if rope_theta is None:
            rope_theta = (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        missing = next((key for key in _REQUIRED if key not in hf), None)
        if missing is not None:
            raise KeyError(missing)
        shape = ModelShape.from_hf_config(hf)  # the shape's fields, read as everywhere else
        eos = hf.get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        return cls(
            vocab_size=shape.vocab_size,
            hidden_size=shape.hidden_size,
            num_layers=num_layers,
            num_heads=shape.num_attention_heads,
            num_kv_heads=shape.num_kv_heads,
            head_dim=shape.head_dim,
            moe_intermediate_size=shape.moe_intermediate_size,
            num_experts=shape.num_experts,
            top_k=shape.top_k,
            norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=eos,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            torch_dtype=str(hf.get("torch_dtype") or hf.get("dtype") or "bfloat16"),
            max_position_embeddings=int(hf.get("max_position_embeddings", 40960)),
            model_type=str(model_type),
            fp8_weights=fp8.fp8_declared(hf),
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> MoeModelConfig:
        config_path = Path(path) / "config.json"
        if not config_path.is_file():
            raise FileNotFoundError(f"no config.json in {path}")
        return cls.from_hf_config(json.loads(config_path.read_text()))

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers

    @property
    def shape(self) -> ModelShape:
        """The model's shape, owner of its byte sizes (paged_experts.shape)."""
        return ModelShape(
            num_layers=self.num_layers, num_moe_layers=self.num_moe_layers, num_experts=self.num_experts,
            top_k=self.top_k, hidden_size=self.hidden_size, moe_intermediate_size=self.moe_intermediate_size,
            num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, num_attention_heads=self.num_heads,
            vocab_size=self.vocab_size, tie_word_embeddings=self.tie_word_embeddings, name=self.model_type,
        )  # fmt: skip

    def expert_dtype(self, compute_dtype: str) -> str:
        """How experts are stored and paged: FP8 for a block-FP8 checkpoint, else the compute dtype."""
        return FP8 if self.fp8_weights else compute_dtype

    def fp8_attention(self, dequantize: bool = False) -> bool:
        """Whether the attention projections stay block-FP8 on the device: a block-FP8 checkpoint's do (as
        SGLang keeps them), unless `dequantize` (RuntimeConfig.dequantize_attention) or their q / k rows
        are off the 128-row blocks (the fused q/k/v weight needs its scale rows on block boundaries)."""
        rows = (self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim)
        return self.fp8_weights and not dequantize and all(r % fp8.BLOCK == 0 for r in rows)

    def expert_bytes(self, dtype: str | None = None) -> int:
        return self.shape.expert_bytes(dtype or self.torch_dtype)

    def slot_bytes(self, dtype: str | None = None) -> int:
        return self.shape.slot_bytes(dtype or self.torch_dtype)

    def kv_bytes_per_token(self, dtype: str | None = None) -> int:
        return self.shape.kv_bytes_per_token(dtype_bytes(dtype or self.torch_dtype))

    def all_experts_bytes(self, dtype: str | None = None) -> int:
        return self.shape.all_experts_bytes(dtype or self.torch_dtype)
