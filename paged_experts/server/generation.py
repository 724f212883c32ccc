"""From an engine request stream to text deltas: detokenization, stop strings, and the
token/logprob bookkeeping both endpoints share.

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
            reason = FINISH_STOP if matcher.stopped else out.finish_reason
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


def is_failure(reason: str | None) -> bool:
    """Finish reasons that are not a normal end of generation (abort reaches a client only at shutdown)."""
    return reason is not None and reason not in (FINISH_STOP, FINISH_LENGTH)
