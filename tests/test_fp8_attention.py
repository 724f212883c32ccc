"""Block-FP8 attention projections kept FP8 on the device (kernels/linear_fp8.py, projection.py):
- the kernels (the decode GEMV and its swap-AB MMA variant; larger steps: the dequantization into the scratch
  buffer, then the dense product) against the dequantized weight, every row bucket,
  partial N and K blocks, under the interpreter (the CUDA twin runs the same check in bf16 at the real shape);
- `projection.linear` through torch.compile (the opaque op) equals the eager call;
- a block-FP8 checkpoint loads with FP8 attention (both loaders: safetensors and the in-memory build), the
  `dequantize_attention` runtime keeps the old layout, the two agree within rounding, and the weights' bytes
  and the memory projection's non-expert bytes match what the model holds;
- the server option, the adapter's command line and the weights' format fact.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from interpreted import run_interpreted

from benchsuite.config.matrix import load_matrix
from benchsuite.config.plan import build_plan
from benchsuite.engines.builtin.adapter import BuiltinAdapter
from paged_experts import fp8
from paged_experts.config import MoeModelConfig
from paged_experts.kv import KvPool, SeqChunk
from paged_experts.model import MoeCausalLM
from paged_experts.projection import linear
from paged_experts.runtime import RuntimeConfig

# (M rows, N, K): every GEMV bucket (1..16), the scratch path (17, 70), N and K off the 128 blocks
LINEAR_CASES = ((1, 384, 256), (2, 200, 300), (3, 256, 384), (4, 384, 256), (7, 136, 256), (16, 256, 130))
LINEAR_CASES += ((17, 256, 256), (70, 200, 300))


def check_fp8_linear(device: str = "cpu", dtype: torch.dtype = torch.float32, tol: float = 1e-5) -> None:
    """fp8_linear against x @ dequantize(w)^T in fp32, and a row's bits independent of the other rows' values
    in a step of the same size (the kernel and its reduction order are chosen by the row count alone)."""
    from paged_experts.kernels.linear_fp8 import GEMV_MAX_ROWS, GemvTiles, fp8_linear

    gen = torch.Generator().manual_seed(11)
    for m, n, k in LINEAR_CASES:
        q, scale = (t.to(device) for t in fp8.quantize(torch.randn(n, k, generator=gen) / 16))
        x = torch.randn(m, k, generator=gen).to(device, dtype)  # [M, K]
        got = fp8_linear(x, q, scale)  # [M, N]
        assert got.shape == (m, n) and got.dtype == dtype
        want = x.float().cpu() @ fp8.dequantize(q, scale, torch.float32).cpu().T  # [M, N]
        bound = tol * max(1.0, want.abs().max().item())
        torch.testing.assert_close(got.float().cpu(), want, rtol=tol, atol=bound)
        others = x.clone()
        others[:-1] = torch.randn(m - 1, k, generator=gen).to(device, dtype)
        assert torch.equal(fp8_linear(others, q, scale)[-1].cpu(), got[-1].cpu()), (m, n, k)
        if m <= GEMV_MAX_ROWS:  # the tensor-core variant a bucket's tiles may name (swap-AB)
            mma = GemvTiles(block_n=16, block_k=64, num_warps=4, kind="mma", num_stages=2)
            got_mma = fp8_linear(x, q, scale, gemv=mma)
            torch.testing.assert_close(got_mma.float().cpu(), want, rtol=tol, atol=bound)
            assert torch.equal(fp8_linear(others, q, scale, gemv=mma)[-1].cpu(), got_mma[-1].cpu()), (m, n, k)
        print("ok", (m, n, k))


def test_fp8_linear_matches_the_dequantized_weight_in_the_interpreter() -> None:
    pytest.importorskip("triton")
    out = run_interpreted("test_fp8_attention", "check_fp8_linear")
    assert out.count("ok ") == len(LINEAR_CASES)


def test_tiles_spec_round_trip() -> None:
    from paged_experts.kernels.linear_fp8 import GemvTiles, parse_tiles

    tiles = parse_tiles("1=4x1024x4,4=mma:32x128x4x3")
    assert tiles == {1: GemvTiles(4, 1024, 4), 4: GemvTiles(32, 128, 4, kind="mma", num_stages=3)}
    assert parse_tiles(",".join(f"{b}={t.spec()}" for b, t in tiles.items())) == tiles
    for bad in ("3=4x1024x4", "1=5x1024x4", "1=mma:16x96x4x3", "1=4x1024", "1=mmx:16x64x4x3"):
        with pytest.raises(ValueError, match="PAGED_EXPERTS_FP8_LINEAR_TILES"):
            parse_tiles(bad)


def test_linear_through_torch_compile_equals_eager() -> None:
    """Inside torch.compile the FP8 projection is the opaque op paged_experts::fp8_linear in the graph (not the
    launcher traced), with the eager values, and one compiled graph serves the weights of every layer."""
    gen = torch.Generator().manual_seed(2)
    layers = [fp8.quantize(torch.randn(256, 128, generator=gen) / 8) for _ in range(3)]
    x = torch.randn(4, 128, generator=gen)
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> object:
        graphs.append(gm)
        return gm.forward

    def proj(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor | None) -> torch.Tensor:
        return torch.relu(linear(x, w, s)) + 1.0

    torch._dynamo.reset()
    compiled = torch.compile(proj, dynamic=False, backend=backend)
    for w, s in layers:
        torch.testing.assert_close(compiled(x, w, s), proj(x, w, s), rtol=0, atol=0)
    assert len(graphs) == 1, f"{len(graphs)} graphs compiled for 3 layers' weights"
    targets = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert torch.ops.paged_experts.fp8_linear in targets, targets
    dense = fp8.dequantize(*layers[0], torch.float32)
    torch.testing.assert_close(proj(x, dense, None), proj(x, *layers[0]), rtol=0, atol=0)


def _fp8_checkpoint(tmp_path: Path) -> Path:
    from paged_experts.weights.synth import write_checkpoint

    return write_checkpoint("tiny-fp8", tmp_path / "tiny-fp8", seed=0)


def _logits(model: MoeCausalLM, prompt: list[int], steps: int = 3) -> list[torch.Tensor]:
    """Greedy steps' fp32 logits (prefill, then decode tokens)."""
    pool = KvPool.for_model(model, capacity_tokens=64)
    seq = pool.new_sequence()
    out = [model.forward([SeqChunk(seq, prompt, 0)])[0][-1]]
    pos = len(prompt)
    for _ in range(steps):
        token = int(out[-1].argmax())
        out.append(model.forward([SeqChunk(seq, [token], pos)])[0][-1])
        pos += 1
    return out


