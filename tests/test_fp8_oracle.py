"""Outside oracle for block-FP8: the tiny-fp8 checkpoint dequantized by an independent numpy routine
(safetensors header parsed by hand, float8_e4m3fn bits decoded by hand, scales expanded with
np.repeat: no torch, no paged_experts code) and run by transformers' Qwen3MoeForCausalLM in fp32
matches our FP8 model's logits (resident and paged).

Tolerance: the same 1e-4 as the dense oracle (tests/test_hf_oracle.py), and why it holds: every
weight either side is q x s computed once in float32 (an FP8 value has 4 significant bits and the
scale 24, so the product is exact in float32: both sides hold the very same fp32 weights), and our
CPU path multiplies in fp32 like transformers; what differs is only the order of fp32 reductions,
~1e-6 relative on logits of std ~16. A wrong scale, block or expert moves logits by > 0.1."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from paged_experts.kv import KvPool
from paged_experts.model import MoeCausalLM, SeqChunk
from paged_experts.runtime import RuntimeConfig
from paged_experts.weights.synth import write_checkpoint

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("torch_one_thread")

TOKENS = [17, 4, 250, 250, 1001, 3, 64, 512, 9, 77, 300, 12]
TOL = {"rtol": 1e-4, "atol": 1e-4}


def e4m3fn_to_float32(raw: np.ndarray) -> np.ndarray:
    """uint8 float8_e4m3fn bit patterns -> float32: sign, 4 exponent bits (bias 7), 3 mantissa bits;
    exponent 0 is subnormal (m / 8 x 2^-6); S.1111.111 is NaN (no infinities in the fn variant)."""
    b = raw.astype(np.int32)
    sign = np.where(b & 0x80, -1.0, 1.0)
    exp, man = (b >> 3) & 0xF, b & 0x7
    normal = (1.0 + man / 8.0) * np.exp2(exp - 7.0)
    value = np.where(exp == 0, man / 8.0 * 2.0**-6, normal)
    value = np.where((exp == 15) & (man == 7), np.nan, value)
    return (sign * value).astype(np.float32)


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """name -> array, from the file format itself: u64 header size, JSON header, raw little-endian data."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    dtypes = {"F32": np.float32, "F8_E4M3": np.uint8, "BF16": np.uint16, "F16": np.float16}
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        out[name] = np.frombuffer(data[8 + n + start : 8 + n + end], dtype=dtypes[info["dtype"]]).reshape(info["shape"])
        if info["dtype"] == "F8_E4M3":
            out[name] = e4m3fn_to_float32(out[name])
    return out


def dequantized_checkpoint(src: Path, dst: Path) -> Path:
    """The FP8 checkpoint as plain fp32: W = q * repeat(scale, 128) per block, edges cut."""
    tensors = read_safetensors(src / "model.safetensors")
    dense = {}
    for name, value in tensors.items():
        if name.endswith("weight_scale_inv"):
            continue
        scale_name = name.removesuffix("weight") + "weight_scale_inv"
        if scale_name in tensors:
            s = np.repeat(np.repeat(tensors[scale_name], 128, axis=0), 128, axis=1)[: value.shape[0], : value.shape[1]]
            value = value * s
        dense[name] = np.ascontiguousarray(value, dtype=np.float32)
    from safetensors.numpy import save_file

    dst.mkdir()
    save_file(dense, str(dst / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    del config["quantization_config"]
    (dst / "config.json").write_text(json.dumps(config))
    shutil.copy(src / "generation_config.json", dst)
    return dst


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint("tiny-fp8", tmp_path_factory.mktemp("fp8") / "ckpt", seed=11)


@pytest.fixture(scope="module")
def hf_logits(ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> torch.Tensor:
    dense = dequantized_checkpoint(ckpt, tmp_path_factory.mktemp("dense") / "ckpt")
    hf = transformers.AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32, attn_implementation="eager")
    assert type(hf).__name__ == "Qwen3MoeForCausalLM"
    with torch.no_grad():
        return hf(torch.tensor([TOKENS])).logits[0].float()  # [n, V]


@pytest.mark.parametrize("runtime", [RuntimeConfig(mode="resident"), RuntimeConfig(mode="paged", resident_experts=5)])
def test_fp8_model_matches_transformers_on_numpy_dequantized_weights(
    ckpt: Path, hf_logits: torch.Tensor, runtime: RuntimeConfig
) -> None:
    model = MoeCausalLM.from_pretrained(ckpt, runtime)
    assert model.config.fp8_weights and model.moe_layers[0].host.is_fp8
    seq = KvPool.for_model(model, 64).new_sequence()
    ours = model.forward([SeqChunk(seq, TOKENS, 0, all_logits=True)])[0]
    assert hf_logits.std() > 8.0  # peaked logits: the tolerance is tight relative to them
    torch.testing.assert_close(ours, hf_logits, **TOL)
    assert torch.equal(ours.argmax(-1), hf_logits.argmax(-1))


def test_numpy_decoder_agrees_with_torch_on_every_e4m3fn_value() -> None:
    """The oracle's decoder is checked once against torch's float8 cast over all 256 bit patterns."""
    raw = np.arange(256, dtype=np.uint8)
    ours = e4m3fn_to_float32(raw)
    ref = torch.from_numpy(raw.copy()).view(torch.float8_e4m3fn).to(torch.float32).numpy()
    assert np.array_equal(np.isnan(ours), np.isnan(ref))
    assert np.array_equal(ours[~np.isnan(ours)], ref[~np.isnan(ref)])
