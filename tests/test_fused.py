"""Fused expert compute (grouped matmuls over the slot table) and in-memory synthetic models, on CPU.

- paged == resident == offload == cpu-experts bit for bit in fp32 with the fused kernel, at K from
  top_k (multi-wave steps) to E;
- fused agrees with the per-expert reference loop (fp32 closely, bf16 within bf16 tolerance);
- device-tallied counters equal the reference path's counters;
- `synth:` paths and weightless directories load; host weights are shared between runtimes.
"""

from __future__ import annotations

import json

import pytest
import torch

from paged_experts.kernels.fused import expert_mlp, group_pairs
from paged_experts.kv import KvPool
from paged_experts.model import MoeCausalLM, SeqChunk
from paged_experts.residency.store import ExpertTensors
from paged_experts.runtime import RuntimeConfig
from paged_experts.weights import synth_memory

PATH = "synth:tiny?layers=2&seed=1"
PROMPTS = ([5, 17, 300, 41, 9], [800, 2, 64], [11, 12, 13, 14])


def scenario(model: MoeCausalLM, decode_steps: int = 2) -> list[torch.Tensor]:
    pool = KvPool.for_model(model, capacity_tokens=128)
    seqs = [pool.new_sequence() for _ in PROMPTS]
    out = model.forward([SeqChunk(s, p, 0, all_logits=True) for s, p in zip(seqs, PROMPTS)])
    last = out
    for _ in range(decode_steps):
        last = model.forward([SeqChunk(s, [int(lg[-1].argmax())], s.num_tokens) for s, lg in zip(seqs, last)])
        out += last
    return out


@pytest.fixture(scope="module")
def resident_fp32() -> list[torch.Tensor]:
    return scenario(MoeCausalLM.from_pretrained(PATH, RuntimeConfig(mode="resident")))


def test_expert_mlp_matches_per_expert_matmuls() -> None:
    torch.manual_seed(0)
    g, h, i = 5, 16, 8
    w = ExpertTensors(gate=torch.randn(g, i, h), up=torch.randn(g, i, h), down=torch.randn(g, h, i))
    rows = torch.tensor([3, 0, 3, 4, 0, 3])  # [P] weight row of each pair
    x = torch.randn(rows.numel(), h)  # [P, H]
    order, offs, counts = group_pairs(rows, g)
    assert offs.tolist() == [2, 2, 2, 5, 6] and counts.tolist() == [2, 0, 0, 3, 1]
    y = expert_mlp(x[order], w, offs)  # [P, H]
    for n, p in enumerate(order.tolist()):
        r = int(rows[p])
        ref = (torch.nn.functional.silu(x[p] @ w.gate[r].T) * (x[p] @ w.up[r].T)) @ w.down[r].T
        torch.testing.assert_close(y[n], ref)


@pytest.mark.parametrize("k", [4, 5, 9, 32])
def test_fused_paged_equals_resident_bit_for_bit(k: int, resident_fp32: list[torch.Tensor]) -> None:
    model = MoeCausalLM.from_pretrained(PATH, RuntimeConfig(mode="paged", resident_experts=k))
    assert model.expert_kernel == "fused"
    for i, (a, b) in enumerate(zip(scenario(model), resident_fp32)):
        assert torch.equal(a, b), f"K={k}: output {i} differs by {(a - b).abs().max().item()}"
    total = model.counters.snapshot().total
    if k == 4:  # 3 tokens x top_k 4 > K: decode steps need several waves
        assert total.waves > total.steps


@pytest.mark.parametrize("rt", [RuntimeConfig(mode="offload"), RuntimeConfig(mode="cpu-experts", cpu_expert_layers=1)])
def test_fused_other_modes_equal_resident(rt: RuntimeConfig, resident_fp32: list[torch.Tensor]) -> None:
    for a, b in zip(scenario(MoeCausalLM.from_pretrained(PATH, rt)), resident_fp32):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-4), ("bfloat16", 5e-2)])
