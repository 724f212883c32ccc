"""The HTTP boundary of the built-in server: OpenAI request bodies validated into typed values.

Owns the pydantic models for `POST /v1/completions` and `POST /v1/chat/completions` (strict types,
unknown fields ignored as OpenAI clients send many), the `ApiError` every handler turns into a
JSON error body, and the translation of a validation failure into a 400 that names the field.
Everything past this module works on validated values; nothing here touches the model.

`parse_json` refuses, with a 400 naming `body` (or the field holding the bad text), whatever is not
a JSON object of valid Unicode: bytes that are not UTF-8 (RFC 8259 section 8.1), NaN/Infinity
literals, numbers past Python's 4,300-digit conversion limit, nesting deeper than MAX_JSON_DEPTH
(no valid request nests past 6; Python's parser itself fails near 1,000 with a RecursionError), and
strings holding a lone UTF-16 surrogate (`"\ud800"` escapes decode to text no tokenizer can encode).

Extensions beyond OpenAI, with vLLM/SGLang names where they exist: `ignore_eos`,
`stream_options.continuous_usage_stats`, `stop_token_ids`, `prompt_logprobs` (int: top alternatives per prompt token),
`return_tokens_as_token_ids`, `seed`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

MAX_TOP_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_JSON_DEPTH = 32  # arrays/objects inside each other; a chat body needs 4
_SURROGATE = re.compile("[\ud800-\udfff]")


class ApiError(Exception):
    """A request the server refuses; rendered as an OpenAI-style error body."""

    def __init__(self, status: int, param: str | None, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.param = param
        self.message = message

    def body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.status}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, frozen=True)


class StreamOptions(_Strict):
    include_usage: bool = False
    # vLLM / SGLang: usage on every streamed chunk, and a chunk for every generated token (text or not)
    continuous_usage_stats: bool = False


class _SamplingFields(_Strict):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    n: Literal[1] = 1
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)  # what torch.Generator accepts
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    return_tokens_as_token_ids: bool = False


class CompletionBody(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    best_of: Literal[1] | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart] | None = None
    name: str | None = None


class ChatBody(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    add_generation_prompt: bool = True


@dataclass(frozen=True)
class GenerationOptions:
    """What both endpoints ask of the engine and the text layer, after validation."""

    max_tokens: int | None  # None: the endpoint's default
    temperature: float
    top_p: float
    seed: int | None
    stop_strings: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    stream: bool
    include_usage: bool
    continuous_usage: bool  # usage on every chunk, one chunk per generated token even when its text is empty
    logprobs: int | None  # top alternatives per generated token; None: no logprobs
    prompt_logprobs: int | None  # top alternatives per prompt token; None: none
    tokens_as_ids: bool


def _loc_param(loc: tuple[Any, ...]) -> str:
    # pydantic puts union member tags ('str', 'list[int]') into loc; they are not field names.
    parts = [str(p) for p in loc if isinstance(p, int) or not _is_type_tag(str(p))]
    return ".".join(parts) if parts else "body"


def _is_type_tag(part: str) -> bool:
    return part in {"str", "int", "float", "bool", "none"} or "[" in part or part.startswith("literal")


def _union_tags(errors: list[Any], loc: tuple[Any, ...]) -> list[str]:
    """The member types of a union field every member of which refused the value."""
    tags: list[str] = []
    for err in errors:
        e_loc = tuple(err["loc"])
        for i, part in enumerate(e_loc):
            if isinstance(part, str) and _is_type_tag(part):
                if e_loc[:i] == loc[:i] and part not in tags:
                    tags.append(part)
                break
    return tags


def parse_json(raw: bytes) -> dict[str, Any]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(400, "body", f"body: malformed JSON (not UTF-8 at byte {exc.start})") from None
    try:
        body = json.loads(text, parse_constant=_refuse_constant)
    except json.JSONDecodeError as exc:
        raise ApiError(400, "body", f"body: malformed JSON ({exc})") from None
    except RecursionError:
        raise ApiError(400, "body", f"body: malformed JSON (nested deeper than {MAX_JSON_DEPTH} levels)") from None
    except ValueError as exc:  # an integer past sys.get_int_max_str_digits(), or a NaN/Infinity literal
        raise ApiError(400, "body", f"body: malformed JSON ({str(exc).split(':')[0]})") from None
    if not isinstance(body, dict):
        raise ApiError(400, "body", "body: expected a JSON object")
    _check_text_and_depth(body)
    return body


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def _check_text_and_depth(body: dict[str, Any]) -> None:
    """Iterative walk (a recursive one would overflow on the depth it checks)."""
    stack: list[tuple[Any, tuple[str | int, ...]]] = [(body, ())]
    while stack:
        value, loc = stack.pop()
        if len(loc) > MAX_JSON_DEPTH:
            raise ApiError(400, "body", f"body: malformed JSON (nested deeper than {MAX_JSON_DEPTH} levels)")
        if isinstance(value, str):
            if (bad := _SURROGATE.search(value)) is not None:
                param = _loc_param(loc) if loc else "body"
                raise ApiError(
                    400, param, f"{param}: invalid Unicode: a lone UTF-16 surrogate U+{ord(bad.group()):04X} "
                    f"at character {bad.start()}"
                )  # fmt: skip
        elif isinstance(value, dict):
            for key, item in value.items():
                stack.append((key, loc))
                stack.append((item, (*loc, key)))
        elif isinstance(value, list):
            stack.extend((item, (*loc, i)) for i, item in enumerate(value))


def validate(model: type[BaseModel], body: dict[str, Any]) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        errors = exc.errors()
        first = errors[0]
        param = _loc_param(tuple(first["loc"]))
        tags = _union_tags(errors, tuple(first["loc"]))
        detail = f"expected {' or '.join(tags)}" if len(tags) > 1 else first["msg"]
        raise ApiError(400, param, f"{param}: {detail}") from exc


def _stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    strings = [stop] if isinstance(stop, str) else list(stop or [])
    if len(strings) > MAX_STOP_STRINGS:
        raise ApiError(400, "stop", f"stop: at most {MAX_STOP_STRINGS} stop strings")
    if any(s == "" for s in strings):
        raise ApiError(400, "stop", "stop: stop strings must not be empty")
    return tuple(strings)


def _common_options(body: _SamplingFields, max_tokens: int | None, logprobs: int | None) -> GenerationOptions:
    if body.stream_options is not None and not body.stream:
        raise ApiError(400, "stream_options", "stream_options: only allowed when stream is true")
    return GenerationOptions(
        max_tokens=max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        seed=body.seed,
        stop_strings=_stop_strings(body.stop),
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=body.ignore_eos,
        stream=body.stream,
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
        continuous_usage=bool(body.stream_options and body.stream_options.continuous_usage_stats),
        logprobs=logprobs,
        prompt_logprobs=body.prompt_logprobs,
        tokens_as_ids=body.return_tokens_as_token_ids,
    )


def completion_options(body: CompletionBody) -> GenerationOptions:
    opts = _common_options(body, body.max_tokens, body.logprobs)
    if body.echo and body.logprobs is not None and opts.prompt_logprobs is None:
        # OpenAI legacy completions: echo + logprobs returns the prompt tokens' logprobs too.
        opts = replace(opts, prompt_logprobs=body.logprobs)
    return opts


def chat_options(body: ChatBody) -> GenerationOptions:
    if body.max_tokens is not None and body.max_completion_tokens is not None:
        raise ApiError(400, "max_completion_tokens", "max_completion_tokens: give max_tokens or this, not both")
    if body.top_logprobs is not None and not body.logprobs:
        raise ApiError(400, "top_logprobs", "top_logprobs: requires logprobs: true")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    return _common_options(body, body.max_completion_tokens or body.max_tokens, logprobs)


def single_prompt(prompt: str | list[int] | list[str] | list[list[int]]) -> str | list[int]:
    """The one prompt of a completions request (text or token ids); batches are refused."""
    if isinstance(prompt, str):
        return prompt
    if len(prompt) == 0:
        raise ApiError(400, "prompt", "prompt: must not be empty")
    ids = [int(p) for p in prompt if isinstance(p, int)]
    if len(ids) == len(prompt):
        return ids
    first = prompt[0]
    if len(prompt) == 1 and not isinstance(first, int):  # an int alone was returned above
        return first
    raise ApiError(400, "prompt", "prompt: batches of prompts are not supported; send one request per prompt")


def message_text(message: ChatMessage) -> str:
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    return "".join(part.text for part in message.content)
