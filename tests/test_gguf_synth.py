"""benchsuite.engines.llamacpp.gguf_synth: the synthetic GGUF has gguf_export's layout, the planned types, the
tokenizer's own vocabulary (no padding), values near the synth standard deviations, and bytes that do not depend on
the worker count. That its values are the built-in model's is tests/test_weightgen.py."""

from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np
import pytest

from benchsuite.engines.llamacpp.gguf_export import export_gguf, iter_tensor_bytes, plan_tensors
from benchsuite.engines.llamacpp.gguf_synth import LUT8, LUT_STD, expert_bytes, synthetic_shapes, write_synthetic_gguf
from paged_experts.weights.synth import PRESETS, hf_config_for
from paged_experts.weights.weightgen import exponent_for


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_synthetic_gguf(tmp_path_factory.mktemp("g") / "tiny.gguf", preset="tiny", layers=2, workers=2).path


def test_lut_is_symmetric_normal_quantiles() -> None:
    assert LUT8.min() == -127 and LUT8.max() == 127
    assert np.array_equal(LUT8, -LUT8[::-1])
    # 256 equally likely levels of N(0, 1) scaled by 127 / 2.886 (the top level): std ~ 127 / 2.886
    assert LUT_STD == pytest.approx(127 / 2.886, rel=0.01)


def test_types_metadata_and_value_scales(tiny_gguf: Path) -> None:
    p = PRESETS["tiny"]
    reader = gguf.GGUFReader(tiny_gguf)
    types = {t.name: t.tensor_type for t in reader.tensors}
    assert types["blk.0.ffn_gate_exps.weight"] == gguf.GGMLQuantizationType.Q8_0
    assert types["blk.1.ffn_down_exps.weight"] == gguf.GGMLQuantizationType.Q8_0
    assert types["blk.0.attn_q.weight"] == gguf.GGMLQuantizationType.Q8_0  # as llama-quantize types a Q8_0 file
    assert types["blk.1.attn_output.weight"] == gguf.GGMLQuantizationType.Q8_0
    assert types["token_embd.weight"] == gguf.GGMLQuantizationType.BF16
    assert types["blk.0.ffn_gate_inp.weight"] == gguf.GGMLQuantizationType.F32
    assert types["blk.0.attn_norm.weight"] == gguf.GGMLQuantizationType.F32
    assert reader.fields["qwen3moe.block_count"].contents() == 2
    assert reader.fields["qwen3moe.expert_count"].contents() == p.num_experts
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    assert len(tokens) == 1042 < p.bpe_vocab_size  # the tokenizer's size: the preset's bound is not reached
    assert not any(t.startswith("[PAD") for t in tokens)
    by_name = {t.name: t for t in reader.tensors}
    gate = gguf.quants.dequantize(by_name["blk.0.ffn_gate_exps.weight"].data, gguf.GGMLQuantizationType.Q8_0)
    down = gguf.quants.dequantize(by_name["blk.1.ffn_down_exps.weight"].data, gguf.GGMLQuantizationType.Q8_0)
    # a power of two near sigma times the LUT (within a factor sqrt(2)), each expert at that or half of it
    assert 0.5 / math.sqrt(p.hidden_size) / 1.42 < gate.std() < 1.42 / math.sqrt(p.hidden_size)
    assert 0.5 / math.sqrt(p.moe_intermediate_size) / 1.42 < down.std() < 1.42 / math.sqrt(p.moe_intermediate_size)
    assert abs(gate.mean()) < 0.05 * gate.std()
    q = gguf.quants.dequantize(by_name["blk.0.attn_q.weight"].data, gguf.GGMLQuantizationType.Q8_0)
    assert q.std() == pytest.approx(LUT_STD * 2.0 ** exponent_for(1 / math.sqrt(p.hidden_size)), rel=0.05)
    norm = np.asarray(by_name["blk.0.attn_norm.weight"].data)
    assert norm.mean() == pytest.approx(1.0, abs=0.05) and norm.std() == pytest.approx(0.1, rel=0.3)


def test_q8_0_attention_holds_the_bf16_values_exactly(tiny_gguf: Path, tmp_path: Path) -> None:
    """The Q8_0 attention projections dequantize to the values the bf16 layout stores (no quantization error: the
    generated values are an int8 level times a power of two), and every other tensor is byte for byte the same."""
    bf16 = write_synthetic_gguf(tmp_path / "bf16.gguf", preset="tiny", layers=2, workers=1, attention_type="bf16").path
    old = {t.name: t for t in gguf.GGUFReader(bf16).tensors}
    new = {t.name: t for t in gguf.GGUFReader(tiny_gguf).tensors}
    assert list(old) == list(new)
    projections = [
        n for n in new if n.startswith("blk.") and n.split(".")[2] in ("attn_q", "attn_k", "attn_v", "attn_output")
    ]
    assert len(projections) == 2 * 4
    for name, t in new.items():
        if name in projections:
            assert old[name].tensor_type == gguf.GGMLQuantizationType.BF16
            a = gguf.quants.dequantize(t.data, gguf.GGMLQuantizationType.Q8_0)
            b = gguf.quants.dequantize(old[name].data, gguf.GGMLQuantizationType.BF16)
            assert np.array_equal(a, b), name
        else:
            assert t.tensor_type == old[name].tensor_type and np.array_equal(t.data, old[name].data), name


def test_bytes_do_not_depend_on_the_worker_count(tiny_gguf: Path, tmp_path: Path) -> None:
    one = write_synthetic_gguf(tmp_path / "one.gguf", preset="tiny", layers=2, workers=1)
    assert one.path.read_bytes() == tiny_gguf.read_bytes()
    other_seed = write_synthetic_gguf(tmp_path / "s1.gguf", preset="tiny", layers=2, seed=1, workers=1)
    assert other_seed.path.read_bytes() != tiny_gguf.read_bytes()


def test_layout_matches_the_export_of_a_checkpoint(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Same tensors in the same order with the same shapes as export_gguf writes, vocabulary included."""
    exported = export_gguf(tiny_model_dir, tmp_path / "export.gguf", "bf16").path
    synth = write_synthetic_gguf(tmp_path / "synth.gguf", preset="tiny", workers=1, attention_type="bf16").path
    a = [(n, s) for n, _, s, _ in iter_tensor_bytes(exported)]
    b = [(n, s) for n, _, s, _ in iter_tensor_bytes(synth)]
    assert a == b


def test_48_layer_plan_sizes() -> None:
    """The H200 file: one expert is 3 x 768 x 2048 Q8_0 values (34 bytes per 32), ~32 GB in all (0.85 GB less than
    with bf16 attention)."""
    p = PRESETS["qwen3-30b-a3b-shape"]
    hf = hf_config_for(p, p.bpe_vocab_size, 0, 1)
    planned = plan_tensors(hf, synthetic_shapes(hf), "bf16", expert_type="q8_0", attention_type="q8_0")
    assert expert_bytes(planned, p.num_experts) == 3 * 768 * 2048 // 32 * 34
    total = sum(t.nbytes for t in planned)
    experts = sum(t.nbytes for t in planned if "_exps." in t.gguf_name)
    assert experts == 48 * 128 * expert_bytes(planned, p.num_experts)
    assert 31e9 < total < 33e9
    kinds = ("attn_q", "attn_k", "attn_v", "attn_output")
    attention = sum(t.nbytes for t in planned if t.gguf_name.startswith("blk.") and t.gguf_name.split(".")[2] in kinds)
    assert attention == 48 * (2048 * (4096 + 512 + 512) + 4096 * 2048) // 32 * 34  # 0.96 GB; bf16 would be 1.81
