"""The built-in server over real HTTP on 127.0.0.1 with the real tiny model (CPU, fp32)."""

from __future__ import annotations

import asyncio
import gc
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from aiohttp.test_utils import TestServer

from paged_experts.server.app import create_app
from paged_experts.server.launch import load_serving
from paged_experts.server.options import ServeOptions
from paged_experts.server.text import ChatTurn, TextCodec
from paged_experts.weights.synth import ensure_tiny

pytestmark = pytest.mark.asyncio(loop_scope="module")

CAPACITY_TOKENS = 512
PROMPT = "The quick brown fox jumps over the lazy dog and"


@pytest.fixture(scope="module")
def tiny_dir() -> Path:
    return Path(ensure_tiny())


@pytest.fixture(scope="module")
def codec(tiny_dir: Path) -> TextCodec:
    return TextCodec.from_dir(tiny_dir)


async def start_server(config: ServeOptions, loader: Any = load_serving) -> TestServer:
    server = TestServer(create_app(config, loader), host="127.0.0.1")
    await server.start_server()
    return server


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def base_url(tiny_dir: Path, healthy) -> AsyncIterator[str]:
    config = ServeOptions(model_path=str(tiny_dir), max_total_tokens=CAPACITY_TOKENS, max_running_requests=8)
    server = await start_server(config)
    url = str(server.make_url("")).rstrip("/")
    await healthy(url)
    yield url
    await server.close()


@pytest_asyncio.fixture(loop_scope="module")
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        yield session


async def post(http: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, dict[str, Any]]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with http.post(url, data=data, headers={"Content-Type": "application/json"}) as resp:
        return resp.status, await resp.json()


