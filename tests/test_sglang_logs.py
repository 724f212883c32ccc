"""Log facts from SGLang 0.5.23 log lines (excerpts written for these tests in its formats)."""

from __future__ import annotations

from pathlib import Path

from benchsuite.engines.sglang.adapter import SGLangAdapter
from benchsuite.engines.sglang.logs import batch_cap_flag, kv_capacity_flag, parse_log

LOGS = Path(__file__).parent / "data" / "sglang_logs"


def facts(name: str) -> dict:
    return SGLangAdapter().parse_log((LOGS / name).read_text())


def test_paged_log() -> None:
    got = facts("paged_k26_laptop.log")
    assert got["paged_experts_enabled"] is True and got["resident_experts"] == 26
    assert got["paged_capture_bs"] == [1, 2, 3]
    assert got["decode_capture_bs"] == [1, 2, 3] and got["batch_cap"] == 3
    assert got["decode_graph_backend"] == "full" and got["prefill_graph_backend"] == "breakable"
    assert got["decode_graph_mem_gb"] == 0.05
    assert got["max_total_num_tokens"] == 10240 and got["max_running_requests"] == 4
    assert got["chunked_prefill_size"] == 2048 and got["context_len"] == 40960
    assert got["kv_cache_tokens"] == 10240 and got["kv_cache_dtype"] == "torch.bfloat16"
    assert abs(got["kv_cache_gb"] - 0.94) < 1e-9  # K 0.47 + V 0.47
    assert got["weights_mem_gb"] == 5.68 and got["weights_load_s"] == 91.2
    assert got["avail_mem_after_weights_gb"] == 1.93 and got["avail_mem_after_pool_gb"] == 0.88
    assert got["available_gpu_mem_gb"] == 0.69
    assert got["mem_fraction_static"] == 0.88 and got["max_total_tokens_arg"] == 10240
    assert got["kv_requested_tokens"] is None


def test_offload_log_with_a_kv_pool_smaller_than_asked() -> None:
    got = facts("offload_kv_capped.log")
    assert got["paged_experts_enabled"] is False and got["resident_experts"] is None
    assert got["cpu_offload_gb"] == 18.0
    assert got["kv_requested_tokens"] == 10240 and got["kv_profiled_tokens"] == 8191
    assert got["max_total_num_tokens"] == 8191 and got["kv_cache_gb"] == 0.75
    assert got["batch_cap"] == 4 and got["paged_capture_bs"] is None
    assert kv_capacity_flag(got, 10240) == "KV pool holds 8191 tokens, not the 10240 the matrix fixed for every engine"


def test_eager_log_has_no_graph_facts() -> None:
    got = facts("eager_unpaged.log")
    assert got["decode_capture_bs"] is None and got["batch_cap"] is None
    assert got["decode_graph_backend"] is None and got["chunked_prefill_size"] is None
    assert batch_cap_flag(got, 64) is None
    assert kv_capacity_flag(got, 2048) is None


def test_batch_cap_flag() -> None:
    paged = facts("paged_k26_laptop.log")
    assert batch_cap_flag(paged, 1) is None and batch_cap_flag(paged, 3) is None
    flag = batch_cap_flag(paged, 4)
    assert flag is not None and "concurrency 4 exceeds the largest captured decode batch 3" in flag
    assert "K // top_k" in flag and "waves" in flag
    offload = facts("offload_kv_capped.log")
    assert batch_cap_flag(offload, 4) is None
    assert "K // top_k" not in (batch_cap_flag(offload, 8) or "K // top_k")
    assert SGLangAdapter().batch_cap_flag(paged, 4) == flag


def test_unknown_text_gives_no_facts_not_zeros() -> None:
    got = parse_log("nothing here\n[2026-01-01 00:00:00] INFO: started\n").as_dict()
    assert all(value is None for value in got.values())
    assert kv_capacity_flag(got, 10240) is not None  # unreadable is flagged, never taken as fine


def test_last_match_wins_after_a_restart() -> None:
    text = (LOGS / "offload_kv_capped.log").read_text() + (LOGS / "paged_k26_laptop.log").read_text()
    got = parse_log(text)
    assert got.max_total_num_tokens == 10240 and got.decode_capture_bs == (1, 2, 3)
