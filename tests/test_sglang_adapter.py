"""The SGLang adapter's exact command lines (golden, every mode), options validation, request
extras, version probe and log-derived flags. No SGLang here: the commands are checked against the
0.5.23 flag names by test_sglang_flags.py where sglang is installed."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pydantic
import pytest

from benchsuite.engines import ADAPTERS
from benchsuite.engines.base import Fairness, ServerSpec
from benchsuite.engines.sglang.adapter import SGLangAdapter, SGLangOptions

FAIRNESS = Fairness(10240, prefix_caching=False)
PY = sys.executable
HEAD = [PY, "-m", "sglang.launch_server", "--model-path", "/models/q", "--host", "127.0.0.1", "--port", "8000",
        "--disable-radix-cache", "--max-total-tokens", "10240", "--enable-metrics"]  # fmt: skip


def spec(options: dict[str, Any], fairness: Fairness | None = None, max_concurrency: int = 4) -> ServerSpec:
    return ServerSpec(
        "sgl", "sglang", SGLangOptions.model_validate({"model_path": "/models/q", **options}), fairness or FAIRNESS,
        max_concurrency, "id",
    )  # fmt: skip


def argv(options: dict[str, Any], **kw: Any) -> list[str]:
    return SGLangAdapter().launch_plan(spec(options, **kw), 8000).argv


def test_registry_finds_the_adapter() -> None:
    assert ADAPTERS["sglang"].kind == "sglang"
    assert ADAPTERS["sglang"].options_model is SGLangOptions


def test_paged_command_published_k92() -> None:
    got = argv({"mode": "paged", "resident_experts": 92, "mem_fraction_static": 0.88})
    assert got == HEAD + ["--enable-paged-experts", "--paged-experts-num-resident", "92",
                          "--mem-fraction-static", "0.88", "--max-running-requests", "4"]  # fmt: skip


def test_offload_command() -> None:
    got = argv({"mode": "offload", "cpu_offload_gb": 6, "mem_fraction_static": 0.88}, max_concurrency=1)
    assert got == HEAD + ["--cpu-offload-gb", "6", "--mem-fraction-static", "0.88", "--max-running-requests", "1"]


def test_unpaged_command_is_the_fairness_flags_only() -> None:
    assert argv({"mode": "unpaged"}) == HEAD + ["--max-running-requests", "4"]


def test_every_option_in_its_place() -> None:
    got = argv({
        "mode": "unpaged", "quantization": "gptq_marlin", "kv_cache_dtype": "fp8_e4m3", "tp_size": 2,
        "speculative_algorithm": "EAGLE", "speculative_draft_model_path": "/models/d",
        "cuda_graph_backend_decode": "full", "cuda_graph_backend_prefill": "disabled", "cuda_graph_max_bs": 8,
        "load_format": "safetensors", "moe_runner_backend": "triton", "disable_shared_experts_fusion": True,
        "deterministic": True, "return_routed_experts": True, "python": "/opt/sgl/bin/python",
        "extra_args": ["--context-length", "4096"],
    })  # fmt: skip
    assert got == ["/opt/sgl/bin/python"] + HEAD[1:] + [
        "--quantization", "gptq_marlin", "--kv-cache-dtype", "fp8_e4m3", "--tp-size", "2",
        "--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", "/models/d",
        "--cuda-graph-backend-decode", "full", "--cuda-graph-backend-prefill", "disabled",
        "--cuda-graph-max-bs-decode", "8", "--load-format", "safetensors", "--moe-runner-backend", "triton",
        "--disable-shared-experts-fusion", "--enable-deterministic-inference", "--enable-return-routed-experts",
        "--max-running-requests", "4", "--context-length", "4096",
    ]  # fmt: skip


def test_disable_cuda_graph_writes_both_phase_backends_not_the_deprecated_flag() -> None:
    got = argv({"mode": "unpaged", "disable_cuda_graph": True})
    assert "--disable-cuda-graph" not in got
    assert got[-6:-2] == ["--cuda-graph-backend-decode", "disabled", "--cuda-graph-backend-prefill", "disabled"]


def test_prefix_caching_on_keeps_the_radix_cache() -> None:
    got = argv({"mode": "unpaged"}, fairness=Fairness(2048, prefix_caching=True))
    assert "--disable-radix-cache" not in got
    assert got[got.index("--max-total-tokens") + 1] == "2048"


def test_launch_plan_uses_the_generate_health_endpoint() -> None:
    plan = SGLangAdapter().launch_plan(spec({"mode": "paged", "resident_experts": 16}), 8123)
    assert plan.health_path == "/health_generate"
    assert plan.argv[plan.argv.index("--port") + 1] == "8123"
    assert SGLangAdapter.flush_cache_path == "/flush_cache"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"mode": "paged"}, "mode paged needs resident_experts"),
        ({"mode": "offload"}, "mode offload needs cpu_offload_gb"),
        ({"mode": "offload", "cpu_offload_gb": 16.6}, "valid integer"),
        ({"mode": "unpaged", "resident_experts": 8}, "resident_experts applies only to mode paged"),
        ({"mode": "paged", "resident_experts": 8, "cpu_offload_gb": 2}, "cpu_offload_gb applies only to mode offload"),
        ({"mode": "unpaged", "quantization": "int4"}, "not an sglang 0.5.23 choice"),
        ({"mode": "unpaged", "load_format": "bogus"}, "not an sglang 0.5.23 choice"),
        ({"mode": "unpaged", "kv_cache_dtype": "int8"}, "Input should be"),
        ({"mode": "unpaged", "disable_cuda_graph": True, "cuda_graph_backend_decode": "full"}, "conflicts"),
        ({"mode": "unpaged", "speculative_draft_model_path": "/d"}, "needs speculative_algorithm"),
        ({"mode": "unpaged", "typo_option": 1}, "Extra inputs are not permitted"),
    ],
)
def test_options_refused(options: dict[str, Any], message: str) -> None:
    with pytest.raises(pydantic.ValidationError, match=message):
        SGLangOptions.model_validate({"model_path": "/m", **options})


def test_model_path_is_expanded_once_by_the_matrix(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """`${VAR}` belongs to the matrix loader (config/env_refs.py); the options only expand `~`, so the
    `$${` escape reaches the command line as a literal `${`, and a dry run's placeholder survives."""
    from benchsuite.config.matrix import load_matrix

    monkeypatch.setenv("QWEN_INT4", "/data/qwen-int4")
    matrix = tmp_path / "m.yaml"
    body = "name: m\nengines:\n  s: {kind: sglang, options: {model_path: '%s', mode: unpaged}}\nworkloads: {w: {}}\n"
    matrix.write_text(body % "${QWEN_INT4}")
    assert load_matrix(matrix).option_sets["s"][0].options.model_path == "/data/qwen-int4"
    matrix.write_text(body % "/data/$${literal}")
    assert load_matrix(matrix).option_sets["s"][0].options.model_path == "/data/${literal}"
    monkeypatch.delenv("QWEN_INT4")
    matrix.write_text(body % "${QWEN_INT4}")
    assert load_matrix(matrix, placeholders=True).option_sets["s"][0].options.model_path == "${QWEN_INT4}"
    assert SGLangOptions.model_validate({"model_path": "~/m", "mode": "unpaged"}).model_path.endswith("/m")


