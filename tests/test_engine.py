"""Scheduler logic of paged_experts.server.engine against a small fake model and KV pool.

The fake model's next token is a function of the sequence's whole history, which it keeps per
sequence like a KV cache; it records every forward's chunk layout so tests can pin what one
engine step contains. The real model is exercised in test_engine_real.py and over HTTP.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass

import pytest
import torch

from paged_experts.server.engine import (
    FINISH_ABORT,
    FINISH_ERROR,
    FINISH_LENGTH,
    FINISH_STOP,
    AdmissionError,
    Engine,
    EngineConfig,
    FinishedRequest,
    RequestOutput,
    SamplingParams,
)

VOCAB = 50
EOS = 49
POISON = 48  # a prompt starting with this token gets NaN logits from the fake model (a per-sequence fault)


@dataclass(frozen=True)
class FakeChunk:
    seq: FakeSeq
    token_ids: list[int]
    start_pos: int
    all_logits: bool


class FakeSeq:
    def __init__(self, seq_id: int) -> None:
        self.seq_id = seq_id
        self.tokens: list[int] = []
        self.freed = False


class FakePool:
    def __init__(self, capacity_tokens: int, block_size: int = 4) -> None:
        self.block_size = block_size
        self._capacity = capacity_tokens
        self.live: dict[int, FakeSeq] = {}
        self._next = 0

    @property
    def capacity_tokens(self) -> int:
        return self._capacity

    @property
    def used_tokens(self) -> int:
        return sum(-(-len(s.tokens) // self.block_size) * self.block_size for s in self.live.values())

    @property
    def free_tokens(self) -> int:
        return self._capacity - self.used_tokens

    def new_sequence(self) -> FakeSeq:
        seq = FakeSeq(self._next)
        self._next += 1
        self.live[seq.seq_id] = seq
        return seq

    def free(self, seq: FakeSeq) -> None:
        assert not seq.freed, "double free"
        seq.freed = True
        del self.live[seq.seq_id]


def next_token(history: list[int]) -> int:
    return (sum(history) * 31 + len(history) * 7) % EOS  # EOS only when eos_after says so


class FakeModel:
    def __init__(self, pool: FakePool, eos_after: int | None = None) -> None:
        self.pool = pool
        self.calls: list[list[tuple[int, int, int]]] = []  # per forward: (seq_id, start_pos, n)
        self.eos_after = eos_after  # emit EOS once a sequence holds this many tokens
        self.fail_next = False
        # When set, each forward takes one permit: the test decides when the engine thread may run
        # its next step (it runs steps back to back otherwise, far faster than a test can react).
        self.gate: threading.Semaphore | None = None

    def forward(self, chunks: list[FakeChunk]) -> list[torch.Tensor]:
        if self.gate is not None:
            assert self.gate.acquire(timeout=30), "the test never released this step"
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("injected failure")
        self.calls.append([(c.seq.seq_id, c.start_pos, len(c.token_ids)) for c in chunks])
        out = []
        for c in chunks:
            assert not c.seq.freed, "forward on a freed sequence"
            assert c.start_pos == len(c.seq.tokens), "chunk does not continue its sequence"
            rows = []
            for t in c.token_ids:
                c.seq.tokens.append(t)
                nxt = next_token(c.seq.tokens)
                if self.eos_after is not None and len(c.seq.tokens) >= self.eos_after:
                    nxt = EOS
                row = torch.full((VOCAB,), -5.0)
                row[nxt] = 5.0
                if c.seq.tokens[0] == POISON:
                    row = torch.full((VOCAB,), float("nan"))
                rows.append(row)
            assert self.pool.used_tokens <= self.pool.capacity_tokens, "KV over capacity"
            logits = torch.stack(rows)
            out.append(logits if c.all_logits else logits[-1:])
        return out


def make_engine(
    capacity: int = 256, eos_after: int | None = None, **config: object
) -> tuple[Engine, FakeModel, FakePool, list[FinishedRequest]]:
    pool = FakePool(capacity)
    model = FakeModel(pool, eos_after)
    finished: list[FinishedRequest] = []
    cfg = EngineConfig(eos_token_ids=(EOS,), **config)  # type: ignore[arg-type]
    engine = Engine(model, pool, FakeChunk, cfg, on_finish=finished.append)
    return engine, model, pool, finished


def expected_greedy(prompt: list[int], n: int) -> list[int]:
    history, out = list(prompt), []
    for _ in range(n):
        tok = next_token(history)
        out.append(tok)
        history.append(tok)
    return out


async def collect(stream) -> tuple[list[int], list[RequestOutput]]:
    events = [e async for e in stream]
    return [t for e in events for t in e.new_token_ids], events


@pytest.fixture
async def running():
    tasks = []

    def start(engine: Engine) -> Engine:
        tasks.append(asyncio.create_task(engine.run()))
        return engine

    yield start
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def test_greedy_tokens_follow_the_model_and_stop_at_max_tokens(running) -> None:
    engine, _, pool, finished = make_engine()
    running(engine)
    tokens, events = await collect(engine.submit("a", [3, 4, 5], SamplingParams(max_tokens=6)))
    assert tokens == expected_greedy([3, 4, 5], 6)
    assert events[-1].finish_reason == FINISH_LENGTH
    assert finished[0].completion_tokens == 6 and finished[0].prompt_tokens == 3
    assert pool.live == {}  # KV freed at the end


async def test_concurrent_requests_share_each_decode_step(running) -> None:
    engine, model, _, _ = make_engine()
    streams = [engine.submit(f"r{i}", [i + 1, 2, 3], SamplingParams(max_tokens=5)) for i in range(3)]
    running(engine)
    results = await asyncio.gather(*(collect(s) for s in streams))
    for i, (tokens, _) in enumerate(results):
        assert tokens == expected_greedy([i + 1, 2, 3], 5)
    # step 1 prefills all three together; every later step decodes all three in ONE forward
    assert [len(call) for call in model.calls] == [3, 3, 3, 3, 3]
    assert all(n == 1 for call in model.calls[1:] for _, _, n in call)


async def test_new_request_joins_the_running_batch_between_steps(running) -> None:
    engine, model, _, _ = make_engine()
    model.gate = threading.Semaphore(3)  # prefill + 2 decode steps, then the engine waits for the test
    running(engine)
    first = engine.submit("a", [1, 2], SamplingParams(max_tokens=8))
    got = [await first.__anext__() for _ in range(3)]  # a has decoded a few tokens alone
    assert all(len(call) == 1 for call in model.calls)
    second = engine.submit("b", [7, 7, 7], SamplingParams(max_tokens=3))
    model.gate.release(100)
    tokens_b, _ = await collect(second)
    tokens_a = [t for e in got for t in e.new_token_ids] + (await collect(first))[0]
    assert tokens_a == expected_greedy([1, 2], 8)
    assert tokens_b == expected_greedy([7, 7, 7], 3)
    joined = [call for call in model.calls if len(call) == 2]
    assert joined, "b never ran in the same forward as a"
    # b's prefill chunk ran in the same step as one of a's decode tokens
    assert any({n for _, _, n in call} == {1, 3} for call in joined)


async def test_long_prompt_is_chunked_so_decoders_advance_every_step(running) -> None:
    engine, model, _, _ = make_engine(chunked_prefill_tokens=4)
    model.gate = threading.Semaphore(1)  # the decoder's prefill; the long prompt arrives before its next step
    running(engine)
    decoder = engine.submit("dec", [1], SamplingParams(max_tokens=12))
    await decoder.__anext__()
    long_prompt = list(range(1, 14))  # 13 tokens -> chunks of 4, 4, 4, 1
    long = engine.submit("long", long_prompt, SamplingParams(max_tokens=2))
    model.gate.release(100)
    tokens_long, _ = await collect(long)
    await collect(decoder)
    assert tokens_long == expected_greedy(long_prompt, 2)
    long_seq = max(seq for call in model.calls for seq, _, _ in call)
    prefill_steps = [call for call in model.calls if any(s == long_seq and n > 1 for s, _, n in call)]
    assert [n for call in prefill_steps for s, _, n in call if s == long_seq] == [4, 4, 4]
    for call in prefill_steps:  # the decoding request is in every one of those steps
        assert any(s != long_seq and n == 1 for s, _, n in call)


async def test_admission_rejects_what_can_never_fit_naming_the_field() -> None:
    engine, _, _, _ = make_engine(capacity=32)
    with pytest.raises(AdmissionError) as err:
        engine.check_admissible(40, 1)
    assert err.value.field == "prompt"
    with pytest.raises(AdmissionError) as err:
        engine.check_admissible(20, 13)
    assert err.value.field == "max_tokens" and "32" in str(err.value)
    engine.check_admissible(20, 12)  # exactly the capacity fits
    with pytest.raises(AdmissionError):
        engine.submit("x", [], SamplingParams(max_tokens=1))


async def test_requests_wait_when_kv_is_full_and_run_when_it_frees(running) -> None:
    engine, model, pool, _ = make_engine(capacity=32)
    model.gate = threading.Semaphore(1)  # a's prefill, then the engine waits for the test
    running(engine)
    a = engine.submit("a", [1] * 10, SamplingParams(max_tokens=10))  # reserves 20 tokens
    b = engine.submit("b", [2] * 10, SamplingParams(max_tokens=10))  # does not fit beside a
    await a.__anext__()
    assert engine.num_running == 1 and engine.num_waiting == 1
    model.gate.release(100)
    tokens_b, _ = await collect(b)
    assert tokens_b == expected_greedy([2] * 10, 10)
    assert not any(len(call) == 2 for call in model.calls)  # never ran together
    await collect(a)
    assert pool.live == {}


async def test_max_running_requests_caps_the_batch(running) -> None:
    engine, model, _, _ = make_engine(max_running_requests=2)
    streams = [engine.submit(f"r{i}", [i + 1], SamplingParams(max_tokens=3)) for i in range(5)]
    running(engine)
    await asyncio.gather(*(collect(s) for s in streams))
    assert max(len(call) for call in model.calls) == 2


async def test_abort_of_a_running_request_frees_its_kv_and_others_continue(running) -> None:
    engine, model, pool, finished = make_engine()
    model.gate = threading.Semaphore(2)  # the test aborts a while the engine waits for step 3
    running(engine)
    a = engine.submit("a", [1, 2], SamplingParams(max_tokens=50))
    b = engine.submit("b", [3, 4], SamplingParams(max_tokens=6))
    await a.__anext__()
    a.abort()
    model.gate.release(100)
    tokens_a, events_a = await collect(a)
    assert events_a[-1].finish_reason == FINISH_ABORT and len(tokens_a) < 50
    tokens_b, _ = await collect(b)
    assert tokens_b == expected_greedy([3, 4], 6)
    assert pool.live == {}
    assert {f.request_id: f.finish_reason for f in finished} == {"a": FINISH_ABORT, "b": FINISH_LENGTH}


async def test_ending_early_for_a_stop_string_is_a_normal_stop(running) -> None:
    engine, model, pool, finished = make_engine()
    model.gate = threading.Semaphore(1)
    running(engine)
    stream = engine.submit("s", [1, 2], SamplingParams(max_tokens=50))
    await stream.__anext__()
    stream.abort(FINISH_STOP)
    stream.abort()  # the handler's cleanup abort afterwards must not change the reason
    model.gate.release(100)
    _, events = await collect(stream)
    assert events[-1].finish_reason == FINISH_STOP and finished[0].finish_reason == FINISH_STOP
    assert pool.live == {}


async def test_abort_of_a_queued_request_never_runs_it() -> None:
    engine, model, _, _ = make_engine()
    stream = engine.submit("q", [1, 2, 3], SamplingParams(max_tokens=4))
    stream.abort()
    _, events = await collect(stream)
    assert events[-1].finish_reason == FINISH_ABORT
    assert model.calls == [] and engine.num_waiting == 0


async def test_eos_stops_unless_ignored_and_stop_token_ids_stop(running) -> None:
    engine, _, _, _ = make_engine(eos_after=5)
    running(engine)
    tokens, events = await collect(engine.submit("a", [1, 2, 3], SamplingParams(max_tokens=10)))
    # the KV holds 3 prompt + 2 fed-back tokens when the model first predicts EOS: 3rd token
    assert tokens[-1] == EOS and len(tokens) == 3 and events[-1].finish_reason == FINISH_STOP
    tokens, events = await collect(engine.submit("b", [1, 2, 3], SamplingParams(max_tokens=10, ignore_eos=True)))
    assert len(tokens) == 10 and events[-1].finish_reason == FINISH_LENGTH
    plain = running(make_engine()[0])  # no forced EOS
    expected = expected_greedy([9, 9], 6)
    stop_at = expected[3]
    tokens, events = await collect(plain.submit("c", [9, 9], SamplingParams(max_tokens=6, stop_token_ids=(stop_at,))))
    assert tokens == expected[: expected.index(stop_at) + 1] and events[-1].finish_reason == FINISH_STOP


async def test_seeded_sampling_is_reproducible_and_differs_across_seeds(running) -> None:
    engine, _, _, _ = make_engine()
    running(engine)

    async def sample(seed: int) -> list[int]:
        params = SamplingParams(max_tokens=12, temperature=5.0, seed=seed)
        return (await collect(engine.submit(f"s{seed}-{id(params)}", [1, 2], params)))[0]

    first, again, other = await sample(1), await sample(1), await sample(2)
    assert first == again
    assert first != other


async def test_prompt_and_token_logprobs_line_up_with_positions(running) -> None:
    engine, _, _, _ = make_engine(chunked_prefill_tokens=2)  # chunk boundaries inside the prompt
    running(engine)
    prompt = [4, 8, 15, 16, 23]
    params = SamplingParams(max_tokens=2, logprobs=2, prompt_logprobs=1)
    tokens, events = await collect(engine.submit("lp", prompt, params))
    plps = events[0].prompt_logprobs
    assert plps is not None and plps[0] is None and len(plps) == len(prompt)
    for i, entry in enumerate(plps[1:], start=1):
        assert entry.token_id == prompt[i]
        predicted = next_token(prompt[:i])
        # the fake puts logit 5 on its prediction and -5 elsewhere
        assert entry.logprob > -0.1 if predicted == prompt[i] else entry.logprob < -9
        assert entry.top[0][0] == predicted
    token_lps = [lp for e in events for lp in e.new_logprobs]
    assert [lp.token_id for lp in token_lps] == tokens
    assert all(len(lp.top) == 2 and lp.top[0][0] == lp.token_id for lp in token_lps)


async def test_a_failing_step_ends_its_requests_and_the_engine_keeps_serving(running) -> None:
    engine, model, pool, _ = make_engine()
    running(engine)
    model.fail_next = True
    _, events = await collect(engine.submit("bad", [1, 2], SamplingParams(max_tokens=3)))
    assert events[-1].finish_reason == FINISH_ERROR and "injected failure" in (events[-1].error or "")
    assert pool.live == {}
    tokens, _ = await collect(engine.submit("good", [1, 2], SamplingParams(max_tokens=3)))
    assert tokens == expected_greedy([1, 2], 3)


async def test_tiny_top_p_keeps_only_the_best_token(running) -> None:
    engine, _, _, _ = make_engine()
    running(engine)
    # at temperature 2 the fake's best token has p ~ 0.75, so 16 draws rarely all pick it
    free = SamplingParams(max_tokens=16, temperature=2.0, seed=3)
    assert (await collect(engine.submit("free", [2, 3], free)))[0] != expected_greedy([2, 3], 16)
    nucleus = SamplingParams(max_tokens=16, temperature=2.0, top_p=0.5, seed=3)
    assert (await collect(engine.submit("p", [2, 3], nucleus)))[0] == expected_greedy([2, 3], 16)


@pytest.mark.parametrize(
    ("temperature", "top_p"), [(1e-40, 1.0), (5e-324, 1.0), (1.0, 5e-324), (2.0, 5e-324), (1e-30, 1e-30)]
)
async def test_extreme_sampling_parameters_are_greedy_and_never_fail_the_step(
    running, temperature: float, top_p: float
) -> None:
    engine, _, _, _ = make_engine()
    running(engine)
    extreme = engine.submit("x", [3, 4], SamplingParams(max_tokens=6, temperature=temperature, top_p=top_p, seed=1))
    other = engine.submit("o", [5, 6], SamplingParams(max_tokens=6))
    (got_x, events_x), (got_o, events_o) = await asyncio.gather(collect(extreme), collect(other))
    assert events_x[-1].finish_reason == FINISH_LENGTH, events_x[-1].error
    assert got_x == expected_greedy([3, 4], 6)  # a vanishing temperature or nucleus is top-1
    assert events_o[-1].finish_reason == FINISH_LENGTH and got_o == expected_greedy([5, 6], 6)


async def test_a_sequence_whose_sampling_fails_ends_alone_and_its_step_mates_finish(running) -> None:
    engine, model, pool, finished = make_engine()
    running(engine)
    params = SamplingParams(max_tokens=5, temperature=1.0, seed=0)
    bad = engine.submit("bad", [POISON, 1], params)
    good = engine.submit("good", [1, 2], SamplingParams(max_tokens=5))
    (_, events_bad), (tokens_good, events_good) = await asyncio.gather(collect(bad), collect(good))
    assert any(len(call) == 2 for call in model.calls), "both requests must share a step for this test to mean anything"
    assert events_bad[-1].finish_reason == FINISH_ERROR and "finite logit" in (events_bad[-1].error or "")
    assert events_good[-1].finish_reason == FINISH_LENGTH and tokens_good == expected_greedy([1, 2], 5)
    assert pool.live == {} and {f.request_id: f.finish_reason for f in finished} == {
        "bad": FINISH_ERROR,
        "good": FINISH_LENGTH,
    }
