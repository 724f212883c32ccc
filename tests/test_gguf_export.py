"""GGUF export of a generated checkpoint: names, shapes, byte-matched tensors, metadata, tokenizer."""

from __future__ import annotations

import json
import shutil

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from benchsuite.engines.llamacpp.gguf_export import cached_export, export_gguf
from benchsuite.errors import UserError
from paged_experts.weights.synth import write_checkpoint

LAYERS = 2


@pytest.fixture(scope="module")
def ckpt_f32(tmp_path_factory):
    return write_checkpoint("tiny", tmp_path_factory.mktemp("f32") / "ckpt", layers=LAYERS)


@pytest.fixture(scope="module")
def ckpt_bf16(ckpt_f32, tmp_path_factory):
    """The same checkpoint stored in bfloat16 (cast here: training a second tokenizer is slow)."""
    out = tmp_path_factory.mktemp("bf16") / "ckpt"
    out.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ckpt_f32 / name, out / name)
    cfg = json.loads((ckpt_f32 / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, "torch_dtype": "bfloat16"}))
    save_file(
        {k: v.to(torch.bfloat16) for k, v in _hf(ckpt_f32).items()},
        str(out / "model.safetensors"),
    )
    return out


def _hf(path):
    return load_file(str(path / "model.safetensors"))


def _tensors(path):
    reader = gguf.GGUFReader(path)
    return reader, {t.name: t for t in reader.tensors}


def _field(reader, name):
    return reader.fields[name].contents()


def test_f32_export_is_byte_identical_with_stacked_experts(ckpt_f32, tmp_path):
    out = tmp_path / "m.gguf"
    summary = export_gguf(ckpt_f32, out, "f32")
    hf = _hf(ckpt_f32)
    cfg = json.loads((ckpt_f32 / "config.json").read_text())
    _, tensors = _tensors(out)
    assert summary.num_tensors == len(tensors) == 1 + LAYERS * 12 + 2
    assert bytes(tensors["token_embd.weight"].data) == hf["model.embed_tokens.weight"].numpy().tobytes()
    assert bytes(tensors["output.weight"].data) == hf["lm_head.weight"].numpy().tobytes()
    assert (
        bytes(tensors["blk.1.attn_k_norm.weight"].data)
        == hf["model.layers.1.self_attn.k_norm.weight"].numpy().tobytes()
    )
    assert (
        bytes(tensors["blk.0.ffn_norm.weight"].data)
        == hf["model.layers.0.post_attention_layernorm.weight"].numpy().tobytes()
    )
    assert bytes(tensors["blk.1.ffn_gate_inp.weight"].data) == hf["model.layers.1.mlp.gate.weight"].numpy().tobytes()
    E, inter, H = cfg["num_experts"], cfg["moe_intermediate_size"], cfg["hidden_size"]
    for proj, shape in (("gate", (E, inter, H)), ("up", (E, inter, H)), ("down", (E, H, inter))):
        t = tensors[f"blk.1.ffn_{proj}_exps.weight"]
        assert tuple(int(x) for x in reversed(t.shape)) == shape  # numpy order [E, ...]
        stacked = torch.stack([hf[f"model.layers.1.mlp.experts.{e}.{proj}_proj.weight"] for e in range(E)])
        assert bytes(t.data) == stacked.numpy().tobytes()


def test_metadata_and_tokenizer(ckpt_f32, tmp_path):
    out = tmp_path / "m.gguf"
    export_gguf(ckpt_f32, out, "f32")
    cfg = json.loads((ckpt_f32 / "config.json").read_text())
    tok = json.loads((ckpt_f32 / "tokenizer.json").read_text())
    reader, _ = _tensors(out)
    assert _field(reader, "general.architecture") == "qwen3moe"
    expect = {
        "qwen3moe.block_count": LAYERS,
        "qwen3moe.embedding_length": cfg["hidden_size"],
        "qwen3moe.attention.head_count": cfg["num_attention_heads"],
        "qwen3moe.attention.head_count_kv": cfg["num_key_value_heads"],
        "qwen3moe.attention.key_length": cfg["head_dim"],
        "qwen3moe.expert_count": cfg["num_experts"],
        "qwen3moe.expert_used_count": cfg["num_experts_per_tok"],
        "qwen3moe.expert_feed_forward_length": cfg["moe_intermediate_size"],
        "tokenizer.ggml.eos_token_id": cfg["eos_token_id"],
        "tokenizer.ggml.bos_token_id": cfg["bos_token_id"],
    }
    assert {k: _field(reader, k) for k in expect} == expect
    assert _field(reader, "qwen3moe.rope.freq_base") == pytest.approx(cfg["rope_theta"])
    assert _field(reader, "tokenizer.ggml.model") == "gpt2"
    assert _field(reader, "tokenizer.ggml.pre") == "qwen2"
    tokens = _field(reader, "tokenizer.ggml.tokens")
    types = _field(reader, "tokenizer.ggml.token_type")
    assert len(tokens) == cfg["vocab_size"]
    for token, idx in list(tok["model"]["vocab"].items())[:50]:
        assert tokens[idx] == token and types[idx] == 1
    im_end = cfg["eos_token_id"]
    assert tokens[im_end] == "<|im_end|>" and types[im_end] == 3  # control token
    merges = _field(reader, "tokenizer.ggml.merges")
    first = tok["model"]["merges"][0]
    assert merges[0] == (first if isinstance(first, str) else " ".join(first))


