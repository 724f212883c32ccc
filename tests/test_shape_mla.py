"""Latent attention (MLA) and DeepSeek's layer layout in `paged_experts.shape.ModelShape`: the KV per
token is one (kv_lora_rank + qk_rope_head_dim) latent per layer, dense first layers are not MoE layers,
shared experts sit in MoE layers only; DeepSeek-V3 by name and from its config.json give the same shape,
whose parameters add up to the published 671B of the main model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchsuite.cli import main
from benchsuite.tools.model_names import KNOWN, model_shape
from paged_experts.shape import ModelShape

# DeepSeek-V3's config.json as published (deepseek-ai/DeepSeek-V3), the fields a shape reads and some it does not
DEEPSEEK_V3_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "first_k_dense_replace": 3,
    "hidden_act": "silu", "hidden_size": 7168, "intermediate_size": 18432, "kv_lora_rank": 512,
    "max_position_embeddings": 163840, "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8,
    "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "tie_word_embeddings": False,
    "topk_group": 4, "v_head_dim": 128, "vocab_size": 129280,
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]},
}  # fmt: skip


def test_deepseek_v3_kv_is_one_latent_per_layer() -> None:
    shape = model_shape("DeepSeek-V3")
    assert shape.kv_latent_size == 512 + 64
    assert shape.kv_bytes_per_token(2) == (512 + 64) * 61 * 2 == 70_272  # not 2 x 61 x 128 heads x head_dim x 2
    assert shape.kv_bytes_per_token(1) == 35_136


def test_deepseek_v3_layers_experts_and_total_parameters() -> None:
    shape = model_shape("deepseek-ai/DeepSeek-V3")
    assert (shape.num_layers, shape.num_moe_layers, shape.num_experts, shape.top_k) == (61, 58, 256, 8)
    assert shape.shared_expert_intermediate_size == 2048 and shape.dense_intermediate_size == 18432
    assert shape.expert_params == 3 * 7168 * 2048
    routed = shape.num_experts * shape.num_moe_layers * shape.expert_params
    total = shape.non_expert_weight_bytes(1.0) + routed
    # the published main model: 671B parameters (the 14B multi-token-prediction layer aside)
    assert total == pytest.approx(671e9, rel=0.001)
    assert routed == pytest.approx(653.9e9, rel=0.001)


def test_a_real_deepseek_v3_config_json_reads_as_the_named_shape(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(DEEPSEEK_V3_CONFIG))
    from_file = ModelShape.from_dir(tmp_path)
    by_name = model_shape("DeepSeek-V3")
    assert {**from_file.as_dict(), "name": ""} == {**by_name.as_dict(), "name": ""}
    assert set(KNOWN["deepseek-ai/DeepSeek-V3"].items()) <= set(
        (k, v) for k, v in DEEPSEEK_V3_CONFIG.items() if not isinstance(v, (list, dict))
    )  # the bundled entry is the published config's fields, none invented


def test_grouped_query_shapes_are_unchanged() -> None:
    qwen = model_shape("Qwen3-30B-A3B")
    assert qwen.kv_latent_size == 0 and qwen.kv_bytes_per_token(2) == 98_304
    assert qwen.num_moe_layers == 48
    # the published total of Qwen3-30B-A3B: 30.5B parameters
    total = qwen.non_expert_weight_bytes(1.0) + qwen.num_experts * qwen.num_moe_layers * qwen.expert_params
    assert total == pytest.approx(30.5e9, rel=0.005)


def test_a_shared_expert_counts_in_moe_layers_only() -> None:
    base = dict(num_experts=8, num_experts_per_tok=2, num_hidden_layers=4, hidden_size=16, moe_intermediate_size=8,
                intermediate_size=32, num_attention_heads=2, num_key_value_heads=2, vocab_size=10)  # fmt: skip
    all_moe = ModelShape.from_hf_config({**base, "n_shared_experts": 1})
    one_dense = ModelShape.from_hf_config({**base, "n_shared_experts": 1, "first_k_dense_replace": 1})
    assert (all_moe.num_moe_layers, one_dense.num_moe_layers) == (4, 3)
    shared, router, dense = 3 * 16 * 8, 16 * 8, 3 * 16 * 32
    assert one_dense.non_expert_weight_bytes(1.0) - all_moe.non_expert_weight_bytes(1.0) == dense - shared - router


def test_preflight_by_name_prints_the_latent_kv(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["preflight", "--model", "DeepSeek-V3", "--vram-gb", "141", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["num_moe_layers"], report["num_experts"], report["kv_bytes_per_token_bf16"]) == (58, 256, 70_272)
    assert {f["format"] for f in report["formats"]} >= {"fp8"}
