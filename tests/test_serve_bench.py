"""benchmarks/serve_decode.py against a real tiny server on 127.0.0.1: its definitions hold and
its counters agree with what the requests report."""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import sys
from pathlib import Path

import pytest

from paged_experts.server.launch import ServeConfig
from paged_experts.synth import ensure_tiny

BENCH_PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "serve_decode.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("serve_decode", BENCH_PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["serve_decode"] = module
    spec.loader.exec_module(module)
    return module


def test_summary_definitions() -> None:
    bench = load_bench()
    t = bench.RequestTiming(completion_tokens=11, ttft_s=0.5, decode_s=2.0, e2e_s=2.6)
    assert t.decode_tok_s == 5.0  # (11 - 1) / 2.0
    assert bench.RequestTiming(1, 0.5, 0.0, 0.5).decode_tok_s is None
    delta = dict.fromkeys(bench.COUNTERS, 0.0) | {"expert_hits_total": 3.0, "expert_misses_total": 1.0,
                                                  "waves_total": 8.0, "moe_steps_total": 4.0}  # fmt: skip
    rounds = [(2.0, [t, bench.RequestTiming(21, 0.4, 4.0, 4.5)])]
    s = bench.summarize(2, rounds, delta)
    assert s["decode_tok_s_aggregate_median"] == 10.0  # 5 + 5 tok/s, two streams at once
    assert s["output_tok_s_wall_median"] == 16.0  # 32 tokens in 2 s
    assert s["hit_rate"] == 0.75 and s["waves_per_moe_step"] == 2.0


async def test_measure_against_a_live_server(tmp_path: Path) -> None:
    from aiohttp.test_utils import TestServer

    from paged_experts.server.handlers import STATE_KEY
    from paged_experts.server.app import create_app

    bench = load_bench()
    server = TestServer(create_app(ServeConfig(model_path=str(ensure_tiny()), max_total_tokens=512)))
    await server.start_server()
    url = str(server.make_url("")).rstrip("/")
    try:
        for _ in range(200):
            if server.app[STATE_KEY].serving is not None:
                break
            await asyncio.sleep(0.05)
        out = tmp_path / "partial.json"
        args = argparse.Namespace(
            request_timeout_s=60.0, prompt_tokens=8, max_tokens=6, rounds=1, out=str(out), record_base={"benchmark": "b"}
        )
        body = await bench.measure(url, [1, 2], args)
    finally:
        await server.close()
    assert body["server_info"]["routing"] == "model"
    one, two = body["results"]
    assert [r["completion_tokens"] for r in two["requests"]] == [6, 6]
    assert two["counters_delta"]["generation_tokens_total"] == 12  # the measured round only
    assert one["decode_tok_s_per_stream_median"] > 0 and two["hit_rate"] == pytest.approx(1.0)  # resident
    partial = json.loads(out.read_text())  # written after each concurrency: a killed run keeps its figures
    assert partial["complete"] is False and [r["concurrency"] for r in partial["results"]] == [1, 2]
