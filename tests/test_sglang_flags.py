"""Where sglang is installed: every command the adapter writes parses with sglang's own argument
parser (0.5.23 ServerArgs.add_cli_args) into the intended fields. Skipped without sglang."""

from __future__ import annotations

import argparse
import sys

import pytest

from benchsuite.engines.base import Fairness, ServerSpec
from benchsuite.engines.sglang.adapter import SGLangAdapter, SGLangOptions

server_args = pytest.importorskip("sglang.srt.server_args", reason="sglang is not installed here")

OPTIONS = [
    {"mode": "paged", "resident_experts": 92, "mem_fraction_static": 0.88},
    {"mode": "offload", "cpu_offload_gb": 5, "kv_cache_dtype": "fp8_e4m3", "quantization": "gptq_marlin"},
    {"mode": "unpaged", "disable_cuda_graph": True, "deterministic": True, "return_routed_experts": True,
     "disable_shared_experts_fusion": True, "moe_runner_backend": "triton", "load_format": "safetensors"},
    {"mode": "unpaged", "cuda_graph_backend_decode": "full", "cuda_graph_backend_prefill": "breakable",
     "cuda_graph_max_bs": 4, "tp_size": 2, "speculative_algorithm": "EAGLE", "speculative_draft_model_path": "/d"},
]  # fmt: skip


@pytest.mark.parametrize("options", OPTIONS)
def test_sglang_parses_our_commands(options: dict) -> None:
    spec = ServerSpec(
        "s",
        "sglang",
        SGLangOptions.model_validate({"model_path": "/m", **options}),
        Fairness(10240, False),
        4,
        "i",
    )
    argv = SGLangAdapter().launch_plan(spec, 8000).argv
    assert argv[:3] == [sys.executable, "-m", "sglang.launch_server"]
    parser = argparse.ArgumentParser()
    server_args.ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(argv[3:])
    assert (ns.model_path, ns.port, ns.max_total_tokens, ns.max_running_requests) == ("/m", 8000, 10240, 4)
    assert ns.disable_radix_cache and ns.enable_metrics
    assert ns.enable_paged_experts == (options["mode"] == "paged")
    assert ns.paged_experts_num_resident == options.get("resident_experts")
    assert ns.cpu_offload_gb == options.get("cpu_offload_gb", 0)
    for field in ("mem_fraction_static", "tp_size", "speculative_algorithm", "moe_runner_backend", "load_format"):
        if field in options:
            assert getattr(ns, field) == options[field]
    if options.get("disable_cuda_graph"):
        assert (ns.cuda_graph_backend_decode, ns.cuda_graph_backend_prefill) == ("disabled", "disabled")
    if "cuda_graph_max_bs" in options:
        assert ns.cuda_graph_max_bs_decode == options["cuda_graph_max_bs"]
    assert ns.enable_deterministic_inference == options.get("deterministic", False)
    assert ns.enable_return_routed_experts == options.get("return_routed_experts", False)
