"""Each SGLang 0.5.23 Paged Experts constraint refuses a bad spec before launch, with its source."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from benchsuite.engines.base import EngineConfigError, Fairness, ServerSpec
from benchsuite.engines.sglang.adapter import SGLangAdapter, SGLangOptions
from benchsuite.engines.sglang.constraints import PAGED_CHECKS, facts_from_config, paged_problems, read_model_facts
from benchsuite.tools.reference import load_reference

GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": False}
FP8_BLOCK = {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}


def model_dir(tmp_path: Path, quantization: dict[str, Any] | None = GPTQ, **overrides: Any) -> str:
    config = dict(load_reference("pr42557").raw["hf_config"])  # Qwen3-30B-A3B: E=128, top_k=8
    if quantization is not None:
        config["quantization_config"] = quantization
    config.update(overrides)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def check(path: str, **options: Any) -> None:
    spec = ServerSpec("sgl", "sglang",
                      SGLangOptions.model_validate({"model_path": path, "mode": "paged", "resident_experts": 26,
                                                    **options}),
                      Fairness(10240, False), 4, "id")  # fmt: skip
    SGLangAdapter().validate(spec)


def test_published_setups_pass(tmp_path: Path) -> None:
    check(model_dir(tmp_path), resident_experts=92, mem_fraction_static=0.88)
    check(model_dir(tmp_path, FP8_BLOCK), resident_experts=40)
    check(model_dir(tmp_path, None), resident_experts=8, disable_cuda_graph=True)  # bf16, K = top_k


def test_k_larger_than_e_is_clamped_by_sglang_not_refused(tmp_path: Path) -> None:
    check(model_dir(tmp_path), resident_experts=500)  # method.py:269 min(K, E)


@pytest.mark.parametrize(
    ("options", "message", "source"),
    [
        ({"resident_experts": 7}, "resident_experts 7 < top_k 8", "method.py:332-339"),
        ({"tp_size": 2}, "tp_size=2: paged experts is single GPU only", "method.py:306-309"),
        ({"ep_size": 2}, "ep_size=2", "method.py:306-309"),
        ({"pp_size": 2}, "pp_size=2", "method.py:306-309"),
        ({"dp_size": 2}, "dp_size=2", "method.py:306-309"),
        ({"speculative_algorithm": "EAGLE"}, "speculative decoding is not supported", "method.py:312-313"),
        (
            {"cuda_graph_backend_prefill": "full"},
            "prefill CUDA graphs must be breakable or disabled",
            "method.py:316-322",
        ),
        (
            {"cuda_graph_backend_decode": "breakable"},
            "decode CUDA graphs must be full or disabled",
            "method.py:323-327",
        ),
        ({"load_format": "dummy"}, "load_format dummy: not supported", "method.py:328-331"),
        ({"extra_args": ["--enable-eplb"]}, "--enable-eplb is not supported", "method.py:310-311"),
        ({"extra_args": ["--enable-fused-moe-sum-all-reduce"]}, "sums the top-k outputs itself", "method.py:345-349"),
        ({"moe_runner_backend": "flashinfer_cutlass"}, "needs the triton or marlin MoE runner", "runners.py:155-170"),
        (
            {"moe_runner_backend": "experimental_sgl_marlin"},
            "needs the triton or marlin MoE runner",
            "runners.py:155-170",
        ),
        ({"quantization": "gptq"}, "forces the non-Marlin GPTQ MoE method", "formats.py:148-334"),
    ],
)
def test_each_constraint(tmp_path: Path, options: dict[str, Any], message: str, source: str) -> None:
    with pytest.raises(EngineConfigError, match=message) as err:
        check(model_dir(tmp_path), **options)
    assert source in str(err.value) and "sglang 0.5.23" in str(err.value)
    assert "\n" not in str(err.value)


def test_shared_experts_need_fusion_disabled(tmp_path: Path) -> None:
    path = model_dir(tmp_path, None, shared_expert_intermediate_size=5632)
    with pytest.raises(EngineConfigError, match="set disable_shared_experts_fusion: true.*method.py:350-353"):
        check(path, resident_experts=16)
    check(path, resident_experts=16, disable_shared_experts_fusion=True)


@pytest.mark.parametrize(
    ("quantization", "requested", "ok"),
    [
        (FP8_BLOCK, None, True),
        ({"quant_method": "fp8"}, None, False),  # per-tensor FP8 checkpoint: Fp8BlockFormat needs blocks
        (None, "fp8", False),  # online FP8 of a bf16 checkpoint is not FP8-serialized
        (GPTQ, "gptq_marlin", True),
        ({"quant_method": "awq", "bits": 4}, None, True),
        ({"quant_method": "bitsandbytes"}, None, False),
        (None, "moe_wna16", False),
        (None, "mxfp4", True),
        (None, "w8a8_int8", True),
    ],
)
def test_quantization_formats(
    tmp_path: Path, quantization: dict[str, Any] | None, requested: str | None, ok: bool
) -> None:
    opts = SGLangOptions.model_validate(
        {"model_path": "/m", "mode": "paged", "resident_experts": 16, "quantization": requested}
    )
    problems = paged_problems(opts, facts_from_config({"num_experts": 128, "num_experts_per_tok": 8,
                                                      "quantization_config": quantization or {}}))  # fmt: skip
    assert (problems == []) is ok, problems


def test_several_problems_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(EngineConfigError) as err:
        check(model_dir(tmp_path), resident_experts=4, tp_size=2, load_format="dummy")
    text = str(err.value)
    assert text.count("[sglang 0.5.23") == 3 and "\n" not in text


def test_paged_needs_a_local_config(tmp_path: Path) -> None:
    with pytest.raises(EngineConfigError, match="config.json not found"):
        read_model_facts(str(tmp_path / "absent"))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(EngineConfigError, match="cannot read"):
        read_model_facts(str(tmp_path))


def test_missing_top_k_is_a_problem_not_a_pass() -> None:
    opts = SGLangOptions.model_validate({"model_path": "/m", "mode": "paged", "resident_experts": 16})
    problems = paged_problems(opts, facts_from_config({"num_experts": 64}))
    assert any("no num_experts_per_tok" in p for p in problems)


def test_every_check_names_its_source() -> None:
    names = [name for name, _, _ in PAGED_CHECKS]
    assert len(names) == len(set(names)) == 11
    assert all(source.startswith("sglang 0.5.23 srt/layers/moe/paged_experts/") for _, source, _ in PAGED_CHECKS)
