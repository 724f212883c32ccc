"""The typed rows every stage agrees on: one LoadRequest per prompt to send, one RequestRecord per
request sent, one CellResult per measured cell. The load generator produces RequestRecords,
`metrics` turns them into CellResults, the store writes both (requests.parquet, cells.parquet /
cells.csv) and the report reads them back.

Raw timestamps are `time.perf_counter()` seconds so any metric can be recomputed from the
requests file. Fields never hold a made-up 0 for "unknown": they hold None, and a cell whose
headline metric is None is `invalid` with a reason.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, SerializerFunctionWrapHandler, model_serializer

from benchsuite.errors import UserError

SCHEMA_VERSION = 3
"""Bump when a stored column changes meaning; the store refuses other versions with a fix-it message.
2: cells carry the server's placement (resident_experts, n_cpu_moe) and options as typed fields,
the manifest is benchsuite.results.manifest.Manifest. Version 1 is read through benchsuite.results.schema_v1.
3: TTFT, decode tok/s, TPOT and ITL are timed on the token timeline (every chunk that carries a token
count, text or not; benchsuite.measure.metrics), no longer by text chunks alone. Version 2 is read as it is
(its fields are a subset), reported with the caveat that its figures were timed by text chunks
(TEXT_CHUNK_VERSIONS), and never resumed.
A field added with a default that means what files without it meant needs no bump: `CellResult.node`
(None: measured on the manifest's `machine`, as every cell before `run --ray` was)."""

TEXT_CHUNK_VERSIONS = (1, 2)
"""Schema versions whose stored TTFT and decode figures were timed by text chunks: biased where tokens carry
no text (measured 2026-12-01: llama.cpp's decode +12% to +40% on a padded vocabulary)."""

CellStatus = Literal["ok", "invalid", "failed"]


class StoredFacts(BaseModel):
    """A typed block of facts inside a stored file (the manifest's machine, git, link, canary, search).

    It writes back exactly the keys it was given: a block read from an older file (git facts before
    `tree` and `source` were recorded, a search record before `fit_by`) keeps its keys, and a key that
    was never measured is not written as null. Its producers give every key they know, so what they
    write today is what the plain dicts wrote. Fields are typed where the shape is known; every field
    has a default so older blocks still validate; unknown keys are refused (a typo is an error).
    """

    model_config = ConfigDict(extra="forbid")

    @model_serializer(mode="wrap")
    def _given_keys(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if k in self.model_fields_set}


@dataclass(frozen=True)
class LoadRequest:
    """One prompt to send. `prompt` is text, or token ids for exact prompt lengths (completions only)."""

    prompt_id: str
    prompt_class: str
    prompt: str | list[int] | tuple[int, ...]
    max_tokens: int
    chat: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise UserError(f"request {self.prompt_id}: max_tokens must be >= 1, got {self.max_tokens}")
        if self.chat and not isinstance(self.prompt, str):
            raise UserError(f"request {self.prompt_id}: chat requests take text, not token ids")


@dataclass
class RequestRecord:
    """One request as the client saw it. Times are perf_counter seconds."""

    cell_id: str
    request_index: int  # order of submission within the cell (warmups included, flagged below)
    warmup: bool  # warmup requests are stored but excluded from every metric
    cold: bool  # first request after the engine started
    prompt_id: str  # dataset prompt identity, to compare prompt lengths across engines
    prompt_class: str  # e.g. "short", "2048", "sharegpt"
    max_tokens: int
    t_sent_s: float
    t_first_token_s: float | None  # token 1: the first chunk whose token count reached 1 (else first text chunk)
    t_done_s: float | None
    chunk_times_s: list[float] = field(default_factory=list)  # every content chunk, timed as its SSE event was parsed
    prompt_tokens: int | None = None  # from the server's usage field
    output_tokens: int | None = None  # from the server's usage field, never from max_tokens
    streamed_chunks: int = 0
    usage_mismatch: bool = False  # usage.completion_tokens disagrees with streamed chunk count
    ok: bool = False
    error: str | None = None
    http_status: int | None = None
    output_text: str = ""
    engine_timings: dict[str, Any] | None = None  # engine's own timings when it returns them
    # last, so positional construction keeps its meaning
    chunk_reads: list[int] = field(
        default_factory=list
    )  # body read each content chunk came in (equal: no read between)
    chunk_tokens: list[int] = field(default_factory=list)  # cumulative usage.completion_tokens per chunk, where sent
    # Token-accurate timing (metrics.token_timeline): every streamed choice that carried a token count,
    # text or not (llama.cpp timings_per_token's timings.predicted_n, OpenAI continuous usage stats).
    count_times_s: list[float] = field(default_factory=list)  # each such chunk, timed as its event was parsed
    count_tokens: list[int] = field(default_factory=list)  # the cumulative generated-token count it carried
    count_reads: list[int] = field(default_factory=list)  # body read it came in
    uncounted_chunks: int = 0  # text chunks that carried no count (0 with counts: every token is placed)
    t_first_text_s: float | None = None  # first chunk with non-empty generated text (visible text)
    # seconds the runner's device-memory sampler spent in NVML reads inside [t_sent_s, t_first_token_s]: the
    # instrument's own driver calls beside the engine's work (device_memory.sampler_record); None: none was timed
    # (no GPU, no first token, or a run before 2026-12-05)
    sampler_read_s: float | None = None

    def to_row(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class CellResult:
    """One measured cell: a server configuration x workload x concurrency x repeat."""

    cell_id: str
    run_id: str
    engine: str  # engine entry name in the matrix
    engine_kind: str  # builtin | llamacpp | sglang
    mode: str  # engines.base.Placement.mode, e.g. builtin paged, llamacpp n-cpu-moe, sglang offload
    server_id: str  # hash of the server configuration (one launch serves many cells)
    params: dict[str, Any]  # resolved sweep values, e.g. {"resident_experts": 16}: the labels
    workload: str
    prompt_class: str
    concurrency: int
    repeat: int
    status: CellStatus
    reason: str | None = None
    routing: str = "model"  # "model" or "synthetic:<preset>"; synthetic results say so everywhere
    # The server's placement and options, from its typed options object (engines.base.Placement).
    resident_experts: int | None = None  # K
    n_cpu_moe: int | None = None  # N
    # every engine option in force (performance ones too; defaults resolved where the adapter does)
    options: dict[str, Any] = field(default_factory=dict)
    num_requests: int = 0
    num_errors: int = 0
    error_rate: float | None = None
    ttft_p50_s: float | None = None
    ttft_p90_s: float | None = None
    ttft_p99_s: float | None = None
    itl_p50_s: float | None = None
    itl_p99_s: float | None = None
    itl_per_token_p50_s: float | None = None  # each chunk gap divided by the tokens that chunk carried
    tokens_per_chunk_mean: float | None = None  # > 1: ITL is an inter-chunk latency
    coalesced_gaps: int = 0  # chunk gaps inside one body read (the client did not read between them)
    whole_stream_reads: int = 0  # warm requests whose every content chunk came in one read
    timings_decode_tok_s_p50: float | None = None  # the engine's own per-request figure (llama.cpp timings)
    tpot_p50_s: float | None = None
    decode_tok_s_p50: float | None = None  # per-request decode rate, median over requests
    output_tok_s: float | None = None  # aggregate output tokens / measured window
    request_s: float | None = None
    window_s: float | None = None
    cold_ttft_s: float | None = None
    prompt_tokens_mean: float | None = None
    output_tokens_total: int | None = None
    usage_mismatches: int = 0
    # Token-accurate timing (metrics.token_timeline; metrics.DEFINITIONS has each formula).
    ttft_text_p50_s: float | None = None  # median time to the first visible text (TTFT is to token 1)
    untimed_requests: int = 0  # warm requests without a token timeline: no TTFT, rate or ITL from them
    untimed_reason: str | None = None  # why (one line), e.g. no per-chunk counts and tokens > text chunks
    ttft_late_requests: int = 0  # warm requests whose first timed point carried f > 1 tokens (TTFT to token f)
    decode_agg_tok_s: float | None = None  # sum_i (n_i - f_i) / |union_i [t_token1_i, t_tokenn_i]|
    decode_window_s: float | None = None  # the measure of that union
    client_bound_requests: int = 0  # warm requests whose token 1 or token n the client read late (with others)
    engine_timings_checked: int = 0  # warm requests, not client-bound, with our decode rate and the engine's own
    engine_timings_outside: int = 0  # of those, how many differ by more than their tolerance (metrics)
    engine_timings_ratio_p50: float | None = None  # median per request of ours / the engine's decode rate
    engine_timings_ratio_max_dev: float | None = None  # largest |ours / engine's - 1| over those requests
    # Paging counters over the measured window, where the engine reports them (builtin).
    expert_activations: int | None = None
    expert_hits: int | None = None
    expert_misses: int | None = None
    miss_rate: float | None = None
    bytes_paged: int | None = None
    bytes_paged_per_token: float | None = None
    bytes_h2d_per_token: float | None = None  # every expert byte copied to the device (offload's streaming too)
    waves_per_step: float | None = None
    union_mean: float | None = None
    # The built-in engine's own decode steps over the window (paging.paging_delta): step time and rate in process.
    engine_decode_step_s: float | None = None
    engine_decode_tok_s: float | None = None
    gpu_memory_used_bytes: int | None = None  # device memory in use after the cell (built-in engine on CUDA)
    # Prefill page-in over the window (paging.paging_delta): per prompt chunk, the copy engine's share, waves.
    prefill_chunks: int | None = None
    prefill_bytes_per_chunk: float | None = None
    prefill_router_s_per_chunk: float | None = None
    prefill_copy_s_per_chunk: float | None = None
    prefill_span_s_per_chunk: float | None = None
    prefill_copy_busy: float | None = None
    prefill_waves_per_layer: float | None = None
    prefill_staged_unused_per_layer: float | None = None
    prefill_idle_before_layer_s: float | None = None  # link idle before each layer's first page-in, per layer-step
    prefill_idle_between_waves_s: float | None = None  # link idle between one layer's page-ins, per layer-step
    prefill_host_wait_s: float | None = None  # host blocked on the device per paged layer-step (paging.py)
    prefill_host_plan_s: float | None = None  # the rest of its host time (plan, launches), per paged layer-step
    decode_miss_rate: float | None = None
    experts_prefetched: int | None = None  # next-layer prefetch: experts paged in before their routing (paging.py)
    prefetch_accuracy: float | None = None  # of those, the share the layer then routed to
    decode_bytes_per_token: float | None = None  # expert bytes paged in per decode token (paging.py says how)
    gc_pause_s: float | None = None  # built-in server: CPU seconds of Python garbage collections over the cell
    gc_full_collections: int | None = None  # built-in server: oldest-generation collections over the cell
    # Belady's hit rate over the cell's steps from the recorded routing trace (paging.optimal_hit_rate);
    # None without one (extras["hit_rate_optimal_note"] says why). Set after the server stopped.
    hit_rate_optimal: float | None = None
    # Peak device memory of the server's processes over the whole cell, every engine alike
    # (benchsuite.tools.device_memory: NVML per process, sampled); None without a GPU, never 0.
    peak_device_memory_bytes: int | None = None
    device_memory_method: str | None = None  # "nvml-per-process", or "nvml-device-delta" where pids are hidden
    # Engine-specific extras (parsed log facts, captured batch sizes, flags).
    extras: dict[str, Any] = field(default_factory=dict)
    # The Ray node that measured the cell (`benchsuite run --ray`: its node id, the key of the manifest's
    # `nodes`); None: the machine of the run's manifest (`machine`), as in every run without --ray.
    node: str | None = None

    def to_row(self) -> dict[str, Any]:
        return asdict(self)
