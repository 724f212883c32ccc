"""Facts from a llama-server log: memory per device, context sizing, MoE expert-cache hit rates.

Memory lines (llama.cpp prints them while loading):
    load_tensors:   CPU_Mapped model buffer size =     3.77 MiB
    llama_kv_cache:        CPU KV buffer size =     0.50 MiB
    llama_context:        CPU  output buffer size =     0.02 MiB
    sched_reserve:      CUDA0 compute buffer size =   300.75 MiB
    llama_kv_cache: size =    0.50 MiB (  1024 cells,   4 layers,  1/1 seqs), K (f16): ..., V (f16): ...
Context lines: `llama_context: n_ctx = 1024`, `n_ctx_seq`, `n_seq_max`, `n_batch`, `n_ubatch`,
`flash_attn`. llama.cpp's own fit projection at startup, one row per device (MiB):
    common_memory_breakdown_print: |   - CUDA0 (H200) | 143000 = 1200 + (18366 = 17105 + 960 + 301) + 123434 |
    common_memory_breakdown_print: |   - Host         |                    7 =     3 +       1 +       3   |
The server logs memory lines only at verbosity 4 (`-lv 4`, trace, which the adapter passes: llama's
INFO lines map to trace in common/log.cpp, and the breakdown, printed as the server exits, is
LOG_TRC; nothing is logged per token at 4, docs/llamacpp-tuning.md), each line behind a
`<time> <level> ` prefix that is stripped here.

Expert-cache lines (`--moe-cache-mib` builds print hit rates at exit, over distinct experts per
(layer, micro-batch), split into micro-batches of <= 8 tokens and larger). The pinned build has no
such flag, so the accepted shape is ours, tested on a written excerpt: any line that mentions the
moe cache and hits, with `hits = H` / `misses = M` (or `H/M`) and optionally a percentage and a
micro-batch class such as `n_tokens <= 8` or `n_tokens > 8`.
"""

from __future__ import annotations

import re
from typing import Any

_BUFFER = re.compile(
    r"^(?P<stage>\w+):\s+(?P<device>[\w.\-]+)\s+(?P<kind>model|KV|compute|output|RS) buffer size"
    r"\s*=\s*(?P<mib>[\d.]+) MiB"
)
_KV_SIZE = re.compile(
    r"llama_kv_cache: size\s*=\s*(?P<mib>[\d.]+) MiB "
    r"\(\s*(?P<cells>\d+) cells,\s*(?P<layers>\d+) layers,\s*(?P<seqs>\d+/\d+) seqs\)"
)
_CONTEXT = re.compile(
    r"^llama_context:\s+(?P<key>n_ctx|n_ctx_seq|n_seq_max|n_batch|n_ubatch|flash_attn|kv_unified)\s*=\s*(?P<value>\S+)"
)
_LAUNCH_MARKER = re.compile(r"^# benchsuite: starting ", re.MULTILINE)  # written by benchsuite.run.process
_PREFIX = re.compile(r"^\d+\.\d+\.\d+\.\d+\s+[A-Z]\s+")
_BREAKDOWN_ROW = re.compile(r"common_memory_breakdown_print:\s*\|\s*-\s*(?P<device>[^|]+?)\s*\|(?P<body>[^|]*)\|")
_MOE_CACHE_LINE = re.compile(r"moe[ _-]?cache", re.IGNORECASE)
_HITS = re.compile(r"hits?\s*[=:]\s*(\d+)", re.IGNORECASE)
_MISSES = re.compile(r"miss(?:es)?\s*[=:]\s*(\d+)", re.IGNORECASE)
_RATIO = re.compile(r"(\d+)\s*/\s*(\d+)")
_PERCENT = re.compile(r"([\d.]+)\s*%")
_CLASS = re.compile(r"n_tokens\s*(<=|>|<|>=)\s*(\d+)")


def parse_server_log(text: str) -> dict[str, Any]:
    """{buffers_mib: {kind: {device: MiB}}, kv: {...}, context: {...}, moe_cache: [...]} (keys only when seen).

    A log that holds several launches of the same server (the runner appends, e.g. when the
    n_cpu_moe search launched the value it then chose) is read from its last launch only.
    """
    starts = [m.start() for m in _LAUNCH_MARKER.finditer(text)]
    if starts:
        text = text[starts[-1] :]
    buffers: dict[str, dict[str, float]] = {}
    context: dict[str, Any] = {}
    kv: dict[str, Any] = {}
    moe_cache: list[dict[str, Any]] = []
    breakdown: dict[str, dict[str, int]] = {}
    for raw in text.splitlines():
        line = _PREFIX.sub("", raw.strip())
        if m := _BREAKDOWN_ROW.search(line):
            row = parse_breakdown_row(m["body"])
            if row:
                breakdown[m["device"]] = row
        elif m := _BUFFER.match(line):
            per_kind = buffers.setdefault(m["kind"], {})
            per_kind[m["device"]] = round(per_kind.get(m["device"], 0.0) + float(m["mib"]), 3)
        elif m := _KV_SIZE.search(line):
            kv = {
                "size_mib": float(m["mib"]),
                "cells": int(m["cells"]),
                "layers": int(m["layers"]),
                "seqs": m["seqs"],
            }
        elif m := _CONTEXT.match(line):
            value = m["value"]
            context[m["key"]] = int(value) if value.isdigit() else value
        elif _MOE_CACHE_LINE.search(line) and re.search(r"hit", line, re.IGNORECASE):
            entry = parse_moe_cache_line(line)
            if entry:
                moe_cache.append(entry)
    facts: dict[str, Any] = {}
    if buffers:
        facts["buffers_mib"] = buffers
    if kv:
        facts["kv"] = kv
    if context:
        facts["context"] = context
    if moe_cache:
        facts["moe_cache"] = moe_cache
    if breakdown:
        facts["memory_breakdown_mib"] = breakdown
    return facts


def parse_breakdown_row(body: str) -> dict[str, int] | None:
    """`total free = ... self = model + context + compute [+ unaccounted]` -> named MiB values.

    Host rows carry `self = model + context + compute`; device rows add total, free and
    unaccounted around a parenthesised `self = model + context + compute`.
    """
    numbers = [int(x) for x in re.findall(r"\d+", body)]
    if len(numbers) == 4:
        return dict(zip(("self", "model", "context", "compute"), numbers))
    if len(numbers) == 7:
        return dict(
            zip(
                ("total", "free", "self", "model", "context", "compute", "unaccounted"),
                numbers,
            )
        )
    return None


def parse_moe_cache_line(line: str) -> dict[str, Any] | None:
    """One hit-rate line -> {batch_class, hits, misses, hit_rate}; None when it carries no counts."""
    hits = misses = None
    if (h := _HITS.search(line)) and (m := _MISSES.search(line)):
        hits, misses = int(h.group(1)), int(m.group(1))
    elif r := _RATIO.search(line):
        hits, total = int(r.group(1)), int(r.group(2))
        misses = total - hits
    rate = None
    if hits is not None and misses is not None and hits + misses > 0:
        rate = hits / (hits + misses)
    elif p := _PERCENT.search(line):
        rate = float(p.group(1)) / 100.0
    if rate is None:
        return None
    cls = _CLASS.search(line)
    return {
        "batch_class": f"n_tokens {cls.group(1)} {cls.group(2)}" if cls else "all",
        "hits": hits,
        "misses": misses,
        "hit_rate": rate,
        "line": line,
    }
