"""The engine's public value types: sampling parameters, engine configuration, the events a
request stream yields, finished-request timings, the admission error, and the two protocols the
engine needs from the runtime (`MoeCausalLM.forward`, `KvPool`), so unit tests can fake them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from paged_experts.server.sampling import TokenLogprob

FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_ABORT = "abort"
FINISH_ERROR = "error"


class ModelLike(Protocol):
    def forward(self, chunks: list[Any]) -> list[torch.Tensor]: ...


class KvPoolLike(Protocol):
    block_size: int

    @property
    def capacity_tokens(self) -> int: ...

    @property
    def free_tokens(self) -> int: ...

    def new_sequence(self) -> Any: ...

    def free(self, seq: Any) -> None: ...


ChunkFactory = Callable[[Any, list[int], int, bool], Any]  # (seq, token_ids, start_pos, all_logits)
StepLayoutHook = Callable[[list[tuple[str, int]]], None]  # called in the worker before forward


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None  # top alternatives per generated token; None: no logprobs
    prompt_logprobs: int | None = None  # top alternatives per prompt token; None: none


@dataclass(frozen=True)
class EngineConfig:
    max_running_requests: int = 16
    chunked_prefill_tokens: int = 2048
    max_context_tokens: int | None = None  # the model's position limit, if any
    eos_token_ids: tuple[int, ...] = ()
    # Launch a greedy decode step before reading the previous one's tokens (they stay on the device):
    # the host's per-step work then overlaps the device's (SGLang's overlap scheduler does the same).
    overlap_schedule: bool = True


@dataclass(frozen=True)
class RequestOutput:
    """One event on a request's stream. `prompt_logprobs` arrives once, with the first token
    (entry 0 is None: the first prompt token has no context)."""

    new_token_ids: tuple[int, ...]
    new_logprobs: tuple[TokenLogprob, ...]
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None
    finish_reason: str | None
    error: str | None = None


@dataclass(frozen=True)
class FinishedRequest:
    """Timings of one request, handed to the metrics listener when it ends (any reason)."""

    request_id: str
    prompt_tokens: int
    completion_tokens: int
    arrival_s: float
    first_token_s: float | None
    token_times_s: tuple[float, ...]
    finish_s: float
    finish_reason: str


class AdmissionError(ValueError):
    """A request that can never run; `field` names the request field to change."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(message)
        self.field = field_name
