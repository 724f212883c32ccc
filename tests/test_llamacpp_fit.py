"""Our llama.cpp memory projection (tensor placement, KV, fit check) and llama-fit-params parsing."""

from __future__ import annotations

import pytest

from benchsuite.engines.llamacpp.fit import (
    MIB,
    GgufFacts,
    Projection,
    fit_params_argv,
    kv_bytes_per_layer,
    parse_fit_print,
    project,
    projection_from_fit_print,
)

EXPERT_BYTES = 1000  # per stacked expert tensor
ATTN_BYTES = 10


def _facts(n_layer: int = 4) -> GgufFacts:
    tensors = [
        ("token_embd.weight", 500),
        ("output_norm.weight", 4),
        ("output.weight", 700),
    ]
    for i in range(n_layer):
        tensors += [
            (f"blk.{i}.attn_q.weight", ATTN_BYTES),
            (f"blk.{i}.ffn_gate_inp.weight", 3),
        ]
        tensors += [(f"blk.{i}.ffn_{p}_exps.weight", EXPERT_BYTES) for p in ("gate", "up", "down")]
    return GgufFacts(
        n_layer=n_layer,
        n_embd=64,
        n_head=4,
        n_head_kv=2,
        head_dim_k=16,
        head_dim_v=16,
        n_vocab=1000,
        n_expert=32,
        n_expert_used=4,
        n_ff_exp=32,
        tensor_bytes=tuple(tensors),
    )


def test_first_n_layers_experts_and_token_embedding_stay_on_the_host():
    facts = _facts()
    all_bytes = sum(b for _, b in facts.tensor_bytes)
    for n in range(5):
        p = project(facts, n, 1024)
        assert p.host_model_bytes == 500 + 3 * EXPERT_BYTES * n
        assert p.gpu_model_bytes + p.host_model_bytes == all_bytes
    assert project(facts, 1, 1024).gpu_model_bytes - project(facts, 2, 1024).gpu_model_bytes == 3 * EXPERT_BYTES


def test_kv_is_cells_padded_to_256_times_kv_heads_times_k_plus_v_dims_in_f16():
    facts = _facts()
    assert kv_bytes_per_layer(facts, 1000) == 1024 * 2 * (16 + 16) * 2
    assert project(facts, 0, 1000).gpu_context_bytes == 4 * 1024 * 2 * 32 * 2


def test_flash_attention_drops_the_score_matrix_and_halves_the_mask():
    facts = _facts()
    without = project(facts, 0, 1024, flash_attn=False).gpu_compute_bytes
    with_fa = project(facts, 0, 1024, flash_attn=True).gpu_compute_bytes
    assert without - with_fa == 4 * facts.n_head * 512 * 1024 + (4 - 2) * 512 * 1024


def test_separate_kv_streams_shrink_the_attention_span():
    facts = _facts()
    unified = project(facts, 0, 2048).gpu_compute_bytes
    split = project(facts, 0, 2048, n_kv_streams=2).gpu_compute_bytes
    assert unified - split == 4 * 512 * 1024 * (1 + facts.n_head)


def test_cpu_layers_from_ngl_move_whole_layers_and_output():
    facts = _facts()
    p = project(facts, 0, 1024, n_gpu_layers=2)  # layers 0 and 1 on the CPU, output too (ngl <= n_layer)
    layer_bytes = ATTN_BYTES + 3 + 3 * EXPERT_BYTES
    assert p.gpu_model_bytes == 2 * layer_bytes
    assert p.gpu_context_bytes == 2 * kv_bytes_per_layer(facts, 1024)


def test_fit_check_includes_the_margin():
    p = Projection(
        3,
        gpu_model_bytes=10 * MIB,
        gpu_context_bytes=2 * MIB,
        gpu_compute_bytes=3 * MIB,
        host_model_bytes=0,
        source="benchsuite",
    )
    assert p.fits(16 * MIB, margin_bytes=MIB)
    assert not p.fits(16 * MIB, margin_bytes=2 * MIB)


FIT_PRINT = """\
llama_fit_params: printing estimated memory in MiB to stdout (device, model, context, compute) ...
CUDA0 17105 960 301
Host 312 0 12
"""