async def stream(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> list[Any]:
    """SSE events in order; '[DONE]' stays a string."""
    events: list[Any] = []
    async with http.post(url, json={**body, "stream": True}) as resp:
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line:
                continue
            assert line.startswith("data: ")
            payload = line[len("data: ") :]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def greedy(**extra: Any) -> dict[str, Any]:
    return {"prompt": PROMPT, "max_tokens": 10, "temperature": 0, "ignore_eos": True, **extra}


async def test_completion_counts_and_text_match_the_generated_tokens(base_url: str, http, codec: TextCodec) -> None:
    status, body = await post(http, f"{base_url}/v1/completions", greedy(logprobs=0, return_tokens_as_token_ids=True))
    assert status == 200, body
    choice = body["choices"][0]
    assert body["object"] == "text_completion" and choice["finish_reason"] == "length"
    assert body["usage"] == {
        "prompt_tokens": len(codec.encode(PROMPT)),
        "completion_tokens": 10,
        "total_tokens": len(codec.encode(PROMPT)) + 10,
    }
    ids = [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]
    assert len(ids) == 10 and choice["text"] == codec.decode(ids)
    assert all(lp <= 0 for lp in choice["logprobs"]["token_logprobs"])


async def test_streamed_completion_equals_the_full_response(base_url: str, http) -> None:
    _, full = await post(http, f"{base_url}/v1/completions", greedy())
    events = await stream(http, f"{base_url}/v1/completions", greedy(stream_options={"include_usage": True}))
    assert events[-1] == "[DONE]"
    usage_event = events[-2]
    assert usage_event["choices"] == [] and usage_event["usage"] == full["usage"]
    chunks = events[:-2]
    assert "".join(c["choices"][0]["text"] for c in chunks) == full["choices"][0]["text"]
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert len({c["id"] for c in chunks}) == 1


async def test_continuous_usage_gives_every_token_its_chunk_and_the_finish_chunk_the_engines_timings(
    base_url: str, http, codec: TextCodec
) -> None:
    options = {"include_usage": True, "continuous_usage_stats": True}
    _, full = await post(http, f"{base_url}/v1/completions", greedy(max_tokens=12))
    events = await stream(http, f"{base_url}/v1/completions", greedy(max_tokens=12, stream_options=options))
    assert events[-1] == "[DONE]" and events[-2]["choices"] == [] and events[-2]["usage"] == full["usage"]
    chunks, finish = events[:-3], events[-3]
    # one chunk per generated token, whatever its text: counts 1..12 in order, each a step of one
    assert [c["usage"]["completion_tokens"] for c in chunks] == list(range(1, 13))
    assert all(c["usage"]["prompt_tokens"] == len(codec.encode(PROMPT)) for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in events[:-2]) == full["choices"][0]["text"]
    assert finish["choices"][0]["finish_reason"] == "length" and finish["usage"]["completion_tokens"] == 12
    timings = finish["timings"]
    assert timings["predicted_n"] == 12 and timings["prompt_n"] == len(codec.encode(PROMPT))
    assert timings["prompt_ms"] > 0 and timings["predicted_ms"] > 0
    assert timings["predicted_per_second"] == pytest.approx(11 / (timings["predicted_ms"] / 1e3))
    # the engine's own prefill keys: one step ran the whole prompt, issued within the time to token 1
    assert timings["prefill_steps"] == 1 and 0 < timings["prefill_issue_ms"] <= timings["prompt_ms"]
    if sys.platform.startswith("linux"):  # and how the engine thread spent that time (thread_clock)
        assert {"prefill_issue_run_delay_ms", "prefill_issue_voluntary_switches", "prefill_cpu_id_last"} <= set(timings)
    plain = await stream(
        http, f"{base_url}/v1/completions", greedy(max_tokens=12, stream_options={"include_usage": True})
    )
    assert all("usage" not in e for e in plain[:-2]) and plain[-3]["timings"]["predicted_n"] == 12


async def test_chat_continuous_usage_counts_from_the_role_chunk(base_url: str, http) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    options = {"include_usage": True, "continuous_usage_stats": True}
    events = await stream(http, f"{base_url}/v1/chat/completions", {**body, "stream_options": options})
    counts = [e["usage"]["completion_tokens"] for e in events[:-2]]
    assert counts[0] == 0 and counts[1:-1] == list(range(1, 7)) and counts[-1] == 6  # role, 6 tokens, finish
    assert events[-3]["timings"]["predicted_n"] == 6


async def test_token_id_prompt_equals_text_prompt(base_url: str, http, codec: TextCodec) -> None:
    _, by_text = await post(http, f"{base_url}/v1/completions", greedy())
    _, by_ids = await post(http, f"{base_url}/v1/completions", greedy(prompt=codec.encode(PROMPT)))
    assert by_ids["choices"][0]["text"] == by_text["choices"][0]["text"]
    assert by_ids["usage"] == by_text["usage"]


async def test_chat_streaming_and_not(base_url: str, http, codec: TextCodec) -> None:
    body = {
        "messages": [{"role": "user", "content": "Say something."}],
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
    }
    status, full = await post(http, f"{base_url}/v1/chat/completions", body)
    assert status == 200, full
    message = full["choices"][0]["message"]
    assert full["object"] == "chat.completion" and message["role"] == "assistant"
    templated = codec.render_chat([ChatTurn("user", "Say something.")])
    assert full["usage"]["prompt_tokens"] == len(codec.encode(templated, add_special_tokens=False))
    assert full["usage"]["completion_tokens"] == 8
    events = await stream(http, f"{base_url}/v1/chat/completions", {**body, "stream_options": {"include_usage": True}})
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert events[0]["object"] == "chat.completion.chunk"
    content = "".join(e["choices"][0]["delta"].get("content", "") for e in events[1:-2])
    assert content == message["content"]
    assert events[-3]["choices"][0]["finish_reason"] == "length"
    assert events[-2]["usage"] == full["usage"] and events[-1] == "[DONE]"


async def test_chat_logprobs_shape(base_url: str, http) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "logprobs": True, "top_logprobs": 2}  # fmt: skip
    _, full = await post(http, f"{base_url}/v1/chat/completions", body)
    content = full["choices"][0]["logprobs"]["content"]
    assert len(content) == 4
    for entry in content:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"} and len(entry["top_logprobs"]) == 2
        assert entry["top_logprobs"][0]["logprob"] == entry["logprob"]  # greedy takes the best


async def test_echo_logprobs_include_the_prompt(base_url: str, http, codec: TextCodec) -> None:
    _, body = await post(http, f"{base_url}/v1/completions", greedy(echo=True, logprobs=1, max_tokens=3))
    choice = body["choices"][0]
    n_prompt = len(codec.encode(PROMPT))
    lp = choice["logprobs"]
    assert choice["text"].startswith(PROMPT)
    assert len(lp["tokens"]) == n_prompt + 3
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(isinstance(v, float) for v in lp["token_logprobs"][1:])
    assert lp["text_offset"] == sorted(lp["text_offset"])