def test_fused_close_to_reference_loop(dtype: str, tol: float) -> None:
    rt = RuntimeConfig(mode="paged", resident_experts=6, dtype=dtype)
    fused = scenario(MoeCausalLM.from_pretrained(PATH, rt), decode_steps=1)
    loop_model = MoeCausalLM.from_pretrained(PATH, rt, expert_kernel="loop")
    assert loop_model.expert_kernel == "loop"
    loop = scenario(loop_model, decode_steps=1)
    for a, b in zip(fused, loop):
        scale = b.abs().max().item()
        assert (a - b).abs().max().item() <= tol * max(scale, 1.0)


def test_device_tallied_counters_match_reference() -> None:
    for mode in ("resident", "offload"):
        rt = RuntimeConfig(mode=mode)  # type: ignore[arg-type]
        fused, loop = (MoeCausalLM.from_pretrained(PATH, rt, expert_kernel=kn) for kn in ("fused", "loop"))
        scenario(fused, decode_steps=1)
        scenario(loop, decode_steps=1)
        a, b = fused.counters.snapshot(), loop.counters.snapshot()
        assert [x.to_dict() | {"copy_time_s": 0} for x in a.layers] == [
            x.to_dict() | {"copy_time_s": 0} for x in b.layers
        ]
        fused.counters.reset()
        assert fused.counters.snapshot().total.steps == 0


def test_unknown_kernel_is_refused() -> None:
    with pytest.raises(ValueError, match="expert_kernel"):
        MoeCausalLM.from_pretrained(PATH, RuntimeConfig(), expert_kernel="triton-maybe")


def test_synthetic_host_store_is_shared_between_runtimes() -> None:
    a = MoeCausalLM.synthetic("tiny", RuntimeConfig(mode="offload"), layers=2, seed=1)
    b = MoeCausalLM.synthetic("tiny", RuntimeConfig(mode="paged", resident_experts=8), layers=2, seed=1)
    assert a.moe_layers[0].host.gate.data_ptr() == b.moe_layers[0].host.gate.data_ptr()
    assert a.config.num_layers == 2 and a.config.num_experts == 32


def test_synth_paths(tmp_path) -> None:
    with pytest.raises(ValueError, match="unknown options"):
        synth_memory.parse_spec("synth:tiny?layer=2")
    with pytest.raises(ValueError, match="preset"):
        synth_memory.parse_spec("synth:nope")
    spec = synth_memory.parse_spec("synth:qwen3-30b-a3b-shape?layers=48&seed=3")
    assert (spec.layers, spec.seed) == (48, 3)
    cfg = synth_memory.config_for(spec)
    assert (cfg.num_layers, cfg.num_experts, cfg.top_k, cfg.expert_bytes("bfloat16")) == (48, 128, 8, 9_437_184)
    # a weightless directory: config.json (from the tiny preset, 2 layers) + marker, no safetensors
    (tmp_path / "config.json").write_text(
        json.dumps(synth_memory.hf_config_for(synth_memory.PRESETS["tiny"], 40, 0, 1) | {"num_hidden_layers": 2})
    )
    (tmp_path / synth_memory.MARKER).write_text(json.dumps({"preset": "tiny", "layers": 2, "seed": 1}))
    assert synth_memory.is_synthetic(tmp_path)
    model = MoeCausalLM.from_pretrained(tmp_path, RuntimeConfig())
    assert model.config.vocab_size == 40 and len(scenario_small(model)) == 1


def scenario_small(model: MoeCausalLM) -> list[torch.Tensor]:
    pool = KvPool.for_model(model, capacity_tokens=16)
    return model.forward([SeqChunk(pool.new_sequence(), [1, 2, 3], 0)])


