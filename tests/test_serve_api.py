"""Server pieces without HTTP: request validation, stop strings, detokenization, metrics text."""

from __future__ import annotations

import pytest

from benchsuite.tools.scrape import parse_prometheus
from paged_experts.residency.counters import PagingCounters
from paged_experts.server.engine import FinishedRequest
from paged_experts.server.metrics import EngineGauges, ServerMetrics
from paged_experts.server.protocol import (
    ApiError,
    ChatBody,
    CompletionBody,
    chat_options,
    completion_options,
    parse_json,
    single_prompt,
    validate,
)
from paged_experts.server.text import ChatTurn, Detokenizer, StopMatcher, TextCodec
from paged_experts.weights.synth import ensure_tiny


def refused(model: type, body: dict) -> ApiError:
    with pytest.raises(ApiError) as err:
        validate(model, body)
    assert err.value.status == 400
    return err.value


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x", "max_tokens": "5"}, "max_tokens"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "max_tokens": -3}, "max_tokens"),
        ({"prompt": "x", "temperature": "hot"}, "temperature"),
        ({"prompt": "x", "temperature": -0.1}, "temperature"),
        ({"prompt": "x", "top_p": 0}, "top_p"),
        ({"prompt": "x", "n": 2}, "n"),
        ({"prompt": "x", "stream": "yes"}, "stream"),
        ({"prompt": "x", "logprobs": 99}, "logprobs"),
        ({"prompt": "x", "stop": 5}, "stop"),
        ({"prompt": "x", "seed": 10**30}, "seed"),  # beyond what torch.Generator accepts
        ({"prompt": [1, "a"]}, "prompt"),
        ({"max_tokens": 3}, "prompt"),
        ({"prompt": "x", "stream_options": {"include_usage": "y"}, "stream": True}, "stream_options.include_usage"),
    ],
)
def test_completion_body_errors_name_the_field(body: dict, param: str) -> None:
    err = refused(CompletionBody, body)
    assert err.param == param
    assert err.message.startswith(param)
    if param == "prompt" and "prompt" in body:
        assert "list[int]" in err.message  # a union names what it accepts
    assert err.body()["error"]["param"] == param


def test_chat_body_errors_name_the_field() -> None:
    assert refused(ChatBody, {"messages": []}).param == "messages"
    assert refused(ChatBody, {"messages": [{"role": "wizard", "content": "x"}]}).param == "messages.0.role"
    assert refused(ChatBody, {"messages": [{"role": "user", "content": 3}]}).param.startswith("messages.0.content")
    body = validate(ChatBody, {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2})
    with pytest.raises(ApiError) as err:
        chat_options(body)
    assert err.value.param == "top_logprobs"


def test_malformed_json_and_non_object_bodies() -> None:
    for raw in (b"{bad", b"[1, 2]", b"\xff\xfe"):
        with pytest.raises(ApiError) as err:
            parse_json(raw)
        assert err.value.status == 400 and err.value.param == "body"


def test_options_translation() -> None:
    body = validate(CompletionBody, {"prompt": [1, 2], "echo": True, "logprobs": 2, "stop": "END", "stream": True,
                                     "stream_options": {"include_usage": True}, "temperature": 0})  # fmt: skip
    opts = completion_options(body)
    assert opts.prompt_logprobs == 2  # echo + logprobs asks for the prompt's logprobs too
    assert opts.stop_strings == ("END",) and opts.include_usage and opts.temperature == 0.0
    assert single_prompt(body.prompt) == [1, 2]
    assert single_prompt([[4, 5]]) == [4, 5] and single_prompt(["hi"]) == "hi"
    with pytest.raises(ApiError):
        single_prompt(["a", "b"])
    with pytest.raises(ApiError) as err:
        completion_options(validate(CompletionBody, {"prompt": "x", "stream_options": {"include_usage": True}}))
    assert err.value.param == "stream_options"
    chat = validate(ChatBody, {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 3,
                               "max_completion_tokens": 7})  # fmt: skip
    assert chat_options(chat).logprobs == 3 and chat_options(chat).max_tokens == 7


@pytest.mark.parametrize(
    ("deltas", "stops", "out", "stopped"),
    [
        (["Hello wor", "ld! END of", " it"], ["END"], "Hello world! ", True),
        (["ab", "c", "d"], ["cd"], "ab", True),
        (["a", "b", "c"], ["bd"], "abc", False),  # a held 'b' is released at flush
        (["no stops here"], [], "no stops here", False),
        (["xx STOP", "P"], ["STOP", "TOPP"], "xx ", True),
    ],
)
def test_stop_matcher(deltas: list[str], stops: list[str], out: str, stopped: bool) -> None:
    m = StopMatcher(stops)
    text = "".join(m.feed(d) for d in deltas)
    text += m.flush()
    assert text == out and m.stopped == stopped