async def test_prompt_logprobs_option_scores_every_prompt_token(base_url: str, http, codec: TextCodec) -> None:
    _, gen = await post(
        http, f"{base_url}/v1/completions", greedy(max_tokens=4, logprobs=0, return_tokens_as_token_ids=True)
    )
    ids = codec.encode(PROMPT) + [int(t.removeprefix("token_id:")) for t in gen["choices"][0]["logprobs"]["tokens"]]
    _, scored = await post(
        http, f"{base_url}/v1/completions", {"prompt": ids, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 0}
    )
    plp = scored["choices"][0]["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    scored_generated = [plp[i][str(ids[i])]["logprob"] for i in range(len(ids) - 4, len(ids))]
    assert scored_generated == pytest.approx(gen["choices"][0]["logprobs"]["token_logprobs"], abs=1e-4)


async def test_stop_string_cuts_the_text_and_ends_the_request(base_url: str, http) -> None:
    _, full = await post(http, f"{base_url}/v1/completions", greedy(max_tokens=16))
    text = full["choices"][0]["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), f"unusable stop string from {text!r}"
    before = await metric_values(http, base_url)
    _, cut = await post(http, f"{base_url}/v1/completions", greedy(max_tokens=16, stop=[stop]))
    after = await metric_values(http, base_url)
    # a stop string is a normal end: not counted as aborted, and its latency is observed
    assert after["paged_experts:num_aborted_requests_total"] == before["paged_experts:num_aborted_requests_total"]
    e2e = "paged_experts:e2e_request_latency_seconds_count"
    assert after[e2e] == before[e2e] + 1
    assert cut["choices"][0]["text"] == text[: text.index(stop)]
    assert cut["choices"][0]["finish_reason"] == "stop"
    assert cut["usage"]["completion_tokens"] < 16
    events = await stream(http, f"{base_url}/v1/completions", greedy(max_tokens=16, stop=stop))
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == text[: text.index(stop)]
    assert events[-2]["choices"][0]["finish_reason"] == "stop"


async def test_seeded_sampling_is_reproducible(base_url: str, http) -> None:
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 1.5, "seed": 7, "ignore_eos": True}
    texts = [(await post(http, f"{base_url}/v1/completions", body))[1]["choices"][0]["text"] for _ in range(2)]
    other = (await post(http, f"{base_url}/v1/completions", {**body, "seed": 8}))[1]["choices"][0]["text"]
    assert texts[0] == texts[1] and texts[0] != other


async def test_concurrent_greedy_requests_equal_their_solo_output(base_url: str, http) -> None:
    prompts = ["Once upon a time", "In the beginning there", "A B C D E F", "Numbers: 1 2 3"]
    solo = [(await post(http, f"{base_url}/v1/completions", greedy(prompt=p, max_tokens=12)))[1] for p in prompts]
    together = await asyncio.gather(
        *(stream(http, f"{base_url}/v1/completions", greedy(prompt=p, max_tokens=12)) for p in prompts)
    )
    for alone, events in zip(solo, together):
        assert "".join(e["choices"][0]["text"] for e in events[:-1]) == alone["choices"][0]["text"]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", b"{not json", "body"),
        ("/v1/completions", {"prompt": "x", "max_tokens": "ten"}, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "max_tokens": -1}, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 10**9}, "max_tokens"),
        ("/v1/completions", {"prompt": "word " * 600, "max_tokens": 1}, "prompt"),
        ("/v1/completions", {"prompt": [1, 10**7], "max_tokens": 1}, "prompt"),
        ("/v1/completions", {"prompt": "", "max_tokens": 1}, "prompt"),
        ("/v1/completions", {"prompt": "x", "temperature": None}, "temperature"),
        ("/v1/completions", {"prompt": "x", "stop": [""]}, "stop"),
        ("/v1/chat/completions", {"messages": "hi"}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user"}], "max_tokens": 10**6}, "max_tokens"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": 1}, "logprobs"),
    ],
)
async def test_bad_requests_get_400_naming_the_field_and_the_server_keeps_serving(
    base_url: str, http, path: str, body: Any, param: str
) -> None:
    status, err = await post(http, f"{base_url}{path}", body)
    assert status == 400, err
    assert err["error"]["param"] == param and err["error"]["message"].startswith(param)
    status, ok = await post(http, f"{base_url}/v1/completions", greedy(max_tokens=2))
    assert status == 200 and ok["usage"]["completion_tokens"] == 2


