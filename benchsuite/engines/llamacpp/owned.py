"""What the llama.cpp adapter sets itself, so a matrix's `extra_args` and `env:` cannot re-set it.

A second `-c` or `-np` in extra_args would silently win over the fair KV capacity and slot count
(llama.cpp keeps the last value), `--host 0.0.0.0` would expose the server, and every flag also
reads an `LLAMA_ARG_*` variable. The alias groups and variable names below are those of the pinned
build's `common/arg.cpp` (llama.cpp vendored in llama-cpp-python 0.3.36); its parser matches names
exactly and has no `--flag=value` form, so a name is refused as written (the part before any `=`).

Cross-origin reads: that build's default is `--cors-origins '*'` with `--cors-credentials` on, which
echoes any page's `Origin` back (`tools/server/server-http.cpp`, pre-routing handler), so any web
page open in a browser on the benchmark box could read `/slots`, `/props` and `/metrics`. The
adapter passes CORS_ARGS where the binary lists `--cors-origins`: an origin under `.invalid` (RFC
2606: never resolves, so it matches no page) and no credentials. The API key (`--api-key`) is
not used: every client (load generator, scrapes, canary, accuracy) would have to send it.
"""

from __future__ import annotations

from collections.abc import Sequence

NO_ORIGIN = "https://no-cross-origin.invalid"
CORS_ARGS = ("--cors-origins", NO_ORIGIN, "--no-cors-credentials")

# (aliases, environment variable, what sets it instead)
_GROUPS: tuple[tuple[tuple[str, ...], str | None, str], ...] = (
    (("-m", "--model", "-mu", "--model-url", "-hf", "-hfr", "--hf-repo"), "LLAMA_ARG_MODEL", "option model"),
    (("--host",), "LLAMA_ARG_HOST", "the adapter (fixed: 127.0.0.1)"),
    (("--port",), "LLAMA_ARG_PORT", "the runner (a free port)"),
    (("-c", "--ctx-size"), "LLAMA_ARG_CTX_SIZE", "fairness.kv_capacity_tokens"),
    (("-np", "--parallel"), "LLAMA_ARG_N_PARALLEL", "the workloads' highest concurrency"),
    (
        ("-kvu", "--kv-unified", "-no-kvu", "--no-kv-unified"),
        "LLAMA_ARG_KV_UNIFIED",
        "the adapter (always --kv-unified: one pool of kv_capacity_tokens)",
    ),
    (("--cache-prompt", "--no-cache-prompt"), "LLAMA_ARG_CACHE_PROMPT", "fairness.prefix_caching"),
    (("-cram", "--cache-ram"), "LLAMA_ARG_CACHE_RAM", "fairness.prefix_caching"),
    (("--cache-reuse",), "LLAMA_ARG_CACHE_REUSE", "fairness.prefix_caching"),
    (("--metrics",), "LLAMA_ARG_ENDPOINT_METRICS", "the adapter (always on)"),
    (("-ngl", "--gpu-layers", "--n-gpu-layers"), "LLAMA_ARG_N_GPU_LAYERS", "option n_gpu_layers"),
    (("-ncmoe", "--n-cpu-moe"), "LLAMA_ARG_N_CPU_MOE", "option n_cpu_moe"),
    (("-cmoe", "--cpu-moe"), "LLAMA_ARG_CPU_MOE", "option n_cpu_moe"),
    (("-ot", "--override-tensor"), "LLAMA_ARG_OVERRIDE_TENSOR", "option n_cpu_moe (it places the experts)"),
    (("-fit", "--fit"), "LLAMA_ARG_FIT", "options n_gpu_layers and n_cpu_moe (they place the layers)"),
    (("--moe-cache-mib",), None, "option moe_cache_mib"),
    (("-fa", "--flash-attn"), "LLAMA_ARG_FLASH_ATTN", "option flash_attn"),
    (("-t", "--threads"), "LLAMA_ARG_THREADS", "option threads"),
    (("-b", "--batch-size"), "LLAMA_ARG_BATCH", "option batch_size"),
    (("-ub", "--ubatch-size"), "LLAMA_ARG_UBATCH", "option ubatch_size"),
    (("-lm", "--load-mode"), "LLAMA_ARG_LOAD_MODE", "option mmap (--load-mode none or mmap)"),
    # older builds' spellings of the load mode (not in the pinned build; refused so no build can be told twice)
    (("--mmap",), "LLAMA_ARG_MMAP", "option mmap"),
    (("--no-mmap",), "LLAMA_ARG_NO_MMAP", "option mmap"),
    (("--mlock",), "LLAMA_ARG_MLOCK", "option mmap"),
    (("-lv", "--verbosity", "--log-verbosity"), "LLAMA_ARG_LOG_VERBOSITY", "the adapter (4: the memory lines)"),
    (("--cors-origins",), "LLAMA_ARG_CORS_ORIGINS", "the adapter (no cross-origin reads)"),
    (
        ("--cors-credentials", "--no-cors-credentials"),
        "LLAMA_ARG_CORS_CREDENTIALS",
        "the adapter (no cross-origin reads)",
    ),
)
OWNED_FLAGS: dict[str, str] = {alias: owner for aliases, _, owner in _GROUPS for alias in aliases}
OWNED_ENV: dict[str, str] = {env: f"{'/'.join(aliases)} ({owner})" for aliases, env, owner in _GROUPS if env}


def extra_args_problems(extra_args: Sequence[str]) -> list[str]:
    """One phrase per argument of extra_args that sets a flag the adapter owns."""
    problems = []
    for arg in extra_args:
        flag = arg.split("=", 1)[0]
        if flag in OWNED_FLAGS:
            problems.append(f"{flag} is set by {OWNED_FLAGS[flag]}; remove it from extra_args")
    return problems
