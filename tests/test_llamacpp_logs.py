"""llama-server log facts: buffer sizes per device, KV sizing, expert-cache hit rates."""

from __future__ import annotations

from benchsuite.engines.llamacpp.logs import parse_moe_cache_line, parse_server_log

LOG = """\
load_tensors: loading model tensors, this can take a while... (mmap = true)
load_tensors:   CPU_Mapped model buffer size =     3.77 MiB
load_tensors:        CUDA0 model buffer size = 17105.25 MiB
llama_context: n_seq_max     = 4
llama_context: n_ctx         = 10240
llama_context: n_ctx_seq     = 10240
llama_context: flash_attn    = disabled
llama_context:        CPU  output buffer size =     0.58 MiB
llama_kv_cache:      CUDA0 KV buffer size =   960.00 MiB
llama_kv_cache: size =  960.00 MiB ( 10240 cells,  48 layers,  4/1 seqs), K (f16):  480.00 MiB, V (f16):  480.00 MiB
sched_reserve:      CUDA0 compute buffer size =   300.75 MiB
sched_reserve:  CUDA_Host compute buffer size =    24.01 MiB
srv          main: server is listening on http://127.0.0.1:8080
llama_moe_cache: hits = 7700, misses = 2300 (77.00%) for micro-batches with n_tokens <= 8
llama_moe_cache: hits = 950, misses = 50 (95.00%) for micro-batches with n_tokens > 8
"""


def test_memory_lines_per_kind_and_device():
    facts = parse_server_log(LOG)
    assert facts["buffers_mib"]["model"] == {"CPU_Mapped": 3.77, "CUDA0": 17105.25}
    assert facts["buffers_mib"]["KV"] == {"CUDA0": 960.0}
    assert facts["buffers_mib"]["compute"] == {"CUDA0": 300.75, "CUDA_Host": 24.01}
    assert facts["buffers_mib"]["output"] == {"CPU": 0.58}
    assert facts["kv"] == {
        "size_mib": 960.0,
        "cells": 10240,
        "layers": 48,
        "seqs": "4/1",
    }
    assert facts["context"] == {
        "n_seq_max": 4,
        "n_ctx": 10240,
        "n_ctx_seq": 10240,
        "flash_attn": "disabled",
    }


def test_moe_cache_hit_rates_by_micro_batch_class():
    entries = parse_server_log(LOG)["moe_cache"]
    assert [(e["batch_class"], e["hits"], e["misses"]) for e in entries] == [
        ("n_tokens <= 8", 7700, 2300),
        ("n_tokens > 8", 950, 50),
    ]
    assert entries[0]["hit_rate"] == 0.77 and entries[1]["hit_rate"] == 0.95


def test_moe_cache_line_forms():
    assert parse_moe_cache_line("moe cache hit rate: 812/1000")["hit_rate"] == 0.812
    assert parse_moe_cache_line("moe-cache: hit rate 64.5%")["hit_rate"] == 0.645
    assert parse_moe_cache_line("moe cache: hits enabled") is None


# A backslash at a line end continues the log line (source lines stay within 120 characters).
PREFIXED = """\
0.00.139.684 I common_memory_breakdown_print: | memory breakdown [MiB] \
| total   free    self   model   context   compute    unaccounted |
0.00.140.001 I common_memory_breakdown_print: |   - CUDA0 (NVIDIA H200) \
| 143000 = 120000 + (18366 = 17105 +     960 +     301) +        4634 |
0.00.172.433 I common_memory_breakdown_print: |   - Host               \
|                    7 =     3 +       1 +       3                |
0.00.209.411 I load_tensors:   CPU_Mapped model buffer size =     3.73 MiB
0.00.225.298 I llama_context: n_ctx                 = 2048
0.00.228.906 I sched_reserve:        CPU compute buffer size =     3.26 MiB
"""


def test_timestamped_lines_and_llama_cpp_own_breakdown():
    facts = parse_server_log(PREFIXED)
    assert facts["buffers_mib"] == {
        "model": {"CPU_Mapped": 3.73},
        "compute": {"CPU": 3.26},
    }
    assert facts["context"] == {"n_ctx": 2048}
    assert facts["memory_breakdown_mib"] == {
        "CUDA0 (NVIDIA H200)": {
            "total": 143000,
            "free": 120000,
            "self": 18366,
            "model": 17105,
            "context": 960,
            "compute": 301,
            "unaccounted": 4634,
        },
        "Host": {"self": 7, "model": 3, "context": 1, "compute": 3},
    }


def test_only_the_last_launch_in_an_appended_log_counts():
    twice = (
        "# benchsuite: starting llama-server -m a.gguf\n"
        + PREFIXED
        + "# benchsuite: starting llama-server -m a.gguf\n"
        + PREFIXED
    )
    assert parse_server_log(twice)["buffers_mib"]["model"] == {"CPU_Mapped": 3.73}


def test_log_without_facts_gives_nothing():
    assert parse_server_log("main: loading model\nsrv  main: listening\n") == {}
