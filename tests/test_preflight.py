"""Preflight reproduces the published Qwen3-30B-A3B arithmetic (DESIGN.md sections 2-3)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from benchsuite.checks import preflight_report as pfr
from benchsuite.cli import main as cli_main
from benchsuite.errors import UserError
from benchsuite.tools import preflight as pf

REFERENCE = Path(__file__).resolve().parents[1] / "benchsuite" / "data" / "reference" / "pr42557.yaml"
QWEN3_CONFIG = {
    "model_type": "qwen3_moe", "hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 32,
    "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144, "moe_intermediate_size": 768,
    "num_experts": 128, "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "vocab_size": 151936, "tie_word_embeddings": False,
}  # fmt: skip
INT4_PUBLISHED_BYTES = 2.43e6
FP8_PUBLISHED_BYTES = 4.72e6
PCIE5_X16_B_PER_S = 50e9  # DESIGN.md section 5: measured pinned paging ceiling on PCIe 5.0 x16
PCIE4_X8_B_PER_S = pf.pcie_payload_b_per_s(4, 8)  # 15.75 GB/s theoretical payload


@pytest.fixture
def shape() -> pf.ModelShape:
    return pf.shape_from_config(QWEN3_CONFIG, name="Qwen3-30B-A3B")


def test_config_matches_reference_file(shape: pf.ModelShape) -> None:
    ref = yaml.safe_load(REFERENCE.read_text())
    assert pf.shape_from_config(ref["hf_config"]).num_moe_layers == ref["model_shape"]["num_moe_layers"]
    assert {k: ref["hf_config"][k] for k in QWEN3_CONFIG} == QWEN3_CONFIG


def test_expert_sizes_match_published(shape: pf.ModelShape) -> None:
    assert shape.expert_bytes("bfloat16") == 3 * 2048 * 768 * 2
    assert shape.expert_bytes_int4_gptq() == pytest.approx(INT4_PUBLISHED_BYTES, rel=0.002)
    assert shape.expert_bytes_fp8_block() == pytest.approx(FP8_PUBLISHED_BYTES, rel=0.001)
    # asymmetric GPTQ adds packed 4-bit zeros: larger than the symmetric layout
    assert shape.expert_bytes_int4_gptq(zero_points=True) - shape.expert_bytes_int4_gptq() == 18432


def test_slot_sizes_match_published(shape: pf.ModelShape) -> None:
    assert pf.slot_bytes(shape.expert_bytes_int4_gptq(), shape.num_moe_layers) / 1e6 == pytest.approx(117, abs=0.5)
    assert pf.slot_bytes(shape.expert_bytes_fp8_block(), shape.num_moe_layers) / 1e6 == pytest.approx(227, abs=0.6)
    assert pf.slot_bytes(INT4_PUBLISHED_BYTES, 48) == pytest.approx(116.64e6)


def test_kv_bytes_per_token_and_tokens_per_slot(shape: pf.ModelShape) -> None:
    assert shape.kv_bytes_per_token(2) == 98_304
    assert shape.kv_bytes_per_token(1) == 49_152
    assert pf.kv_tokens_per_slot(pf.slot_bytes(INT4_PUBLISHED_BYTES, 48), 98_304) == 1186
    assert pf.kv_tokens_per_slot(pf.slot_bytes(FP8_PUBLISHED_BYTES, 48), 98_304) == 2304


@pytest.mark.parametrize(("k", "cap"), [(92, 11), (40, 5), (24, 3), (26, 3)])
def test_batch_caps(k: int, cap: int) -> None:
    assert pf.batch_cap(k, 8) == cap
    # the published 4-request losses are exactly the K with K // 8 < 4
    assert (cap < 4) == (k in (24, 26))


@pytest.mark.parametrize(
    ("expert_bytes", "k", "tok_per_s", "link_b_per_s", "bound", "implied"),
    [
        (INT4_PUBLISHED_BYTES, 92, 205.6, PCIE5_X16_B_PER_S, 0.2606, False),  # desktop int4
        (FP8_PUBLISHED_BYTES, 40, 87.7, PCIE5_X16_B_PER_S, 0.3146, True),  # desktop fp8
        (INT4_PUBLISHED_BYTES, 26, 32.6, PCIE4_X8_B_PER_S, 0.5179, True),  # laptop int4
    ],
)
def test_max_miss_bounds(expert_bytes, k, tok_per_s, link_b_per_s, bound, implied) -> None:
    all_miss = pf.all_miss_bytes_per_token(48, 8, expert_bytes)
    got = pf.max_miss_allowed(link_b_per_s, tok_per_s, all_miss)
    assert got == pytest.approx(bound, abs=5e-4)
    assert pf.reuse_implied(got, pf.random_miss(k, 128)) is implied


def test_all_miss_prefill_pinned(shape: pf.ModelShape) -> None:
    assert pf.all_miss_bytes_per_token(48, 8, INT4_PUBLISHED_BYTES) == pytest.approx(933.12e6)
    assert pf.prefill_page_in_bytes(92, 128, 116.64e6) == pytest.approx(36 * 116.64e6)
    assert pf.pinned_host_bytes(128, 48, INT4_PUBLISHED_BYTES) == pytest.approx(14.93e9, rel=1e-3)
    # laptop (54 GB RAM, WSL2): int4 experts fit under the half-RAM pin cap, FP8 experts do not
    cap = pf.pinned_cap_bytes(54 * pf.GIB_BYTES, wsl2=True)
    assert (
        pf.pinned_host_bytes(128, 48, INT4_PUBLISHED_BYTES) < cap < pf.pinned_host_bytes(128, 48, FP8_PUBLISHED_BYTES)
    )


def test_k_that_fits_published_desktop_and_laptop(shape: pf.ModelShape) -> None:
    report = pfr.preflight(pfr.PreflightInputs(shape=shape, formats=("int4",), vram_bytes=16 * pf.GIB_BYTES))
    assert report.formats[0].k_fit == 92  # the published desktop K
    laptop = pfr.preflight(pfr.PreflightInputs(shape=shape, formats=("int4",), vram_bytes=8 * pf.GIB_BYTES))
    assert 26 <= laptop.formats[0].k_fit <= 28  # published laptop K=26 fits, little headroom


def test_fp8_format_counts_fp8_attention(shape: pf.ModelShape) -> None:
    """A block-FP8 checkpoint's attention projections are FP8 too (SGLang and the built-in runtime keep them so):
    the fp8 column's non-expert bytes are 0.90 GB lower than bf16 attention's, which is ~4 more K at 16 GB; the
    other formats and an explicit --non-expert-gb are unchanged."""
    inp = pfr.PreflightInputs(shape=shape, formats=("bf16", "fp8", "int4"), vram_bytes=16 * pf.GIB_BYTES)
    bf16, fp8, int4 = pfr.preflight(inp).formats
    dense = shape.non_expert_weight_bytes(2.0)
    assert bf16.non_expert_weight_bytes == int4.non_expert_weight_bytes == dense
    assert fp8.non_expert_weight_bytes == shape.non_expert_weight_bytes(2.0, fp8_attention=True)
    assert 0.90e9 < dense - fp8.non_expert_weight_bytes < 0.91e9
    assert int4.k_fit == 92  # the published desktop K, as before
    explicit = pfr.PreflightInputs(
        shape=shape, formats=("fp8",), vram_bytes=16 * pf.GIB_BYTES, explicit_non_expert_bytes=dense
    )
    old = pfr.preflight(explicit).formats[0]
    assert old.non_expert_weight_bytes == dense
    assert fp8.k_fit is not None and old.k_fit is not None
    assert fp8.k_fit - old.k_fit in (3, 4)  # 0.90 GB over 227 MB slots


def test_verdict_flags_waves_and_pinned_overflow(shape: pf.ModelShape) -> None:
    inp = pfr.PreflightInputs(
        shape=shape, formats=("fp8",), k=24, concurrency=4, ram_bytes=54 * pf.GIB_BYTES, wsl2=True
    )
    verdict = pfr.preflight(inp).formats[0].verdict
    assert any(v.startswith("WARN") and "several waves" in v for v in verdict)
    assert any(v.startswith("FAIL") and "pinned" in v for v in verdict)


def test_parse_link_forms(tmp_path: Path) -> None:
    assert pf.parse_link("50")[0] == 50e9
    assert pf.parse_link("pcie5x16")[0] == pytest.approx(63.02e9, rel=1e-3)
    with pytest.raises(UserError):
        pf.parse_link("fast")


def test_cli_json_and_table(tmp_path: Path, capsys) -> None:
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_CONFIG))
    argv = ["preflight", "--model", str(tmp_path), "--format", "int4", "--k", "92", "--link-gbps", "50",
            "--tok-s", "205.6", "--concurrency", "4", "--json"]  # fmt: skip
    assert cli_main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    (f,) = out["formats"]
    assert out["kv_bytes_per_token_bf16"] == 98_304
    assert f["batch_cap"] == 11 and f["min_k_for_concurrency"] == 32
    assert f["max_miss_allowed"] == pytest.approx(50e9 / (205.6 * 48 * 8 * f["expert_bytes"]))
    assert cli_main(argv[:-1]) == 0
    assert "batch cap K // top_k" in capsys.readouterr().out


def test_cli_explicit_shape(capsys) -> None:
    argv = ["preflight", "--layers", "48", "--experts", "128", "--top-k", "8", "--expert-mb", "2.43",
            "--kv-bytes-per-token", "98304", "--k", "26", "--json"]  # fmt: skip
    assert cli_main(argv) == 0
    (f,) = json.loads(capsys.readouterr().out)["formats"]
    assert f["slot_bytes"] == pytest.approx(116.64e6) and f["batch_cap"] == 3
    assert f["kv_tokens_per_slot_bf16"] == 1186
    assert cli_main(["preflight", "--layers", "48"]) == 2
