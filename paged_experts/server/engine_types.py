"""The engine's public value types: sampling parameters, engine configuration, the events a
request stream yields, finished-request timings, the admission error, and the two protocols the
engine needs from the runtime (`MoeCausalLM.forward`, `KvPool`), so unit tests can fake them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch

from paged_experts.server.sampling import TokenLogprob
from paged_experts.step import PrefillStepHost

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


@dataclass
class RequestPrefill:
    """The host's side of one request's prefill, summed over the steps that ran its prompt chunks (the model's
    `StepLogits.prefill`), for its `timings` (generation.engine_timings): per request, where the counters of
    /metrics sum a whole cell, so a cell whose requests prefill at two speeds shows which side each one took.
    A step with several prompt chunks gives its figures to each of their requests (`shared_steps` counts them); a
    step that also ran other requests' decode tokens is not counted as shared, though their work is in its issue
    time too."""

    steps: int = 0
    shared_steps: int = 0
    layer_steps: int = 0
    issue_s: float = 0.0
    issue_cpu_s: float = 0.0
    router_s: float = 0.0
    host_wait_s: float = 0.0
    host_plan_s: float = 0.0
    # the engine thread over the same steps (PrefillStepHost): None once a step could not say
    issue_run_delay_s: float | None = 0.0
    issue_voluntary_switches: int | None = 0
    issue_involuntary_switches: int | None = 0
    cpu_id_first: int | None = None  # the CPU at the start of the first such step
    cpu_id_last: int | None = None  # and at the end of the last

    def add(self, step: PrefillStepHost) -> None:
        if not self.steps:
            self.cpu_id_first = step.cpu_id_first
        self.steps += 1
        self.shared_steps += step.chunks > 1
        self.layer_steps += step.layer_steps
        self.issue_s += step.issue_s
        self.issue_cpu_s += step.issue_cpu_s
        self.router_s += step.router_s
        self.host_wait_s += step.host_wait_s
        self.host_plan_s += step.host_plan_s
        self.issue_run_delay_s = _plus(self.issue_run_delay_s, step.issue_run_delay_s)
        self.issue_voluntary_switches = _plus(self.issue_voluntary_switches, step.issue_voluntary_switches)
        self.issue_involuntary_switches = _plus(self.issue_involuntary_switches, step.issue_involuntary_switches)
        self.cpu_id_last = step.cpu_id_last

    def timings(self) -> dict[str, float | int]:
        """The `prefill_*` keys of the request's timings (none before a prefill step ran its prompt)."""
        if not self.steps:
            return {}
        return {
            "prefill_steps": self.steps, "prefill_shared_steps": self.shared_steps,
            "prefill_layer_steps": self.layer_steps, "prefill_issue_ms": self.issue_s * 1e3,
            "prefill_issue_cpu_ms": self.issue_cpu_s * 1e3,
            "prefill_router_ms": self.router_s * 1e3, "prefill_host_wait_ms": self.host_wait_s * 1e3,
            "prefill_host_plan_ms": self.host_plan_s * 1e3,
            **_present({
                "prefill_issue_run_delay_ms": None if self.issue_run_delay_s is None else self.issue_run_delay_s * 1e3,
                "prefill_issue_voluntary_switches": self.issue_voluntary_switches,
                "prefill_issue_involuntary_switches": self.issue_involuntary_switches,
                "prefill_cpu_id_first": self.cpu_id_first, "prefill_cpu_id_last": self.cpu_id_last,
            }),
        }  # fmt: skip


_N = TypeVar("_N", int, float)


def _plus(total: _N | None, step: _N | None) -> _N | None:
    """A sum that stays None once a part is unknown (a figure over some of the steps would read as all of them)."""
    return None if total is None or step is None else total + step


def _present(values: dict[str, float | int | None]) -> dict[str, float | int]:
    """The keys a platform could give (a key the engine cannot measure is left out, never sent as 0)."""
    return {k: v for k, v in values.items() if v is not None}


class AdmissionError(ValueError):
    """A request that can never run; `field` names the request field to change."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(message)
        self.field = field_name