def _decode_run(model: MoeCausalLM, steps: int = 3) -> list[torch.Tensor]:
    pool = KvPool.for_model(model, capacity_tokens=128)
    seqs = [pool.new_sequence() for _ in PROMPTS]
    last = model.forward([SeqChunk(s, p, 0) for s, p in zip(seqs, PROMPTS)])
    out = []
    for _ in range(steps):
        last = model.forward([SeqChunk(s, [int(lg[-1].argmax())], s.num_tokens) for s, lg in zip(seqs, last)])
        out += last
    return out


def test_static_decode_step_matches_eager() -> None:
    """The CUDA-graph body (padded attention, fused MoE) run uncaptured on CPU equals eager closely."""
    eager_model = MoeCausalLM.from_pretrained(PATH, RuntimeConfig(mode="resident"))
    static_model = MoeCausalLM.from_pretrained(PATH, RuntimeConfig(mode="resident"))
    static_model.enable_cuda_graphs([1, 2, 3])
    eager, static = _decode_run(eager_model), _decode_run(static_model)
    assert static_model.graph_replays == 3
    for a, b in zip(static, eager):
        assert (a - b).abs().max().item() <= 1e-4 * max(b.abs().max().item(), 1.0)
    ta, tb = static_model.counters.snapshot().total, eager_model.counters.snapshot().total
    assert (ta.steps, ta.union_sum, ta.hits, ta.routed_pairs) == (tb.steps, tb.union_sum, tb.hits, tb.routed_pairs)


def test_static_decode_needs_resident_layers() -> None:
    model = MoeCausalLM.from_pretrained(PATH, RuntimeConfig(mode="paged", resident_experts=8))
    with pytest.raises(ValueError, match="resident"):
        model.enable_cuda_graphs([1])


def test_expert_backend_choice_is_checked() -> None:
    from paged_experts.kernels import moe_triton

    with pytest.raises(ValueError, match="expert backend must be one of"):
        RuntimeConfig(kernel_backend="cutlass")
    if not moe_triton.available():  # the CPU wheel: refused with the reason
        with pytest.raises(ValueError, match="needs Triton"):
            RuntimeConfig(kernel_backend="triton")
    assert RuntimeConfig().kernel_backend == "grouped"  # a model's configuration, no process-wide switch


@pytest.mark.parametrize("path", [PATH, "synth:tiny-fp8?layers=2&seed=1"])
@pytest.mark.parametrize("k", [4, 9])
def test_laid_out_waves_equal_resident(path: str, k: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A host-planned step lays out all its waves at once (`_FusedPass.plan_waves`: one sort and one copy
    to the device per layer-step) and computes each from its run of that layout: paged multi-wave steps
    equal resident bit for bit, dense and FP8 rows (dequantized per wave on the CPU), and a wave asked
    for out of the laid-out order is refused."""
    from paged_experts.moe import waves

    laid = []
    plain_plan = waves._FusedPass.plan_waves

    def counted(self: waves._FusedPass, plan: object, rows: int, block_m: int | None = None) -> None:
        laid.append(len(plan))  # type: ignore[arg-type]
        assert block_m is None  # no grouped FP8 kernel on the CPU: no block tables to lay out
        plain_plan(self, plan, rows, block_m)  # type: ignore[arg-type]

    monkeypatch.setattr(waves._FusedPass, "plan_waves", counted)
    resident = scenario(MoeCausalLM.from_pretrained(path, RuntimeConfig(mode="resident")))
    model = MoeCausalLM.from_pretrained(path, RuntimeConfig(mode="paged", resident_experts=k))
    paged = scenario(model)
    assert all(torch.equal(a, b) for a, b in zip(paged, resident))
    assert max(laid) > 1 and model.counters.snapshot().total.misses > 0  # multi-wave steps went through it
    run = waves.FUSED.begin(torch.zeros(1, 4), torch.tensor([[0, 1]]), 4, torch.device("cpu"))
    with pytest.raises(AssertionError, match="plan_waves lays out the step"):
        run.wave(ExpertTensors.empty(4, 4, 2, torch.float32, torch.device("cpu")), [0, 1], [0, 1])
