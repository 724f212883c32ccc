"""The short soak (CI form of benchmarks/soak.py): 64 streams plus abandoned bursts for ~20 s
against a real built-in server; no crash, no failed request, KV back to empty when idle, and the
server's memory after the warmup grows by a bounded amount."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SOAK_PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "soak.py"
RSS_GROWTH_LIMIT_MIB = 64.0  # after warmup; a leak per request would pass this in seconds at this rate


def load_soak():
    spec = importlib.util.spec_from_file_location("soak_benchmark", SOAK_PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
async def test_short_soak_keeps_the_server_up_and_returns_all_kv(tiny_model_dir: Path, tmp_path: Path) -> None:
    soak = load_soak()
    config = soak.SoakConfig(
        duration_s=20.0, streams=64, max_tokens=16, burst_every_s=4.0, burst_size=8, warmup_s=6.0,
        model=str(tiny_model_dir), kv_capacity_tokens=4096,
    )  # fmt: skip
    result = await soak.soak(config, tmp_path)
    figures = result.to_dict()
    assert result.server_alive and result.healthy_after, figures
    assert result.requests_failed == 0, figures
    assert result.requests_ok >= 64 and result.abandoned >= 8, figures
    assert result.server_aborted_requests and result.server_aborted_requests > 0, figures  # the server saw them go
    assert result.server_generation_tokens and result.server_generation_tokens >= result.completion_tokens, figures
    assert result.kv_capacity_tokens == 4096 and result.kv_used_tokens_idle == 0, figures
    assert result.rss_growth_mib is not None and result.rss_growth_mib < RSS_GROWTH_LIMIT_MIB, figures
    assert result.ok
