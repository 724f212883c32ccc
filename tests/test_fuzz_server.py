"""Bad requests to the built-in server: property-based fuzzing of its request parsing over real
HTTP, plus a corpus of bad requests (tests/data/bad_requests.jsonl) each with its expected error.

One real server process (`python -m paged_experts.server`, tiny checkpoint, CPU, a small KV pool so
a valid body cannot ask for long work) receives random JSON bodies, random values of every type
in every field of /v1/completions and /v1/chat/completions, and raw bytes. Properties: never a
5xx, never a hang (every request has a wall-clock limit), a 4xx always carries an OpenAI-style
error naming a parameter, and the server still answers /health afterwards.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from real_servers import builtin_server

CORPUS = Path(__file__).resolve().parent / "data" / "bad_requests.jsonl"
REQUEST_LIMIT_S = 20.0  # one request's wall-clock limit: the server must answer within it
KV_CAPACITY_TOKENS = 256

COMPLETION_FIELDS = ["model", "prompt", "max_tokens", "temperature", "top_p", "n", "seed", "stop", "stop_token_ids",
                     "ignore_eos", "stream", "stream_options", "prompt_logprobs", "return_tokens_as_token_ids", "echo",
                     "logprobs", "best_of"]  # fmt: skip
CHAT_FIELDS = ["model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "seed", "stop",
               "stop_token_ids", "ignore_eos", "stream", "stream_options", "logprobs", "top_logprobs",
               "add_generation_prompt"]  # fmt: skip


@pytest.fixture(scope="module")
def server_url(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    flags = ("--max-total-tokens", str(KV_CAPACITY_TOKENS), "--max-running-requests", "4")
    with builtin_server(tiny_model_dir, tmp_path_factory.mktemp("fuzz-server"), *flags) as url:
        yield url


def send(url: str, raw: bytes, content_type: str = "application/json") -> tuple[int, bytes]:
    """POST raw bytes; read the whole answer (streams included) within REQUEST_LIMIT_S."""
    deadline = time.monotonic() + REQUEST_LIMIT_S
    req = urllib.request.Request(url, data=raw, method="POST", headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(req, timeout=REQUEST_LIMIT_S) as resp:
            chunks = []
            while chunk := resp.read(65536):
                chunks.append(chunk)
                assert time.monotonic() < deadline, f"{url}: answer still streaming after {REQUEST_LIMIT_S:g} s"
            return resp.status, b"".join(chunks)
    except urllib.error.HTTPError as err:
        return err.code, err.read()
    except TimeoutError:
        pytest.fail(f"{url}: no answer within {REQUEST_LIMIT_S:g} s to {raw[:300]!r}")


def check_answer(status: int, body: bytes, raw: bytes) -> None:
    assert status < 500, f"HTTP {status} for {raw[:300]!r}: {body[:500]!r}"
    if status >= 400:
        error = json.loads(body)["error"]
        assert error["code"] == status and error["message"], error
        assert error["param"] is None or isinstance(error["param"], str)


def healthy(base: str) -> bool:
    with urllib.request.urlopen(f"{base}/health", timeout=REQUEST_LIMIT_S) as resp:
        return resp.status == 200


# text as a hostile client writes it: lone UTF-16 surrogates (json.dumps escapes them as \\udXXX), controls
HOSTILE_TEXT = st.text(st.characters(categories=["Cs", "Cc", "Lu", "Ll", "Nd", "Zs", "So"]), max_size=12)
JSON_SCALARS = st.one_of(
    st.none(),
    HOSTILE_TEXT,
    st.booleans(),
    st.integers(-3, 12),
    st.sampled_from([0, -1, 255, 256, 4095, 4096, 2**31, 2**63, 2**64, -(2**63) - 1, 10**30]),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([1e308, -1e308, 5e-324, 0.5, 2.0, 2.5]),
    st.text(max_size=12),
)
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", "developer", "robot"]) | JSON_VALUES},
    optional={"content": st.text(max_size=20)
                         | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=8)}),
                                    max_size=2)
                         | JSON_VALUES,
              "name": JSON_VALUES},
)  # fmt: skip
PLAUSIBLE = {
    "model": st.sampled_from([None, "ckpt", "tiny", "gpt-4o", ""]),  # the fixture serves `ckpt` (its directory)
    "temperature": st.sampled_from([0.0, 1e-40, 5e-324, 1e-300, 0.7, 2.0]) | st.floats(0, 2),
    "top_p": st.sampled_from([5e-324, 1e-300, 1e-8, 0.5, 1.0]) | st.floats(0, 1, exclude_min=True),
    "prompt": st.text(max_size=30)
    | HOSTILE_TEXT
    | st.lists(st.integers(-5, 5000), max_size=6)
    | st.lists(st.text(max_size=5), max_size=2)
    | st.lists(st.lists(st.integers(0, 100), max_size=3), max_size=2),
    "messages": st.lists(MESSAGE, max_size=3),
    "max_tokens": st.integers(-2, 6),
    "max_completion_tokens": st.integers(-2, 6),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans() | JSON_VALUES}),
    "logprobs": st.booleans() | st.integers(-1, 25),
    "top_logprobs": st.integers(-1, 25),
    "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=6),
    "stop_token_ids": st.lists(st.integers(-(2**40), 2**40), max_size=3),
    "seed": st.integers(-(2**70), 2**70),
    "prompt_logprobs": st.integers(-1, 25),
}


@st.composite
def bodies(draw: st.DrawFn, fields: list[str]) -> dict[str, Any]:
    body: dict[str, Any] = {}
    for name in draw(st.lists(st.sampled_from(fields), unique=True, max_size=len(fields))):
        body[name] = draw(PLAUSIBLE[name] | JSON_VALUES) if name in PLAUSIBLE else draw(JSON_VALUES)
    if draw(st.booleans()):
        body[draw(st.text(max_size=8))] = draw(JSON_VALUES)  # unknown fields are ignored, not an error
    return body


FUZZ = settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)


@FUZZ
@given(body=bodies(COMPLETION_FIELDS))
def test_fuzzed_completions_never_get_a_5xx_or_hang(server_url: str, body: dict[str, Any]) -> None:
    raw = json.dumps(body).encode()
    check_answer(*send(f"{server_url}/v1/completions", raw), raw)


@FUZZ
@given(body=bodies(CHAT_FIELDS))
def test_fuzzed_chat_completions_never_get_a_5xx_or_hang(server_url: str, body: dict[str, Any]) -> None:
    raw = json.dumps(body).encode()
    check_answer(*send(f"{server_url}/v1/chat/completions", raw), raw)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    raw=st.binary(max_size=64) | st.builds(lambda v: json.dumps(v).encode(), JSON_VALUES),
    path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
)
def test_raw_bodies_never_get_a_5xx(server_url: str, raw: bytes, path: str) -> None:
    check_answer(*send(f"{server_url}{path}", raw), raw)


def _nested(depth: int, inner: str) -> str:
    return "[" * depth + inner + "]" * depth


HOSTILE_RAW = st.one_of(
    # nesting of any depth in a field, closed or not
    st.builds(
        lambda d, field: f'{{"prompt": "hi", "{field}": {_nested(d, "1")}}}'.encode(),
        st.integers(1, 20_000),
        st.sampled_from(["prompt", "stop", "x", "messages"]),
    ),
    st.builds(lambda d: ("[" * d).encode(), st.integers(1, 50_000)),
    # numbers of any size where an int or a float is expected
    st.builds(
        lambda n, field: f'{{"prompt": "hi", "{field}": {"9" * n}}}'.encode(),
        st.integers(1, 6000),
        st.sampled_from(["max_tokens", "seed", "temperature", "logprobs"]),
    ),
    st.builds(lambda e: f'{{"prompt": "hi", "temperature": 1e{e}}}'.encode(), st.integers(-400, 400)),
    st.sampled_from([b'{"prompt": "hi", "temperature": NaN}', b'{"prompt": "hi", "top_p": -Infinity}']),
    # bytes that are not UTF-8, and surrogates escaped or encoded, inside a prompt string
    st.builds(lambda junk: b'{"prompt": "a' + junk + b'b", "max_tokens": 1}', st.binary(min_size=1, max_size=6)),
    st.builds(lambda cp: f'{{"prompt": "x\\u{cp:04x}y", "max_tokens": 1}}'.encode(), st.integers(0xD800, 0xDFFF)),
    st.builds(
        lambda cp: b'{"prompt": "' + chr(cp).encode("utf-8", "surrogatepass") + b'"}', st.integers(0xD800, 0xDFFF)
    ),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=HOSTILE_RAW, path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
def test_hostile_json_of_any_depth_size_or_encoding_is_a_4xx(server_url: str, raw: bytes, path: str) -> None:
    check_answer(*send(f"{server_url}{path}", raw), raw)


def corpus() -> list[dict[str, Any]]:
    return [json.loads(line) for line in CORPUS.read_text().splitlines() if line.strip() and not line.startswith("//")]


@pytest.mark.parametrize("case", corpus(), ids=lambda case: case["name"])
def test_bad_request_corpus(server_url: str, case: dict[str, Any]) -> None:
    raw = case["raw"].encode() if "raw" in case else json.dumps(case["body"]).encode()
    status, body = send(f"{server_url}{case['path']}", raw)
    assert status == case["status"], body
    error = json.loads(body)["error"]
    assert error["param"] == case["param"], error
    assert case["message"] in error["message"], error


def test_the_server_still_answers_after_the_fuzzing(server_url: str) -> None:
    assert healthy(server_url)
    raw = json.dumps({"prompt": "hello", "max_tokens": 3, "temperature": 0}).encode()
    status, body = send(f"{server_url}/v1/completions", raw)
    assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 3
