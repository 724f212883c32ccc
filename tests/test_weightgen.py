"""paged_experts.weights.weightgen: one definition of the generated weights for every engine.

- numpy and torch compute the same LUT indices (bytes) for any chunk, at any offset;
- every value is exact in bf16, and the Q8_0 quants of the synthetic GGUF are the bf16 experts;
- the checkpoint `synth` writes, the in-memory model `synth_memory` builds and the GGUF
  `gguf_synth` writes for the same preset, layers and seed hold the same tensors;
- the vocabulary is the tokenizer's own everywhere (no padding rows)."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from benchsuite.engines.llamacpp.gguf_synth import write_synthetic_gguf
from paged_experts.weights import synth_memory, weightgen
from paged_experts.weights.synth import write_checkpoint

Q = gguf.GGMLQuantizationType


@pytest.mark.parametrize(("seed", "name", "start", "count"), [(0, "a", 0, 64), (7, "b", 5, 1001), (2**40, "c", 3, 1)])
def test_numpy_and_torch_indices_are_identical(seed: int, name: str, start: int, count: int) -> None:
    a = weightgen.indices_np(seed, name, start, count)
    b = weightgen.indices_torch(seed, name, start, count, "cpu")
    assert a.dtype == np.uint8 and len(a) == count
    assert np.array_equal(a, b.numpy().astype(np.uint8))


def test_chunks_are_slices_of_the_whole() -> None:
    whole = weightgen.indices_np(3, "t", 0, 4096)
    for start, count in ((0, 7), (1, 100), (1023, 2000), (4095, 1)):
        assert np.array_equal(weightgen.indices_np(3, "t", start, count), whole[start : start + count])
    assert not np.array_equal(whole, weightgen.indices_np(3, "u", 0, 4096))  # another tensor
    assert not np.array_equal(whole, weightgen.indices_np(4, "t", 0, 4096))  # another seed


def test_bytes_are_uniform() -> None:
    counts = np.bincount(weightgen.indices_np(0, "x", 0, 256 * 4096), minlength=256)
    # 4,096 expected per level: a chi-square test with 255 degrees of freedom at p ~ 1e-6
    chi2 = float(((counts - 4096.0) ** 2 / 4096.0).sum())
    assert chi2 < 370


def test_torch_slabs_on_a_device_path_match_numpy(monkeypatch: pytest.MonkeyPatch) -> None:
    """The accelerator path (values_slabs: indices_torch in slabs, the experts' power-of-two groups,
    the silent tokens' zero rows) equals the numpy path, run here on the CPU over an odd range that
    crosses slabs, groups and a zero row (the CUDA test runs it on the GPU)."""
    expert = weightgen.SourceTensor(weightgen.expert_name(0, "gate"), (3, 40, 64), "normal", -9, 40 * 64)
    head = weightgen.SourceTensor("lm_head.weight", (50, 64), "normal", -8, 0, (3, 7))
    monkeypatch.setattr(weightgen, "SLAB", 1000)
    assert set(weightgen.group_offsets(1, expert)) == {0, -1}  # both magnitudes occur: the groups are seen
    for t, start in ((expert, 0), (expert, 1237), (head, 130)):
        n = t.numel - start
        want = torch.from_numpy(weightgen.values_np(1, t, start, n)).to(torch.bfloat16)
        got = weightgen.values_slabs(1, t, "cpu", torch.bfloat16, start, n)
        assert torch.equal(got, want), (t.name, start)


def test_every_value_is_exact_in_bf16_and_fp16() -> None:
    for kind, exponent in (("normal", -11), ("normal", -5), ("norm", weightgen.NORM_EXPONENT)):
        v = weightgen.lut_values(weightgen.SourceTensor("x", (256,), kind, exponent))
        assert np.array_equal(torch.from_numpy(v).to(torch.bfloat16).float().numpy(), v)
        assert np.array_equal(v.astype(np.float16).astype(np.float32), v)


def test_spread_is_near_sigma() -> None:
    hf = _tiny_hf()
    for t in weightgen.source_tensors(hf):
        v = weightgen.values_np(0, t)
        if t.kind == "normal":
            assert abs(float(v.mean())) < 0.2 * float(v.std())
        if t.name.endswith("down_proj.weight"):
            sigma = 1 / np.sqrt(hf["moe_intermediate_size"])
            assert sigma / 1.5 < float(v.std()) < sigma * 1.5


def _tiny_hf() -> dict[str, int]:
    from paged_experts.weights.synth_memory import SynthSpec, config_for

    return weightgen.hf_shape(config_for(SynthSpec("tiny", 2, 0)))


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("pair")
    ckpt = write_checkpoint("tiny", root / "ckpt", layers=2, seed=3, dtype="bfloat16")
    g = write_synthetic_gguf(root / "tiny.gguf", preset="tiny", layers=2, seed=3, workers=2).path
    return ckpt, g


def test_gguf_q8_0_experts_are_the_bf16_experts(tiny_pair: tuple[Path, Path]) -> None:
    ckpt, g = tiny_pair
    reader = gguf.GGUFReader(g)
    tensors = {t.name: t for t in reader.tensors}
    weights = load_file(str(ckpt / "model.safetensors"))
    cfg = json.loads((ckpt / "config.json").read_text())
    for layer in range(2):
        for proj, base in (("gate", "ffn_gate_exps"), ("up", "ffn_up_exps"), ("down", "ffn_down_exps")):
            t = tensors[f"blk.{layer}.{base}.weight"]
            assert t.tensor_type == Q.Q8_0
            deq = torch.from_numpy(gguf.quants.dequantize(t.data, Q.Q8_0).astype(np.float32))  # [E, O, I]
            stacked = torch.stack(
                [weights[f"model.layers.{layer}.mlp.experts.{e}.{proj}_proj.weight"] for e in range(cfg["num_experts"])]
            )
            assert stacked.dtype == torch.bfloat16
            assert torch.equal(deq, stacked.float())  # exact: no quantization error
    # Q8_0 attention (as llama-quantize types a Q8_0 file): the very values; norms and router F32: the same values
    for proj, base in (("q", "attn_q"), ("k", "attn_k"), ("v", "attn_v"), ("o", "attn_output")):
        t = tensors[f"blk.1.{base}.weight"]
        assert t.tensor_type == Q.Q8_0
        deq = torch.from_numpy(gguf.quants.dequantize(t.data, Q.Q8_0).astype(np.float32))
        assert torch.equal(deq, weights[f"model.layers.1.self_attn.{proj}_proj.weight"].float())
    norm = np.asarray(tensors["blk.0.attn_norm.weight"].data)
    assert np.array_equal(norm, weights["model.layers.0.input_layernorm.weight"].float().numpy())


def test_vocabulary_is_the_tokenizers_own(tiny_pair: tuple[Path, Path]) -> None:
    ckpt, g = tiny_pair
    tok = json.loads((ckpt / "tokenizer.json").read_text())
    n = len(tok["model"]["vocab"]) + len(tok["added_tokens"])
    reader = gguf.GGUFReader(g)
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    assert len(tokens) == n == json.loads((ckpt / "config.json").read_text())["vocab_size"]
    assert not any(t.startswith("[PAD") for t in tokens)
    assert synth_memory.config_for(synth_memory.SynthSpec("qwen3-30b-a3b-shape", 1, 0)).vocab_size == n


def test_in_memory_model_holds_the_checkpoints_weights(tiny_pair: tuple[Path, Path]) -> None:
    ckpt, _ = tiny_pair
    synth_memory.clear_cache()
    cfg = synth_memory.config_for(synth_memory.SynthSpec("tiny", 2, 3))
    hw = synth_memory.host_weights(cfg, torch.bfloat16, 3, torch.device("cpu"), synth_memory.silent_ids("synth:tiny"))
    weights = load_file(str(ckpt / "model.safetensors"))
    assert torch.equal(hw.lm_head, weights["lm_head.weight"])
    assert torch.equal(hw.attention[1].o_proj, weights["model.layers.1.self_attn.o_proj.weight"])
    assert torch.equal(hw.routers[0], weights["model.layers.0.mlp.gate.weight"])
    assert torch.equal(hw.experts[1].get("down")[5], weights["model.layers.1.mlp.experts.5.down_proj.weight"])
    synth_memory.clear_cache()


def test_fp8_preset_quantizes_the_same_source(tmp_path: Path) -> None:
    from paged_experts import fp8

    ckpt = write_checkpoint("tiny-fp8", tmp_path / "fp8", layers=1, seed=2)
    w = load_file(str(ckpt / "model.safetensors"))
    hf = json.loads((ckpt / "config.json").read_text())
    src = weightgen.by_name(hf)[weightgen.expert_name(0, "up")]
    want_q, want_s = fp8.quantize(weightgen.values_torch(2, src)[3])
    assert torch.equal(fp8.raw(w["model.layers.0.mlp.experts.3.up_proj.weight"]), fp8.raw(want_q))
    assert torch.equal(w["model.layers.0.mlp.experts.3.up_proj.weight_scale_inv"], want_s)


def test_silent_tokens_have_zero_output_rows(tiny_pair: tuple[Path, Path]) -> None:
    """Specials and lone bytes of multi-byte UTF-8 characters never win greedy decoding: their
    lm_head rows are zero (logit 0 against a top logit of tens)."""
    from tokenizers import Tokenizer

    ckpt, _ = tiny_pair
    tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    silent = weightgen.silent_token_ids(tok)
    assert {tok.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")} <= set(silent)
    assert 100 < len(silent) < 200  # 3 specials + the 128 bytes >= 0x80 that are not merged text + controls
    assert "\ufffd" in tok.decode([silent[0]]) or silent[0] in {tok.token_to_id("<|endoftext|>")}
    lm_head = load_file(str(ckpt / "model.safetensors"))["lm_head.weight"].float()
    zero = (lm_head == 0).all(dim=1)
    assert zero.nonzero().flatten().tolist() == list(silent)


def test_expert_groups_scale_by_their_own_power_of_two() -> None:
    t = weightgen.SourceTensor("e", (6, 8, 32), "normal", -7, 256)
    offsets = weightgen.group_offsets(1, t)
    assert set(offsets.tolist()) == {0, -1}  # both magnitudes occur among 6 experts (seeded)
    whole = weightgen.values_np(1, t)
    base = weightgen.lut_values(t)[weightgen.indices_np(1, "e", 0, t.numel)]
    assert np.array_equal(whole, base * np.repeat(np.ldexp(np.float32(1), offsets), 256).astype(np.float32))
    assert np.array_equal(weightgen.values_np(1, t, 250, 300), whole[250:550])  # across an expert boundary


def test_a_q8_0_output_layer_keeps_the_silent_rows_zero(tmp_path: Path) -> None:
    """write_synthetic_gguf(dense_type="q8_0"): the Q8_0 writer wrote every block's LUT quants and
    skipped the silent tokens' zero rows, so the GGUF's lm_head was no longer the checkpoint's."""
    from tokenizers import Tokenizer

    from paged_experts.weights.synth_memory import write_weightless

    g = write_synthetic_gguf(tmp_path / "q8.gguf", preset="tiny", layers=1, seed=3, dense_type="q8_0", workers=1).path
    head = next(t for t in gguf.GGUFReader(g).tensors if t.name == "output.weight")
    assert head.tensor_type == Q.Q8_0
    rows = gguf.quants.dequantize(head.data, Q.Q8_0).astype(np.float32).reshape(-1, int(head.shape[0]))
    tok = Tokenizer.from_file(str(write_weightless("tiny", tmp_path / "hf", seed=3) / "tokenizer.json"))
    silent = list(weightgen.silent_token_ids(tok))
    assert np.flatnonzero((rows == 0).all(axis=1)).tolist() == silent
    src = weightgen.by_name(_tiny_hf() | {"num_hidden_layers": 1}, tuple(silent))["lm_head.weight"]
    assert np.array_equal(rows.reshape(-1), weightgen.values_np(3, src))  # exact, as the bf16 one
