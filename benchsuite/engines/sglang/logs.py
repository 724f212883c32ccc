"""Facts the report needs from an SGLang 0.5.23 server log, and the flags derived from them.

Owns the log patterns (each cites the 0.5.23 line that prints it), `SGLangLogFacts` (frozen;
`as_dict()` is what the adapter's parse_log returns and the runner stores per cell),
`batch_cap_flag` (a cell whose concurrency exceeds the largest captured decode batch) and
`kv_capacity_flag` (the server's KV pool is not the matrix's fixed token capacity).

SGLang prefixes every line with `[<time>< TPn>] ` (utils/common.py:2630), so patterns search
anywhere in a line. A fact whose line is absent is None, never 0. When a log holds several
matches (a restart appended to the same file), the last one wins.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any

# srt/model_executor/model_runner_components/cuda_graph_setup.py:758-762
_DECODE_BEGIN = re.compile(r"Capture (?P<role>\w+) decode CUDA graph begin\. backend=(?P<backend>\w+)")
# cuda_graph_setup.py:787-792; bs is the runner's capture list (decode_cuda_graph_runner.py:388)
_DECODE_END = re.compile(
    r"Capture (?P<role>\w+) decode CUDA graph end\. bs=\[(?P<bs>[\d,\s]*)\], "
    r"elapsed=(?P<elapsed>[\d.]+) s, mem usage=(?P<mem>-?[\d.]+) GB, avail mem=(?P<avail>-?[\d.]+) GB"
)
# cuda_graph_setup.py:684-688
_PREFILL_BEGIN = re.compile(r"Capture (?P<role>\w+) prefill CUDA graph begin\. backend=(?P<backend>\w+)")
# srt/layers/moe/paged_experts/method.py:292-296 (printed only when the cap changed the list)
_PAGED_CAP = re.compile(r"Paged experts: decode CUDA graphs captured at batch sizes \[(?P<bs>[\d,\s]*)\]")
# srt/managers/scheduler.py:1268-1276
_SCHEDULER = re.compile(
    r"max_total_num_tokens=(?P<tokens>\d+), chunked_prefill_size=(?P<chunk>-?\d+|None), "
    r"max_prefill_tokens=(?P<prefill>\d+), max_running_requests=(?P<running>\d+), "
    r"context_len=(?P<context>\d+), available_(?:gpu|cpu)_mem=(?P<avail>-?[\d.]+) GB"
)
# srt/mem_cache/memory_pool.py:2077-2098 (the target pool; a labelled pool, e.g. a draft's, is skipped)
_KV_POOL = re.compile(
    r"(?:^|\] )KV Cache is allocated\. dtype: (?P<dtype>\S+), #tokens: (?P<tokens>\d+), "
    r"(?:KV size: (?P<kv>[\d.]+) GB|K size: (?P<k>[\d.]+) GB, V size: (?P<v>[\d.]+) GB)"
)
# srt/model_executor/model_runner.py:1372-1379 (an optional quantization field sits before avail mem)
_WEIGHTS = re.compile(
    r"Load weight end\. elapsed=(?P<elapsed>[\d.]+) s, type=(?P<type>\w+), .*?"
    r"avail mem=(?P<avail>-?[\d.]+) GB, mem usage=(?P<usage>-?[\d.]+) GB\."
)
# srt/mem_cache/kv_cache_configurator.py:498-501
_POOL_END = re.compile(r"Memory pool end\. avail mem=(?P<avail>-?[\d.]+) GB")
# srt/mem_cache/kv_cache_configurator.py:3100-3104 (a warning: the requested cap did not fit)
_KV_CAPPED = re.compile(
    r"max_total_tokens=(?P<requested>\d+) is larger than the profiled value (?P<profiled>\d+)\. "
    r"Use the profiled value instead\."
)
# srt/entrypoints/engine.py:311 and 1185 log `server_args=<resolved_dict()>` (server_args.py:315-333),
# a flat Python dict repr; 0.5.23 prints K nowhere else.
_SERVER_ARGS = re.compile(r"server_args=\{.*")


def _arg(name: str) -> re.Pattern[str]:
    return re.compile(rf"'{name}': (?P<value>None|True|False|-?[\d.]+(?:e-?\d+)?)")


_ARG_RESIDENT = _arg("paged_experts_num_resident")
_ARG_PAGED = _arg("enable_paged_experts")
_ARG_MEM_FRACTION = _arg("mem_fraction_static")
_ARG_OFFLOAD = _arg("cpu_offload_gb")
_ARG_MAX_TOTAL = _arg("max_total_tokens")


@dataclass(frozen=True)
class SGLangLogFacts:
    decode_graph_backend: str | None = None  # full | breakable (no capture line: decode graphs off)
    prefill_graph_backend: str | None = None
    decode_capture_bs: tuple[int, ...] | None = None  # batch sizes with a captured decode graph
    decode_graph_mem_gb: float | None = None
    paged_capture_bs: tuple[int, ...] | None = None  # paged experts' capped list, when it capped
    batch_cap: int | None = None  # largest captured decode batch (paged: at most K // top_k)
    max_total_num_tokens: int | None = None  # the KV pool in tokens as the scheduler sized it
    max_running_requests: int | None = None
    chunked_prefill_size: int | None = None
    context_len: int | None = None
    available_gpu_mem_gb: float | None = None  # after weights, KV pool and graphs
    kv_cache_dtype: str | None = None
    kv_cache_tokens: int | None = None
    kv_cache_gb: float | None = None
    weights_mem_gb: float | None = None  # GPU memory the weights took (K slots count as weights)
    weights_load_s: float | None = None
    avail_mem_after_weights_gb: float | None = None
    avail_mem_after_pool_gb: float | None = None
    kv_requested_tokens: int | None = None  # set only when the server could not honour --max-total-tokens
    kv_profiled_tokens: int | None = None
    paged_experts_enabled: bool | None = None
    resident_experts: int | None = None  # K as the server resolved it
    mem_fraction_static: float | None = None  # the static memory budget as a fraction of the GPU
    cpu_offload_gb: float | None = None
    max_total_tokens_arg: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}


def parse_log(log_text: str) -> SGLangLogFacts:
    found: dict[str, Any] = {}
    for line in log_text.splitlines():
        _parse_line(line, found)
    if found.get("decode_capture_bs"):
        found["batch_cap"] = max(found["decode_capture_bs"])
    return SGLangLogFacts(**found)


def _parse_line(line: str, found: dict[str, Any]) -> None:
    if m := _DECODE_BEGIN.search(line):
        if m["role"] == "target":
            found["decode_graph_backend"] = m["backend"]
    elif m := _DECODE_END.search(line):
        if m["role"] == "target":
            found["decode_capture_bs"] = _int_list(m["bs"])
            found["decode_graph_mem_gb"] = float(m["mem"])
    elif m := _PREFILL_BEGIN.search(line):
        if m["role"] == "target":
            found["prefill_graph_backend"] = m["backend"]
    elif m := _PAGED_CAP.search(line):
        found["paged_capture_bs"] = _int_list(m["bs"])
    elif m := _SCHEDULER.search(line):
        found["max_total_num_tokens"] = int(m["tokens"])
        found["chunked_prefill_size"] = None if m["chunk"] == "None" else int(m["chunk"])
        found["max_running_requests"] = int(m["running"])
        found["context_len"] = int(m["context"])
        found["available_gpu_mem_gb"] = float(m["avail"])
    elif m := _KV_POOL.search(line):
        found["kv_cache_dtype"] = m["dtype"]
        found["kv_cache_tokens"] = int(m["tokens"])
        found["kv_cache_gb"] = float(m["kv"]) if m["kv"] else float(m["k"]) + float(m["v"])
    elif m := _WEIGHTS.search(line):
        found["weights_load_s"] = float(m["elapsed"])
        found["avail_mem_after_weights_gb"] = float(m["avail"])
        found["weights_mem_gb"] = float(m["usage"])
    elif m := _POOL_END.search(line):
        found["avail_mem_after_pool_gb"] = float(m["avail"])
    elif m := _KV_CAPPED.search(line):
        found["kv_requested_tokens"] = int(m["requested"])
        found["kv_profiled_tokens"] = int(m["profiled"])
    elif _SERVER_ARGS.search(line):
        _parse_server_args(line, found)


def _parse_server_args(line: str, found: dict[str, Any]) -> None:
    for key, pattern in (
        ("paged_experts_enabled", _ARG_PAGED),
        ("resident_experts", _ARG_RESIDENT),
        ("mem_fraction_static", _ARG_MEM_FRACTION),
        ("cpu_offload_gb", _ARG_OFFLOAD),
        ("max_total_tokens_arg", _ARG_MAX_TOTAL),
    ):
        m = pattern.search(line)
        if m is None or m["value"] == "None":
            continue
        value = m["value"]
        if key == "paged_experts_enabled":
            found[key] = value == "True"
        elif key in ("resident_experts", "max_total_tokens_arg"):
            found[key] = int(value)
        else:
            found[key] = float(value)


def _int_list(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.replace(" ", "").split(",") if part)


def batch_cap_flag(parsed_log: dict[str, Any], concurrency: int) -> str | None:
    """A one-line flag when `concurrency` exceeds the largest captured decode batch; None when it
    fits or when no decode graph was captured (eager decode has no cap to exceed)."""
    cap = parsed_log.get("batch_cap")
    if cap is None or concurrency <= cap:
        return None
    why = " (paged experts caps capture at K // top_k)" if parsed_log.get("paged_experts_enabled") else ""
    return (
        f"concurrency {concurrency} exceeds the largest captured decode batch {cap}{why}: "
        "decode steps above it run without a CUDA graph"
        + (", in several page-in waves" if parsed_log.get("paged_experts_enabled") else "")
    )


def kv_capacity_flag(parsed_log: dict[str, Any], kv_capacity_tokens: int) -> str | None:
    """A one-line flag when the server's KV pool is not the token capacity the matrix fixed."""
    actual = parsed_log.get("max_total_num_tokens")
    if actual is None:
        return "the log has no max_total_num_tokens line: the KV capacity could not be checked"
    if actual != kv_capacity_tokens:
        return f"KV pool holds {actual} tokens, not the {kv_capacity_tokens} the matrix fixed for every engine"
    return None
