"""What the SGLang adapter sets itself, so a matrix's `extra_args` cannot set it again: a second
value would silently win in argparse (a fairness setting, the port, the mode). `OWNED_FLAGS` names
each flag with the option that sets it; `extra_args_problems` is the options model's validator
(benchsuite.engines.sglang.options), so the matrix load names the flag.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["OWNED_FLAGS", "extra_args_problems"]

# Flags the adapter derives from options or from the matrix fairness block; extra_args may not
# repeat them (a second value would silently win in argparse). Value: the option that sets it.
OWNED_FLAGS: dict[str, str] = {
    "--model-path": "model_path",
    "--model": "model_path",  # alias, arg_groups/fields/model.py:55
    "--host": "(fixed: 127.0.0.1)",
    "--port": "(chosen by the runner)",
    "--disable-radix-cache": "fairness.prefix_caching",
    "--max-total-tokens": "fairness.kv_capacity_tokens",
    "--max-running-requests": "the workloads' highest concurrency",
    "--enable-metrics": "(always on)",
    "--enable-paged-experts": "mode",
    "--paged-experts-num-resident": "resident_experts",
    "--cpu-offload-gb": "cpu_offload_gb",
    "--mem-fraction-static": "mem_fraction_static",
    "--quantization": "quantization",
    "--kv-cache-dtype": "kv_cache_dtype",
    "--tp-size": "tp_size",
    "--tensor-parallel-size": "tp_size",
    "--ep-size": "ep_size",
    "--ep": "ep_size",
    "--expert-parallel-size": "ep_size",
    "--pp-size": "pp_size",
    "--pipeline-parallel-size": "pp_size",
    "--dp-size": "dp_size",
    "--data-parallel-size": "dp_size",
    "--speculative-algorithm": "speculative_algorithm",
    "--speculative-draft-model-path": "speculative_draft_model_path",
    "--speculative-draft-model": "speculative_draft_model_path",
    "--disable-cuda-graph": "disable_cuda_graph",
    "--cuda-graph-config": "cuda_graph_backend_decode / cuda_graph_backend_prefill",
    "--cuda-graph-backend-decode": "cuda_graph_backend_decode",
    "--cuda-graph-backend-prefill": "cuda_graph_backend_prefill",
    "--disable-decode-cuda-graph": "cuda_graph_backend_decode",
    "--disable-prefill-cuda-graph": "cuda_graph_backend_prefill",
    "--cuda-graph-max-bs-decode": "cuda_graph_max_bs",
    "--load-format": "load_format",
    "--moe-runner-backend": "moe_runner_backend",
    "--disable-shared-experts-fusion": "disable_shared_experts_fusion",
    "--enable-deterministic-inference": "deterministic",
    "--enable-return-routed-experts": "return_routed_experts",
}


def extra_args_problems(extra_args: Sequence[str]) -> list[str]:
    """Flags in extra_args that the adapter owns (any mode). SGLang parses with argparse, which
    takes any unambiguous prefix of a long flag (`--max-total` is `--max-total-tokens`), so a
    prefix of an owned flag is refused too, naming the flag it would set."""
    problems = []
    for arg in extra_args:
        flag = arg.split("=", 1)[0]
        if flag in OWNED_FLAGS:
            problems.append(f"extra_args {flag}: set through {OWNED_FLAGS[flag]} instead")
            continue
        if flag.startswith("--") and len(flag) > 2:
            owned = sorted(f for f in OWNED_FLAGS if f.startswith(flag))
            if owned:
                problems.append(
                    f"extra_args {flag}: argparse reads it as {owned[0]}, set through {OWNED_FLAGS[owned[0]]} instead"
                )
    return problems
