"""From an engine request stream to text deltas: detokenization, stop strings, and the
token/logprob bookkeeping both endpoints share; the request's own timings as the engine measured them.

Every engine event (one generated token) yields one Delta, whose text may be empty (a token that
spells nothing, or an incomplete UTF-8 character held back): a streaming handler that sends
continuous usage sends each of them, so a client can time every token.

A stop string ends the generation: the text is cut before it, the engine request is aborted
(its KV freed at once) and the finish reason is "stop". Completion tokens count every token the
engine generated, including the ones that spelled the stop string.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from paged_experts.server.engine import FINISH_LENGTH, FINISH_STOP, RequestStream
from paged_experts.server.sampling import TokenLogprob
from paged_experts.server.text import Detokenizer, StopMatcher, TextCodec


@dataclass(frozen=True)
class Delta:
    """New text and the tokens behind it; `text_offset` is where `text` starts in the output."""

    text: str
    text_offset: int
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...]
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None
    finish_reason: str | None
    completion_tokens: int
    error: str | None = None


async def text_deltas(stream: RequestStream, codec: TextCodec, stop_strings: Sequence[str]) -> AsyncIterator[Delta]:
    """Yields one Delta per engine event; the last one carries the finish reason."""
    detok = Detokenizer(codec)
    matcher = StopMatcher(stop_strings)
    emitted = 0
    async for out in stream:
        if out.finish_reason is not None:
            text = matcher.feed(detok.add((), final=True))
            text += "" if matcher.stopped else matcher.flush()
            reason: str | None = FINISH_STOP if matcher.stopped else out.finish_reason
            yield Delta(text, emitted, (), (), None, reason, len(detok.ids), out.error)
            return
        text = matcher.feed(detok.add(out.new_token_ids))
        if matcher.stopped:
            stream.abort(FINISH_STOP)  # frees the KV now; a normal end, not a client abort
            reason = FINISH_STOP
        else:
            reason = None
        yield Delta(text, emitted, out.new_token_ids, out.new_logprobs, out.prompt_logprobs, reason, len(detok.ids))
        emitted += len(text)
        if reason is not None:
            return


def engine_timings(stream: RequestStream, prompt_tokens: int) -> dict[str, float | int]:
    """The engine's own timings of one request, with llama-server's keys (server_slot_stats::to_json) so a
    client reads both engines alike: predicted_n tokens; predicted_ms = token 1 -> token n on the engine's
    clock; predicted_per_second = (predicted_n - 1) / predicted_ms (token 1 comes from the prefill, as in
    llama-server); prompt_ms = arrival -> token 1 (queueing included). Rates are absent, never 0, where
    they are undefined (fewer than 2 tokens). Beside them, this engine's own `prefill_*` keys: the host's side
    of the steps that ran the request's prompt chunks (`RequestPrefill.timings`): prefill_issue_ms, the model's
    host time issuing those steps; prefill_issue_cpu_ms, the engine thread's CPU time in it (below it by the time
    the thread was off the CPU: preempted, or waiting for another thread's interpreter lock); over the paged
    layers' host-planned layer-steps in them (prefill_layer_steps), the time blocked on the device
    (prefill_host_wait_ms) and the rest (prefill_host_plan_ms); prefill_router_ms, a synthetic router's; where the
    platform says (thread_clock: Linux), how the rest of the issue time went: prefill_issue_run_delay_ms (runnable,
    waiting for a CPU), prefill_issue_voluntary_switches and prefill_issue_involuntary_switches, and the CPUs at the
    first step's start and the last one's end (prefill_cpu_id_first, prefill_cpu_id_last). A step with several
    prompt chunks gives its figures to each (prefill_shared_steps)."""
    times = stream.token_times_s
    out: dict[str, float | int] = {"prompt_n": prompt_tokens, "predicted_n": len(times), **stream.prefill_timings}
    if times:
        out["prompt_ms"] = (times[0] - stream.arrival_s) * 1e3
    if len(times) >= 2:
        span_s = times[-1] - times[0]
        out["predicted_ms"] = span_s * 1e3
        if span_s > 0:
            out["predicted_per_second"] = (len(times) - 1) / span_s
    return out


def is_failure(reason: str | None) -> bool:
    """Finish reasons that are not a normal end of generation (abort reaches a client only at shutdown)."""
    return reason is not None and reason not in (FINISH_STOP, FINISH_LENGTH)