@pytest.mark.parametrize("source", ["checkpoint", "memory"])
def test_fp8_checkpoint_keeps_attention_fp8(tmp_path: Path, source: str) -> None:
    path = _fp8_checkpoint(tmp_path) if source == "checkpoint" else "synth:tiny-fp8?layers=2&seed=0"
    kept = MoeCausalLM.from_pretrained(path, RuntimeConfig())
    deq = MoeCausalLM.from_pretrained(path, RuntimeConfig(dequantize_attention=True))
    cfg = kept.config
    for a, d in zip(kept.attention_layers, deq.attention_layers):
        assert a.fp8 and a.qkv_proj.dtype == fp8.FP8_DTYPE and a.o_proj.dtype == fp8.FP8_DTYPE
        assert a.qkv_scale is not None and a.o_scale is not None
        assert a.qkv_scale.shape == fp8.scale_shape((cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim, 256)
        assert not d.fp8 and d.qkv_proj.dtype == torch.float32 and d.qkv_scale is None
        # the same weights: the dequantized layout holds exactly the FP8 values times their scales
        assert torch.equal(d.qkv_proj, fp8.dequantize(a.qkv_proj, a.qkv_scale, torch.float32))
        assert torch.equal(d.k_proj, fp8.dequantize(a.k_proj, a.k_scale, torch.float32))  # the views line up
        assert torch.equal(d.o_proj, fp8.dequantize(a.o_proj, a.o_scale, torch.float32))
        assert a.nbytes() < d.nbytes() / 3  # 1 byte a weight against fp32's 4, plus the scales
    # on the CPU the FP8 path dequantizes per call: the same weights and products, so the same logits
    for x, y in zip(_logits(kept, [5, 17, 300, 41, 9]), _logits(deq, [5, 17, 300, 41, 9])):
        assert torch.equal(x, y)


def test_memory_projection_counts_what_the_model_holds() -> None:
    """The search's non-expert bytes (shape.non_expert_weight_bytes, FP8 attention counted as the server
    keeps it) equal the bytes of the model's embeddings, head, norms, routers and attention weights."""
    for dequantize in (False, True):
        runtime = RuntimeConfig(dequantize_attention=dequantize)
        model = MoeCausalLM.from_pretrained("synth:tiny-fp8?layers=2&seed=0", runtime)
        cfg = model.config
        held = sum(a.nbytes() for a in model.attention_layers)
        held += sum(m.router_weight.numel() * m.router_weight.element_size() for m in model.moe_layers)
        d = model.dense
        held += sum(t.numel() * t.element_size() for t in (d.embed, d.lm_head, d.final_norm))
        projected = cfg.shape.non_expert_weight_bytes(4, fp8_attention=cfg.fp8_attention(dequantize))
        assert projected == held, (dequantize, projected, held)


def test_qwen3_30b_attention_bytes() -> None:
    """At Qwen3-30B-A3B's shape the FP8 attention saves 0.90 GB of 1.81 GB (48 layers)."""
    from paged_experts.weights.synth import PRESETS, hf_config_for

    p = PRESETS["qwen3-30b-a3b-fp8-shape"]
    cfg = MoeModelConfig.from_hf_config(hf_config_for(p, 1042, 1, 2))
    shape = cfg.shape
    dense = shape.non_expert_weight_bytes(2)
    kept = shape.non_expert_weight_bytes(2, fp8_attention=cfg.fp8_attention())
    per_layer = 2048 * (4096 + 512 + 512) + 4096 * 2048  # weights, 1 byte each
    scales = 4 * (32 * 16 + 4 * 16 * 2 + 16 * 32)
    assert dense - kept == 48 * (per_layer - scales)
    assert 0.90e9 < dense - kept < 0.91e9


def test_declared_fp8_attention_stored_dense_is_refused_unless_dequantized(tmp_path: Path) -> None:
    """config.json decides the memory projection and the weights' format fact: a checkpoint declared block-FP8
    whose attention is stored dense is refused with one line naming the tensor and the option that loads it."""
    from safetensors.torch import load_file, save_file

    ckpt = _fp8_checkpoint(tmp_path)
    (shard,) = sorted(ckpt.glob("*.safetensors"))
    tensors = load_file(str(shard))
    name = "model.layers.0.self_attn.q_proj.weight"
    tensors[name] = fp8.dequantize(
        tensors[name], tensors.pop(name.removesuffix("weight") + fp8.SCALE_SUFFIX), torch.float32
    )
    save_file(tensors, str(shard))
    with pytest.raises(ValueError, match=rf"^{name} is torch.float32, .* \(--dequantize-attention loads"):
        MoeCausalLM.from_pretrained(ckpt, RuntimeConfig())
    model = MoeCausalLM.from_pretrained(ckpt, RuntimeConfig(dequantize_attention=True))
    assert not any(a.fp8 for a in model.attention_layers)


def test_unaligned_heads_are_dequantized() -> None:
    """q / k rows off the 128-row blocks cannot share a fused weight's scale rows: attention dequantized."""
    cfg = MoeModelConfig.from_hf_config({**_tiny_fp8_hf(), "num_key_value_heads": 1})
    assert cfg.fp8_weights and not cfg.fp8_attention()


def _tiny_fp8_hf() -> dict[str, object]:
    from paged_experts.weights.synth import PRESETS, hf_config_for

    return hf_config_for(PRESETS["tiny-fp8"], 1042, 1, 2)


def test_server_option_and_adapter_command(tmp_path: Path) -> None:
    from paged_experts.server.options import parse_args

    assert parse_args(["--model-path", "x", "--dequantize-attention"]).dequantize_attention is True
    assert parse_args(["--model-path", "x"]).dequantize_attention is False
    ckpt = _fp8_checkpoint(tmp_path)
    facts = {}
    for name, options in (("on", "mode: resident, dequantize_attention: true"), ("off", "mode: resident")):
        plan = build_plan(load_matrix(_matrix(tmp_path / f"{name}.yaml", ckpt, options)))
        (spec,) = plan.servers
        adapter = BuiltinAdapter()
        argv = adapter.launch_plan(spec, 8000).argv
        assert ("--dequantize-attention" in argv) == (name == "on"), argv
        facts[name] = adapter._expert_facts(spec)["weights"]["format"]
    assert facts["on"] == "float32, experts float8_e4m3fn (128x128 blocks)"
    assert facts["off"] == "float32, experts float8_e4m3fn (128x128 blocks), attention float8_e4m3fn (128x128 blocks)"


def _matrix(path: Path, model: Path, options: str) -> Path:
    path.write_text(
        f"name: m\nengines:\n  e:\n    kind: builtin\n    options: {{model: {model}, {options}}}\n"
        "workloads:\n  w: {concurrency: [1], num_requests: 1}\n"
    )
    return path
