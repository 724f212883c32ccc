"""Block-FP8 experts (paged_experts/fp8.py) on the tiny-fp8 generated checkpoint, CPU, fp32 compute:
- FP8 paged == FP8 resident bit for bit for every K from top_k to E (multi-wave steps included),
  device-planned paged and graphed (uncaptured) decode too; offload and cpu-experts equal resident;
- counters: an expert's bytes are its FP8 weights plus their float32 block scales;
- the control of the published bug class (PR #45787): one scale tensor left unpaged -> equality FAILS;
- malformed FP8 checkpoints refused at load with one line naming the tensor;
- the in-memory FP8 synthetic model (`synth:tiny-fp8`) and its host store."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import paged_experts.residency.store as store_mod
from paged_experts import fp8
from paged_experts.kv import KvPool
from paged_experts.model import MoeCausalLM, SeqChunk
from paged_experts.runtime import RuntimeConfig
from paged_experts.weights.synth import write_checkpoint

PROMPTS = ([5, 17, 300, 41, 9, 77], [800, 2, 64, 64], [11, 12, 13, 14, 15, 16, 17])
DECODE = ([40, 41, 42], [7, 700, 70], [1000, 3, 33])

pytestmark = pytest.mark.usefixtures("torch_one_thread")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint("tiny-fp8", tmp_path_factory.mktemp("tiny_fp8") / "ckpt", seed=5)


def run_scenario(model: MoeCausalLM, batches: tuple[tuple[int, ...], ...] = ((0, 1, 2),) * 3) -> list[torch.Tensor]:
    """A 3-sequence prefill (union near E: several waves for small K), then decode steps of the given sequences."""
    pool = KvPool.for_model(model, capacity_tokens=256)
    seqs = [pool.new_sequence() for _ in PROMPTS]
    out = model.forward([SeqChunk(s, p, 0, all_logits=True) for s, p in zip(seqs, PROMPTS)])
    for step, live in zip(DECODE, batches):
        out += model.forward([SeqChunk(seqs[i], [step[i]], seqs[i].num_tokens) for i in live])
    return out


@pytest.fixture(scope="module")
def resident(ckpt: Path) -> list[torch.Tensor]:
    model = MoeCausalLM.from_pretrained(ckpt, RuntimeConfig(mode="resident"))
    assert model.moe_layers[0].device_experts.gate.dtype == fp8.FP8_DTYPE  # type: ignore[attr-defined]
    return run_scenario(model)


def assert_same(got: list[torch.Tensor], want: list[torch.Tensor], what: str) -> None:
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"{what}: output {i} differs by {(a - b).abs().max().item()}"


def test_fp8_paged_equals_resident_bit_for_bit_for_every_k(ckpt: Path, resident: list[torch.Tensor]) -> None:
    cfg = MoeCausalLM.from_pretrained(ckpt, RuntimeConfig(mode="resident")).config
    assert cfg.fp8_weights and cfg.num_experts == 16
    multi_wave = []
    for k in range(cfg.top_k, cfg.num_experts + 1):
        model = MoeCausalLM.from_pretrained(ckpt, RuntimeConfig(mode="paged", resident_experts=k))
        assert_same(run_scenario(model), resident, f"K={k}")
        total = model.counters.snapshot().total
        if total.waves > total.steps:
            multi_wave.append(k)
        assert model.moe_layers[0].host.is_fp8
    assert cfg.top_k in multi_wave and len(multi_wave) >= 4, multi_wave


@pytest.mark.parametrize("k", [4, 8, 12])
def test_fp8_device_planned_and_graphed_decode_equal_resident(ckpt: Path, resident: list[torch.Tensor], k: int) -> None:
    """One-wave steps planned on the device (the CUDA path, here on CPU tensors) page FP8 rows and
    scales with copy_kernel; batches 1 and 2 fit one wave for K >= 8, batch 3 runs host waves."""
    batches = ((0,), (0, 1), (0, 1, 2))
    eager = run_scenario(MoeCausalLM.from_pretrained(ckpt, RuntimeConfig(mode="resident")), batches)
    rt = RuntimeConfig(mode="paged", resident_experts=k, device_planning="on")
    assert_same(run_scenario(MoeCausalLM.from_pretrained(ckpt, rt), batches), eager, f"device-planned K={k}")
    graphed = MoeCausalLM.from_pretrained(ckpt, rt)
    graphed.enable_cuda_graphs([1, 2])
    out = run_scenario(graphed, batches)
    assert graphed.graph_replays == (2 if k >= 8 else 1 if k >= 4 else 0)
    for a, b in zip(out, eager):  # the static step pads attention to a KV bucket: equal within rounding
        assert (a - b).abs().max().item() <= 1e-4 * max(b.abs().max().item(), 1.0)


def test_fp8_offload_and_cpu_experts_equal_resident(ckpt: Path, resident: list[torch.Tensor]) -> None:
    for rt in (RuntimeConfig(mode="offload"), RuntimeConfig(mode="cpu-experts", cpu_expert_layers=2)):
        assert_same(run_scenario(MoeCausalLM.from_pretrained(ckpt, rt)), resident, rt.mode)
    loop = run_scenario(MoeCausalLM.from_pretrained(ckpt, RuntimeConfig(mode="paged", resident_experts=5), "loop"))
    for a, b in zip(loop, resident):  # the per-expert reference dequantizes one expert at a time
        assert (a - b).abs().max().item() <= 1e-4 * max(b.abs().max().item(), 1.0)


def test_fp8_counters_count_weights_and_scales(ckpt: Path) -> None:
    model = MoeCausalLM.from_pretrained(ckpt, RuntimeConfig(mode="paged", resident_experts=6))
    run_scenario(model)
    cfg, snap = model.config, model.counters.snapshot()
    h, i = cfg.hidden_size, cfg.moe_intermediate_size
    expert_bytes = 3 * h * i + 3 * 4 * fp8.blocks(h) * fp8.blocks(i)  # FP8 weights + float32 block scales
    assert snap.expert_bytes == expert_bytes == cfg.expert_bytes("float8_e4m3fn") == model.moe_layers[0].host.row_bytes
    assert expert_bytes < cfg.expert_bytes("bfloat16") / 1.9
    for c in snap.layers:
        assert c.misses > 0 and c.bytes_paged_in == c.bytes_h2d == c.misses * expert_bytes
    offload = MoeCausalLM.from_pretrained(ckpt, RuntimeConfig(mode="offload"))
    run_scenario(offload)
    layer = offload.counters.snapshot().layers[0]
    assert layer.bytes_h2d == layer.steps * cfg.num_experts * expert_bytes


@pytest.mark.parametrize("rows", ["split", "packed"])
@pytest.mark.parametrize("dropped", ["down_scale", "gate_scale"])
def test_fault_unpaged_scale_is_caught(
    ckpt: Path, resident: list[torch.Tensor], monkeypatch: pytest.MonkeyPatch, dropped: str, rows: str
) -> None:
    """Control (PR #45787's class): a paged expert computed with another expert's scales must FAIL equality, in
    either expert layout."""
    monkeypatch.setattr(store_mod, "SCALE_TENSORS", tuple(n for n in store_mod.SCALE_TENSORS if n != dropped))
    runtime = RuntimeConfig(mode="paged", resident_experts=6, expert_rows=rows)  # type: ignore[arg-type]
    model = MoeCausalLM.from_pretrained(ckpt, runtime)
    paged = run_scenario(model)
    assert model.counters.snapshot().total.misses > 0
    assert not all(torch.equal(a, b) for a, b in zip(paged, resident))


def _broken_copy(ckpt: Path, tmp_path: Path, edit) -> Path:
    out = tmp_path / "broken"
    out.mkdir()
    for f in ckpt.iterdir():
        if f.suffix != ".safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(ckpt / "model.safetensors"))
    config = json.loads((ckpt / "config.json").read_text())
    edit(tensors, config)
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config))
    return out


EXPERT = "model.layers.1.mlp.experts.3.down_proj"


def _drop_scale(t: dict, c: dict) -> None:
    del t[f"{EXPERT}.weight_scale_inv"]


def _scales_of_64_blocks(t: dict, c: dict) -> None:
    """Block size 64 in the file while config.json declares 128: the scale shape betrays it."""
    w = fp8.dequantize(t[f"{EXPERT}.weight"], t[f"{EXPERT}.weight_scale_inv"], torch.float32)  # [H, I]
    t[f"{EXPERT}.weight_scale_inv"] = (
        w.abs().unflatten(0, (-1, 64)).amax(dim=1).unflatten(1, (-1, 64)).amax(dim=2) / 448
    )


def _wrong_scale_shape(t: dict, c: dict) -> None:
    s = t[f"{EXPERT}.weight_scale_inv"]  # [2, 2]
    t[f"{EXPERT}.weight_scale_inv"] = torch.cat([s, s[:1]])  # [3, 2]


def _declared_block_64(t: dict, c: dict) -> None:
    c["quantization_config"]["weight_block_size"] = [64, 64]


def _dense_expert_weight(t: dict, c: dict) -> None:
    t[f"{EXPERT}.weight"] = t[f"{EXPERT}.weight"].to(torch.float32)


def _attention_scale_missing(t: dict, c: dict) -> None:
    del t["model.layers.2.self_attn.o_proj.weight_scale_inv"]


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (_drop_scale, rf"^{EXPERT}.weight_scale_inv is missing: FP8 weight {EXPERT}.weight has no block scales$"),
        (_scales_of_64_blocks, rf"^{EXPERT}.weight_scale_inv has shape \(4, 3\), 128x128 blocks of {EXPERT}.weight"),
        (_wrong_scale_shape, rf"^{EXPERT}.weight_scale_inv has shape \(3, 2\), 128x128 blocks of .* imply \(2, 2\)$"),
        (_declared_block_64, r"^config.json quantization_config.weight_block_size \[64, 64\]: only \[128, 128\]"),
        (
            _dense_expert_weight,
            rf"^{EXPERT}.weight is torch.float32, a block-FP8 checkpoint stores it as torch.float8_e4m3fn$",
        ),
        (_attention_scale_missing, r"^model.layers.2.self_attn.o_proj.weight_scale_inv is missing"),
    ],
)
def test_malformed_fp8_checkpoint_is_refused_naming_the_tensor(ckpt: Path, tmp_path: Path, edit, message: str) -> None:
    broken = _broken_copy(ckpt, tmp_path, edit)
    with pytest.raises(ValueError, match=message) as err:
        MoeCausalLM.from_pretrained(broken, RuntimeConfig(mode="paged", resident_experts=4))
    assert "\n" not in str(err.value)


def test_in_memory_fp8_model_pages_like_resident() -> None:
    path = "synth:tiny-fp8?layers=2&seed=1"
    resident = MoeCausalLM.from_pretrained(path, RuntimeConfig(mode="resident"))
    host = resident.moe_layers[0].host
    assert host.is_fp8 and host.down_scale is not None and host.down_scale.shape == (16, 2, 2)
    want = run_scenario(resident)
    for k in (4, 7):
        assert_same(
            run_scenario(MoeCausalLM.from_pretrained(path, RuntimeConfig(mode="paged", resident_experts=k))),
            want,
            f"K={k}",
        )


def test_quantizer_round_trip_and_format_facts() -> None:
    w = torch.randn(200, 300) * 3
    q, s = fp8.quantize(w)
    assert q.dtype == fp8.FP8_DTYPE and s.shape == (2, 3) and s.dtype == torch.float32
    back = fp8.dequantize(q, s, torch.float32)
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 of each block's scale x 448 range
    assert ((back - w).abs() <= fp8.expand_scales(s, 200, 300) * 448 * 2**-4).all()
    assert fp8.fp8_declared({"quantization_config": fp8.QUANTIZATION_CONFIG}) is True
    assert fp8.fp8_declared({}) is False
    with pytest.raises(ValueError, match="quant_method 'gptq'"):
        fp8.fp8_declared({"quantization_config": {"quant_method": "gptq"}})


def test_runtime_expert_bytes_equal_the_preflight_formula_at_the_published_shape() -> None:
    """The counters' FP8 expert bytes (weights + scales) are the shape's `expert_bytes_fp8_block`: 4.72 MB."""
    from benchsuite.tools import preflight
    from paged_experts.config import MoeModelConfig
    from paged_experts.weights.synth import PRESETS, hf_config_for

    hf = hf_config_for(PRESETS["qwen3-30b-a3b-fp8-shape"], 151936, 151643, 151645)
    cfg = MoeModelConfig.from_hf_config(hf)
    assert cfg.fp8_weights and cfg.expert_dtype("bfloat16") == "float8_e4m3fn"
    assert cfg.expert_bytes("float8_e4m3fn") == preflight.shape_from_config(hf).expert_bytes_fp8_block() == 4_719_744