def test_request_extras_only_with_routing_capture() -> None:
    adapter = SGLangAdapter()
    assert adapter.request_extras(spec({"mode": "unpaged"})) == {}
    assert adapter.request_extras(spec({"mode": "unpaged", "return_routed_experts": True})) == {
        "return_routed_experts": True
    }
    assert spec({"mode": "offload", "cpu_offload_gb": 3}).options.placement().mode == "offload"


def test_version_when_sglang_is_missing() -> None:
    facts = SGLangAdapter().version(spec({"mode": "unpaged", "python": "/nonexistent/python3"}))
    assert facts["version"] == "not installed"
    assert facts["engine"] == "sglang" and facts["reference_version"] == "0.5.23"


def test_version_of_an_installed_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pkg = tmp_path / "sglang"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("__version__ = '0.5.23'\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    facts = SGLangAdapter().version(spec({"mode": "unpaged"}))
    assert facts["version"] == "0.5.23" and facts["matches_reference"] is True


def test_validate_rejects_owned_flags() -> None:
    adapter = SGLangAdapter()
    with pytest.raises(ValueError, match="extra_args --max-total-tokens: set through fairness.kv_capacity_tokens"):
        adapter.validate(spec({"mode": "unpaged", "extra_args": ["--max-total-tokens=999"]}))
    adapter.validate(spec({"mode": "offload", "cpu_offload_gb": 4, "extra_args": ["--context-length", "4096"]}))


def test_tokenizer_dir_is_the_local_checkpoint(tmp_path: Path) -> None:
    adapter = SGLangAdapter()
    (tmp_path / "config.json").write_text("{}")
    assert adapter.tokenizer_dir(spec({"mode": "unpaged", "model_path": str(tmp_path)})) == tmp_path
    with pytest.raises(ValueError, match="exact-length prompts need model_path to be a local checkpoint"):
        adapter.tokenizer_dir(spec({"mode": "unpaged", "model_path": "Qwen/Qwen3-30B-A3B"}))