def test_bf16_export_keeps_stored_bytes_and_norms_and_router_in_f32(ckpt_bf16, tmp_path):
    out = tmp_path / "m.gguf"
    export_gguf(ckpt_bf16, out, "bf16")
    hf = _hf(ckpt_bf16)
    _, tensors = _tensors(out)
    exps = tensors["blk.0.ffn_up_exps.weight"]
    assert exps.tensor_type == gguf.GGMLQuantizationType.BF16
    stacked = torch.stack([hf[f"model.layers.0.mlp.experts.{e}.up_proj.weight"] for e in range(32)])
    assert bytes(exps.data) == stacked.view(torch.int16).numpy().tobytes()
    norm = tensors["blk.0.attn_norm.weight"]
    assert norm.tensor_type == gguf.GGMLQuantizationType.F32
    assert np.array_equal(
        np.asarray(norm.data),
        hf["model.layers.0.input_layernorm.weight"].float().numpy(),
    )
    assert tensors["blk.0.ffn_gate_inp.weight"].tensor_type == gguf.GGMLQuantizationType.F32


def test_q8_0_export_matches_the_reference_quantizer(ckpt_f32, tmp_path):
    out = tmp_path / "m.gguf"
    export_gguf(ckpt_f32, out, "q8_0")
    hf = _hf(ckpt_f32)
    _, tensors = _tensors(out)
    t = tensors["blk.0.attn_q.weight"]
    assert t.tensor_type == gguf.GGMLQuantizationType.Q8_0
    ref = gguf.quants.quantize(
        hf["model.layers.0.self_attn.q_proj.weight"].numpy(),
        gguf.GGMLQuantizationType.Q8_0,
    )
    assert bytes(t.data) == ref.tobytes()
    deq = gguf.quants.dequantize(np.asarray(t.data), gguf.GGMLQuantizationType.Q8_0)
    np.testing.assert_allclose(
        deq.reshape(ref.shape[0], -1),
        hf["model.layers.0.self_attn.q_proj.weight"].numpy(),
        atol=0.02,
    )


def test_cached_export_reuses_the_file(ckpt_f32, tmp_path):
    first = cached_export(ckpt_f32, "f32", cache_dir=tmp_path)
    mtime = first.stat().st_mtime_ns
    assert cached_export(ckpt_f32, "f32", cache_dir=tmp_path) == first
    assert first.stat().st_mtime_ns == mtime


def test_refuses_unsupported_checkpoints(ckpt_f32, tmp_path):
    with pytest.raises(UserError, match="--type"):
        export_gguf(ckpt_f32, tmp_path / "x.gguf", "q4_k")
    with pytest.raises(UserError, match="config.json"):
        export_gguf(tmp_path, tmp_path / "x.gguf", "f32")
    assert not (tmp_path / "x.gguf").exists()


def test_q8_0_export_of_an_fp8_checkpoint_serves_its_values_at_matched_bytes(tmp_path) -> None:
    """`--type q8_0` of a block-FP8 checkpoint: the FP8 weights dequantized with their scales, then
    Q8_0 (no scale tensor leaks into the GGUF); bytes per expert side by side with the FP8 store."""
    from benchsuite.engines.llamacpp.gguf_export import expert_facts
    from paged_experts import fp8
    from paged_experts.config import MoeModelConfig

    ckpt = write_checkpoint("tiny-fp8", tmp_path / "ckpt", layers=1)
    out = export_gguf(ckpt, tmp_path / "m.gguf", "q8_0").path
    reader = gguf.GGUFReader(out)
    tensors = {t.name: t for t in reader.tensors}
    assert not any("scale" in name for name in tensors)
    hf = load_file(str(ckpt / "model.safetensors"))
    down = tensors["blk.0.ffn_down_exps.weight"]
    assert down.tensor_type == gguf.GGMLQuantizationType.Q8_0
    got = gguf.quants.dequantize(down.data, down.tensor_type)[3]  # [H, I] of expert 3
    name = "model.layers.0.mlp.experts.3.down_proj"
    want = fp8.dequantize(hf[f"{name}.weight"], hf[f"{name}.weight_scale_inv"], torch.float32).numpy()
    assert np.abs(got - want).max() <= np.abs(want).max() / 127 + 1e-6  # Q8_0: one int8 step of a 32-block
    q = tensors["blk.0.attn_q.weight"]  # FP8 attention too: dequantized before Q8_0
    name = "model.layers.0.self_attn.q_proj"
    want = fp8.dequantize(hf[f"{name}.weight"], hf[f"{name}.weight_scale_inv"], torch.float32).numpy()
    assert np.abs(gguf.quants.dequantize(q.data, q.tensor_type) - want).max() <= np.abs(want).max() / 127 + 1e-6
    cfg = MoeModelConfig.from_dir(ckpt)
    h, i = cfg.hidden_size, cfg.moe_intermediate_size
    assert expert_facts(out) == {"expert_format": "q8_0", "expert_bytes": 3 * h * i * 34 // 32}
    assert cfg.expert_bytes("float8_e4m3fn") == 3 * h * i + 12 * fp8.blocks(h) * fp8.blocks(i) < 3 * h * i * 34 // 32
