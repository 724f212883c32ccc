"""A model named the way a matrix's `model:` option names one, read as its shape (paged_experts.shape)
without weights: what `benchsuite preflight --model` accepts.

- a checkpoint directory or its config.json;
- a generated preset (`tiny`, `tiny-fp8`, `qwen3-30b-a3b-shape`, ...) or `synth:PRESET?layers=N`
  (paged_experts.weights.synth; the vocabulary taken at the preset's BPE bound, since the real one
  is learned when the checkpoint is generated);
- a well-known MoE model by name (`KNOWN`, case-insensitive, with or without its hub organisation):
  the config.json fields of its public model card (DeepSeek-V3: latent attention, whose KV per token
  is one 512 + 64 latent per layer, three dense first layers and one shared expert per MoE layer,
  all read by paged_experts.shape as from its config.json; its multi-token-prediction layer, used
  only for speculative decoding, is not counted).
Anything else is an error naming the closest known names.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

from benchsuite.errors import UserError
from paged_experts.shape import ModelShape

SYNTH_PREFIX = "synth:"

_QWEN3_VOCAB = {"vocab_size": 151936, "tie_word_embeddings": False}
KNOWN: dict[str, dict[str, Any]] = {
    "Qwen/Qwen3-30B-A3B": {
        "model_type": "qwen3_moe", "num_hidden_layers": 48, "hidden_size": 2048, "intermediate_size": 6144,
        "moe_intermediate_size": 768, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
        "num_experts": 128, "num_experts_per_tok": 8, **_QWEN3_VOCAB,
    },
    "Qwen/Qwen3-235B-A22B": {
        "model_type": "qwen3_moe", "num_hidden_layers": 94, "hidden_size": 4096, "intermediate_size": 12288,
        "moe_intermediate_size": 1536, "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128,
        "num_experts": 128, "num_experts_per_tok": 8, **_QWEN3_VOCAB,
    },
    "mistralai/Mixtral-8x7B-v0.1": {
        "model_type": "mixtral", "num_hidden_layers": 32, "hidden_size": 4096, "intermediate_size": 14336,
        "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2,
        "vocab_size": 32000, "tie_word_embeddings": False,
    },
    "deepseek-ai/DeepSeek-V3": {
        "model_type": "deepseek_v3", "num_hidden_layers": 61, "first_k_dense_replace": 3, "moe_layer_freq": 1,
        "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
        "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
        "num_attention_heads": 128, "num_key_value_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "vocab_size": 129280, "tie_word_embeddings": False,
    },
    "openai/gpt-oss-20b": {
        "model_type": "gpt_oss", "num_hidden_layers": 24, "hidden_size": 2880, "intermediate_size": 2880,
        "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "num_local_experts": 32,
        "num_experts_per_tok": 4, "vocab_size": 201088, "tie_word_embeddings": False,
    },
    "openai/gpt-oss-120b": {
        "model_type": "gpt_oss", "num_hidden_layers": 36, "hidden_size": 2880, "intermediate_size": 2880,
        "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "num_local_experts": 128,
        "num_experts_per_tok": 4, "vocab_size": 201088, "tie_word_embeddings": False,
    },
}  # fmt: skip


def model_shape(value: str) -> ModelShape:
    """The shape of the model `value` names (module docstring); UserError with the closest names."""
    path = Path(value).expanduser()
    if path.exists():
        config = path / "config.json" if path.is_dir() else path
        if not config.is_file():
            raise UserError(f"--model {value}: no config.json in that directory")
        try:
            return ModelShape.from_dir(config)
        except (ValueError, OSError) as exc:
            raise UserError(f"--model {value}: {exc}") from None
    preset = _preset_shape(value)
    if preset is not None:
        return preset
    known = _known(value)
    if known is not None:
        return ModelShape.from_hf_config(KNOWN[known], name=known)
    raise UserError(f"--model {value!r}: no such directory, preset or known model{_did_you_mean(value)}")


def _preset_shape(value: str) -> ModelShape | None:
    name, _, query = value.removeprefix(SYNTH_PREFIX).partition("?")
    from paged_experts.weights.synth import PRESETS, hf_config_for  # torch: only for a preset

    preset = PRESETS.get(name)
    if preset is None:
        return None
    cfg = hf_config_for(preset, preset.bpe_vocab_size, 0, 1)
    for part in query.split("&") if query else ():
        key, _, number = part.partition("=")
        if key != "layers" or not number.isdigit() or int(number) < 1:
            raise UserError(f"--model {value}: only `?layers=N` (N >= 1) may follow a preset")
        cfg = {**cfg, "num_hidden_layers": int(number), "max_window_layers": int(number)}
    return ModelShape.from_hf_config(cfg, name=value)


def _known(value: str) -> str | None:
    wanted = value.lower()
    for name in KNOWN:
        if wanted in (name.lower(), name.split("/")[-1].lower()):
            return name
    return None


def names() -> list[str]:
    """Every name `model_shape` knows beyond paths: presets and well-known models."""
    from paged_experts.weights.synth import PRESETS

    return [*PRESETS, *(name.split("/")[-1] for name in KNOWN)]


def _did_you_mean(value: str) -> str:
    close = difflib.get_close_matches(value.lower(), [n.lower() for n in names()], n=3, cutoff=0.5)
    spelled = {n.lower(): n for n in names()}
    if close:
        return "; did you mean " + " or ".join(spelled[c] for c in close) + "?"
    return f"; known: {', '.join(names())}"