async def metric_values(http: aiohttp.ClientSession, base_url: str) -> dict[str, float]:
    async with http.get(f"{base_url}/metrics") as resp:
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/plain")
        text = await resp.text()
    return {
        ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln and not ln.startswith("#")
    }


async def test_client_disconnect_frees_kv(base_url: str, http) -> None:
    before = await metric_values(http, base_url)
    async with aiohttp.ClientSession() as own:
        resp = await own.post(f"{base_url}/v1/completions", json=greedy(max_tokens=400, stream=True))
        await resp.content.readline()  # the request is running
        resp.close()  # drop the connection mid-stream
    for _ in range(200):
        after = await metric_values(http, base_url)
        if after["paged_experts:num_running_reqs"] == 0 and after["paged_experts:kv_used_tokens"] == 0:
            break
        await asyncio.sleep(0.05)
    assert after["paged_experts:kv_used_tokens"] == 0 and after["paged_experts:num_running_reqs"] == 0
    assert after["paged_experts:num_aborted_requests_total"] == before["paged_experts:num_aborted_requests_total"] + 1
    assert after["paged_experts:generation_tokens_total"] - before["paged_experts:generation_tokens_total"] < 400


async def test_requests_larger_than_free_kv_queue_and_complete(base_url: str, http) -> None:
    # each reserves 300 of the 512 tokens: the second waits for the first instead of failing
    body = {"prompt": [7] * 270, "max_tokens": 30, "temperature": 0, "ignore_eos": True}
    results = await asyncio.gather(*(post(http, f"{base_url}/v1/completions", body) for _ in range(2)))
    assert [status for status, _ in results] == [200, 200]
    assert [r["usage"]["completion_tokens"] for _, r in results] == [30, 30]
    assert results[0][1]["choices"][0]["text"] == results[1][1]["choices"][0]["text"]


async def test_metrics_expose_requests_latency_and_paging_counters(base_url: str, http) -> None:
    await post(http, f"{base_url}/v1/completions", greedy(max_tokens=3))
    gc.collect()  # the server runs in this process: a full collection its clock must count
    values = await metric_values(http, base_url)
    p = "paged_experts:"
    for name in ("num_requests_total", "prompt_tokens_total", "generation_tokens_total", "expert_activations_total",
                 "routed_pairs_total", "expert_hits_total", "moe_steps_total", "union_experts_total",
                 "time_to_first_token_seconds_count", "inter_token_latency_seconds_count",
                 "e2e_request_latency_seconds_count"):  # fmt: skip
        assert values[p + name] > 0, name
    for name in ("expert_misses_total", "bytes_paged_total", "copy_seconds_total", "waves_total", "union_experts_max",
                 "num_running_reqs", "num_queue_reqs", "kv_used_tokens"):  # fmt: skip
        assert p + name in values, name
    assert values[p + "kv_capacity_tokens"] == CAPACITY_TOKENS
    assert values[p + "routing_synthetic"] == 0
    assert values[p + "expert_hits_total"] + values[p + "expert_misses_total"] == values[p + "expert_activations_total"]
    assert values[p + 'layer_expert_hits_total{layer="0"}'] > 0
    # the garbage collector's pauses (server/gc_pauses.py): present, and consistent with each other
    assert values[p + "gc_collections_total"] >= values[p + "gc_full_collections_total"] >= 1
    assert values[p + "gc_pause_seconds_total"] >= values[p + "gc_pause_max_seconds"] > 0


async def test_models_server_info_and_flush_cache(base_url: str, http, tiny_dir: Path) -> None:
    async with http.get(f"{base_url}/v1/models") as resp:
        models = await resp.json()
    assert models["data"][0]["id"] == tiny_dir.name and models["data"][0]["routing"] == "model"
    async with http.get(f"{base_url}/server_info") as resp:
        info = await resp.json()
    assert info["runtime"]["mode"] == "resident" and info["kv"]["capacity_tokens"] == CAPACITY_TOKENS
    assert info["model"]["num_experts"] == 32 and info["routing_synthetic"] is False
    assert info["server"]["host"] == "127.0.0.1" and info["versions"]["torch"]
    async with http.post(f"{base_url}/flush_cache") as resp:
        assert resp.status == 200