def test_parse_fit_print_lines():
    rows = parse_fit_print(FIT_PRINT)
    assert [(r.device, r.model_mib, r.context_mib, r.compute_mib) for r in rows] == [
        ("CUDA0", 17105, 960, 301),
        ("Host", 312, 0, 12),
    ]
    p = projection_from_fit_print(FIT_PRINT, n_cpu_moe=7)
    assert p.gpu_total_bytes == (17105 + 960 + 301) * MIB
    assert (p.host_model_bytes, p.source, p.n_cpu_moe) == (
        312 * MIB,
        "llama-fit-params",
        7,
    )


def test_fit_print_without_a_gpu_line_is_an_error():
    with pytest.raises(ValueError, match="no GPU device"):
        projection_from_fit_print("Host 5 1 2\n", n_cpu_moe=0)


def test_fit_params_argv_pins_the_server_flags():
    argv = fit_params_argv("bin/llama-fit-params", "m.gguf", 5, 10240, 4, True, 999)
    assert argv[argv.index("--n-cpu-moe") + 1] == "5"
    assert argv[argv.index("-c") + 1] == "10240" and argv[argv.index("-np") + 1] == "4"
    assert argv[-2:] == ["--fit-print", "on"] and "--kv-unified" not in argv  # a server-only flag


def _qwen3_30b_a3b_shape(n_layer: int) -> GgufFacts:
    """Tensor bytes of the generated qwen3-30b-a3b-shape checkpoint exported as bf16 (its trained vocab: 1042)."""
    h, heads, kv_heads, d, e, i, v = 2048, 32, 4, 128, 128, 768, 1042
    bf16, f32 = 2, 4
    tensors = [
        ("token_embd.weight", v * h * bf16),
        ("output_norm.weight", h * f32),
        ("output.weight", v * h * bf16),
    ]
    for layer in range(n_layer):
        b = f"blk.{layer}."
        tensors += [
            (b + "attn_norm.weight", h * f32),
            (b + "ffn_norm.weight", h * f32),
            (b + "attn_q.weight", heads * d * h * bf16),
            (b + "attn_k.weight", kv_heads * d * h * bf16),
            (b + "attn_v.weight", kv_heads * d * h * bf16),
            (b + "attn_output.weight", h * heads * d * bf16),
            (b + "attn_q_norm.weight", d * f32),
            (b + "attn_k_norm.weight", d * f32),
            (b + "ffn_gate_inp.weight", e * h * f32),
        ]
        tensors += [(b + f"ffn_{p}_exps.weight", e * i * h * bf16) for p in ("gate", "up", "down")]
    return GgufFacts(n_layer, h, heads, kv_heads, d, d, v, e, 8, i, tuple(tensors))


# llama-fit-params on an H200 (CUDA build of the pinned sdist), 8-layer qwen3-30b-a3b-shape bf16 GGUF,
# -ngl 999 -c 10240 -np 1 -fa on: CUDA0 (model, context, compute) MiB for n_cpu_moe = 0..8.
H200_FIT_PRINT_MIB = {
    0: (9516, 160, 94),
    1: (8364, 160, 454),
    4: (4908, 160, 454),
    8: (300, 160, 454),
}


@pytest.mark.parametrize("n_cpu_moe", sorted(H200_FIT_PRINT_MIB))
def test_projection_matches_llama_cpp_on_an_h200(n_cpu_moe):
    model_mib, context_mib, compute_mib = H200_FIT_PRINT_MIB[n_cpu_moe]
    ours = project(_qwen3_30b_a3b_shape(8), n_cpu_moe, 10240, flash_attn=True)
    assert ours.gpu_model_bytes // MIB == model_mib
    assert ours.gpu_context_bytes // MIB == context_mib
    assert abs(ours.gpu_compute_bytes / MIB - compute_mib) <= 40


def test_fit_params_argv_carries_the_servers_batch_sizes():
    argv = fit_params_argv("bin/llama-fit-params", "m.gguf", 5, 10240, 4, True, 999, batch_size=2048, ubatch_size=1024)
    assert (argv[argv.index("-b") + 1], argv[argv.index("-ub") + 1], argv[argv.index("-fa") + 1]) == (
        "2048",
        "1024",
        "on",
    )


def test_a_larger_micro_batch_grows_the_projected_compute_buffer():
    facts = _facts()
    small = project(facts, 0, 4096, flash_attn=True, n_ubatch=512).gpu_compute_bytes
    large = project(facts, 0, 4096, flash_attn=True, n_ubatch=2048).gpu_compute_bytes
    per_token = 4 * (4 * facts.n_embd + 3 * facts.n_expert_used * facts.n_ff_exp) + 2 * 4096
    assert large - small == 1536 * per_token