def test_stop_matcher_holds_back_only_possible_prefixes() -> None:
    m = StopMatcher(["<end>"])
    assert m.feed("abc<e") == "abc"  # '<e' could become '<end>'
    assert m.feed("x") == "<ex"


@pytest.fixture(scope="module")
def codec() -> TextCodec:
    return TextCodec.from_dir(ensure_tiny())


def test_codec_round_trips_and_renders_chatml(codec: TextCodec) -> None:
    text = "The quick brown fox jumps over the lazy dog."
    assert codec.decode(codec.encode(text)) == text
    rendered = codec.render_chat([ChatTurn("system", "be brief"), ChatTurn("user", "hi")])
    assert rendered == "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert codec.eos_token_ids  # from tokenizer_config.json's eos_token and config.json


def test_detokenizer_deltas_concatenate_to_the_full_decode(codec: TextCodec) -> None:
    ids = codec.encode("naïve café — ünïcödé text, ok")
    detok = Detokenizer(codec)
    text = "".join(detok.add([t]) for t in ids) + detok.add([], final=True)
    assert text == codec.decode(ids)
    assert "\ufffd" not in text


def test_ttft_histogram_buckets_are_cumulative_with_inclusive_bounds() -> None:
    m = ServerMetrics()
    for i, ttft_s in enumerate((0.05, 0.1, 0.5, 100.0)):
        m.on_finish(FinishedRequest(str(i), 4, 1, 0.0, ttft_s, (ttft_s,), ttft_s, "length"))
    values = parse_prometheus(m.render(EngineGauges(0, 0, 0, 64), None, routing_synthetic=False))
    name = "paged_experts:time_to_first_token_seconds"
    assert values[name + '_bucket{le="0.1"}'] == 2 and values[name + '_bucket{le="0.5"}'] == 3  # 0.1 is in le=0.1
    assert values[name + '_bucket{le="80.0"}'] == 3 and values[name + '_bucket{le="+Inf"}'] == 4
    assert values[name + "_count"] == 4 and values[name + "_sum"] == pytest.approx(100.65)
    assert not any(k.endswith("_created") for k in values)  # no timestamp series beside the counters


def test_metrics_text_has_every_required_series() -> None:
    m = ServerMetrics()
    m.on_finish(FinishedRequest("a", 10, 3, 0.0, 0.5, (0.5, 0.6, 0.8), 0.8, "length"))
    m.on_finish(FinishedRequest("b", 4, 0, 0.0, None, (), 0.2, "abort"))
    counters = PagingCounters(num_layers=2, expert_bytes=100, mode="paged")
    counters.record_step(0, union=5, routed_pairs=8, hits=3, misses=2, cpu_activations=0, waves=1)
    counters.record_step(1, union=7, routed_pairs=8, hits=1, misses=6, cpu_activations=0, waves=2)
    text = m.render(EngineGauges(2, 1, 48, 1024), counters.snapshot(), routing_synthetic=True)
    values = parse_prometheus(text)
    p = "paged_experts:"
    expected = {
        "num_requests_total": 2, "num_aborted_requests_total": 1, "prompt_tokens_total": 14,
        "generation_tokens_total": 3, "num_running_reqs": 2, "num_queue_reqs": 1, "kv_used_tokens": 48,
        "kv_capacity_tokens": 1024, "routing_synthetic": 1, "expert_activations_total": 12,
        "routed_pairs_total": 16, "expert_hits_total": 4, "expert_misses_total": 8, "bytes_paged_total": 800,
        "waves_total": 3, "moe_steps_total": 2, "union_experts_total": 12, "union_experts_max": 7,
        "time_to_first_token_seconds_count": 1, "inter_token_latency_seconds_count": 2,
        "e2e_request_latency_seconds_count": 1, "copy_seconds_total": 0.0,
    }  # fmt: skip
    for name, value in expected.items():
        assert values[p + name] == value, name
    assert values[p + 'layer_expert_misses_total{layer="1"}'] == 6
    assert values[p + 'layer_expert_hits_total{layer="0"}'] == 3
    assert abs(values[p + "inter_token_latency_seconds_sum"] - 0.3) < 1e-9