async def test_health_is_503_until_loaded_and_after_a_failed_load(tiny_dir: Path, http) -> None:
    gate = asyncio.Event()
    loop = asyncio.get_running_loop()

    def slow_loader(config: ServeOptions, metrics: Any) -> Any:
        asyncio.run_coroutine_threadsafe(gate.wait(), loop).result()
        return load_serving(config, metrics)

    def broken_loader(config: ServeOptions, metrics: Any) -> Any:
        raise ValueError("no such checkpoint")

    def dying_engine_loader(config: ServeOptions, metrics: Any) -> Any:
        serving = load_serving(config, metrics)

        async def crash() -> None:
            raise RuntimeError("engine loop bug")

        serving.engine.run = crash  # the loop task ends with an exception once started
        return serving

    config = ServeOptions(model_path=str(tiny_dir), max_total_tokens=64)
    slow, broken = await start_server(config, slow_loader), await start_server(config, broken_loader)
    dying = await start_server(config, dying_engine_loader)
    try:
        for _ in range(200):
            async with http.get(dying.make_url("/health")) as resp:
                status_text = (await resp.json())["status"]
            if "engine loop" in status_text:
                break
            await asyncio.sleep(0.05)
        assert resp.status == 503 and "engine loop bug" in status_text
        status, body = await post(http, str(dying.make_url("/v1/completions")), {"prompt": "x"})
        assert status == 503 and "engine loop" in body["error"]["message"]
        async with http.get(slow.make_url("/health")) as resp:
            assert resp.status == 503
        status, body = await post(http, str(slow.make_url("/v1/completions")), {"prompt": "x"})
        assert status == 503 and "loading" in body["error"]["message"]
        gate.set()
        await _wait_healthy(http, str(slow.make_url("/health")))
        async with http.get(broken.make_url("/health")) as resp:
            assert resp.status == 503 and "no such checkpoint" in (await resp.json())["status"]
    finally:
        await slow.close()
        await broken.close()
        await dying.close()


async def _wait_healthy(http: aiohttp.ClientSession, url: str) -> None:
    for _ in range(200):
        async with http.get(url) as resp:
            if resp.status == 200:
                return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{url} never became healthy")


@pytest.mark.parametrize(
    "flags",
    [
        {"mode": "paged", "resident_experts": 4},  # K = top_k: several waves per step
        {"mode": "offload"},
        {"mode": "cpu-experts", "n_cpu_moe": 2},
    ],
)
async def test_every_mode_serves_the_same_greedy_text_batched(base_url: str, http, tiny_dir: Path, flags: dict) -> None:
    prompts = ["Once upon a time", "A B C D E F", "Numbers: 1 2 3"]
    reference = [
        (await post(http, f"{base_url}/v1/completions", greedy(prompt=p)))[1]["choices"][0]["text"] for p in prompts
    ]
    server = await start_server(ServeOptions(model_path=str(tiny_dir), max_total_tokens=256, **flags))
    try:
        url = str(server.make_url("")).rstrip("/")
        await _wait_healthy(http, f"{url}/health")
        together = await asyncio.gather(*(post(http, f"{url}/v1/completions", greedy(prompt=p)) for p in prompts))
        assert [body["choices"][0]["text"] for _, body in together] == reference
        values = await metric_values(http, url)
        if flags["mode"] != "cpu-experts":
            assert values["paged_experts:expert_misses_total"] > 0  # the mode really paged or streamed experts
        p = "paged_experts:"
        assert values[p + "prefill_chunks_total"] >= len(prompts)  # every prompt was a prefill chunk
        if flags["mode"] == "paged":  # paged in by host-planned waves
            assert values[p + "prefill_waves_total"] > 0
            assert 0 < values[p + "prefill_bytes_paged_total"] <= values[p + "bytes_paged_total"]
            assert 0 < values[p + "prefill_copy_seconds_total"] <= values[p + "prefill_span_seconds_total"]
        else:
            assert values[p + "prefill_bytes_paged_total"] == values[p + "prefill_waves_total"] == 0
    finally:
        await server.close()
