"""Routing capture: base64 int32 [seq_len - 1, layers, top_k] payloads (built here the way SGLang
0.5.23's detokenizer encodes them) become a trace with one prefill chunk and one step per token."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import aiohttp
import numpy as np
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from benchsuite.engines.sglang.routing import (
    capture_routing,
    merge_stream_chunks,
    moe_layer_ids,
    routing_trace,
    write_routing_trace,
)
from benchsuite.errors import RunError
from paged_experts.routing.trace import read_trace

LAYERS, TOP_K, EXPERTS = 4, 2, 8
CONFIG = {"num_hidden_layers": LAYERS, "num_experts": EXPERTS, "num_experts_per_tok": TOP_K}


def routed(seq_rows: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, EXPERTS, size=(seq_rows, LAYERS, TOP_K), dtype=np.int32)  # [T, L, k]


def b64(ids: np.ndarray) -> str:
    # detokenizer_manager.py:443: pybase64.b64encode(tensor.numpy().tobytes())
    return base64.b64encode(ids.astype(np.int32).tobytes()).decode()


def test_openai_and_native_responses_become_one_trace(tmp_path: Path) -> None:
    a, b = routed(5 + 3 - 1, seed=1), routed(2 + 4 - 1, seed=2)  # prompt + output - 1 rows
    openai = {
        "id": "cmpl-a",
        "sglext": {"routed_experts": b64(a)},
        "usage": {"prompt_tokens": 5, "completion_tokens": 3},
    }
    native = {"meta_info": {"id": "gen-b", "routed_experts": b64(b), "prompt_tokens": 2}}
    trace = routing_trace([openai, native], CONFIG, model="m")
    assert trace.meta.source == "sglang" and trace.meta.weights == "absent"
    assert np.array_equal(trace.ids, np.concatenate([a, b]).astype(np.int64))
    # request a: a 5-token prefill chunk then 2 decode steps; request b: 2 then 3
    assert [sum(c.num_tokens for c in step) for step in trace.steps] == [5, 1, 1, 2, 1, 1, 1]
    assert [step[0].request for step in trace.steps] == ["cmpl-a"] * 3 + ["gen-b"] * 4
    out = write_routing_trace(tmp_path / "routing" / "s.trace", [openai, native], _model(tmp_path))
    back = read_trace(out)
    assert np.array_equal(back.ids, trace.ids) and back.meta.top_k == TOP_K


def test_streamed_chunks_merge_into_a_response() -> None:
    ids = routed(6, seed=3)
    chunks = [
        {"id": "cmpl-s", "choices": [{"index": 0, "text": "Hi", "finish_reason": None}]},
        {"id": "cmpl-s", "choices": [{"index": 0, "text": "!", "finish_reason": "length"}]},
        {"id": "cmpl-s", "choices": [], "sglext": {"routed_experts": b64(ids)}},  # serving_completions.py:464-476
        {"id": "cmpl-s", "choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 3}},
    ]
    merged = merge_stream_chunks(chunks)
    assert merged == {
        "id": "cmpl-s",
        "sglext": {"routed_experts": b64(ids)},
        "usage": {"prompt_tokens": 4, "completion_tokens": 3},
    }
    trace = routing_trace([merged], CONFIG)
    assert [sum(c.num_tokens for c in s) for s in trace.steps] == [4, 1, 1]


def test_dense_layers_are_dropped() -> None:
    assert moe_layer_ids({"num_hidden_layers": 4, "mlp_only_layers": [0]}) == (1, 2, 3)
    assert moe_layer_ids({"num_hidden_layers": 4, "decoder_sparse_step": 2}) == (1, 3)
    assert moe_layer_ids({"num_hidden_layers": 5, "first_k_dense_replace": 1}) == (1, 2, 3, 4)
    assert moe_layer_ids({"text_config": {"num_hidden_layers": 3}}) == (0, 1, 2)
    ids = routed(3, seed=4)
    trace = routing_trace([{"id": "r", "sglext": {"routed_experts": b64(ids)}, "usage": {"prompt_tokens": 1}}],
                          {**CONFIG, "mlp_only_layers": [0, 2]})  # fmt: skip
    assert trace.meta.layer_ids == (1, 3)
    assert np.array_equal(trace.ids, ids[:, [1, 3]].astype(np.int64))


def test_bad_payloads_are_refused() -> None:
    with pytest.raises(ValueError, match="no routed_experts"):
        routing_trace([{"id": "r", "usage": {"prompt_tokens": 1}}], CONFIG)
    short = base64.b64encode(np.arange(3, dtype=np.int32).tobytes()).decode()
    with pytest.raises(ValueError, match="not a multiple"):
        routing_trace([{"sglext": {"routed_experts": short}}], CONFIG)
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        routing_trace([], {"num_hidden_layers": 2, "num_experts": 8})


def _model(tmp_path: Path) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(CONFIG))
    return model


def _fake_sglang(bodies: list[dict]) -> web.Application:
    """Answers /v1/completions like sglang 0.5.23 with return_routed_experts: prompt_tokens = the
    prompt's word count, routing rows = prompt + max_tokens - 1 (serving_completions.py:550-570)."""

    async def completions(request: web.Request) -> web.Response:
        body = await request.json()
        bodies.append(body)
        prompt_tokens = len(body["prompt"].split())
        ids = routed(prompt_tokens + body["max_tokens"] - 1, seed=len(bodies))
        answer = {"id": f"cmpl-{len(bodies)}", "object": "text_completion", "choices": [{"index": 0, "text": "x"}],
                  "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": body["max_tokens"]}}  # fmt: skip
        if body.get("return_routed_experts"):
            answer["sglext"] = {"routed_experts": b64(ids)}
        return web.json_response(answer)

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    return app


async def test_capture_pass_against_a_scripted_endpoint(tmp_path: Path) -> None:
    bodies: list[dict] = []
    async with TestServer(_fake_sglang(bodies)) as server, aiohttp.ClientSession() as session:
        base = str(server.make_url("")).rstrip("/")
        responses = await capture_routing(session, base, "m", ["one two three", "four five"], max_tokens=3)
        with pytest.raises(RunError, match="HTTP 404"):
            await capture_routing(session, base + "/nope", "m", ["x"], max_tokens=1)
    assert all(b["return_routed_experts"] is True and b["stream"] is False and b["temperature"] == 0 for b in bodies)
    trace = read_trace(write_routing_trace(tmp_path / "t.trace", responses, _model(tmp_path)))
    assert [sum(c.num_tokens for c in s) for s in trace.steps] == [3, 1, 1, 2, 1, 1]
    assert trace.num_tokens == (3 + 3 - 1) + (2 + 3 - 1)
