"""The engine over the real tiny model (CPU, fp32): greedy output is the same alone and batched,
in every runtime mode, and logprobs agree between decoding and prompt scoring."""

from __future__ import annotations

import asyncio
import math
import sys
import threading
from pathlib import Path

import pytest

from paged_experts.kv import KvPool
from paged_experts.model import MoeCausalLM, SeqChunk
from paged_experts.runtime import RuntimeConfig
from paged_experts.server.engine import Engine, EngineConfig, SamplingParams
from paged_experts.server.generation import engine_timings
from paged_experts.weights.synth import ensure_tiny

PROMPTS = ([5, 17, 300, 42, 9], [800, 3], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [600, 601, 2, 77])
NEW_TOKENS = 12

MODES = {
    "resident": RuntimeConfig(mode="resident"),
    "paged-k4": RuntimeConfig(mode="paged", resident_experts=4),  # K = top_k: several waves per step
    "paged-k12": RuntimeConfig(mode="paged", resident_experts=12),
    "offload": RuntimeConfig(mode="offload"),
    "cpu-experts": RuntimeConfig(mode="cpu-experts", cpu_expert_layers=2),
}


@pytest.fixture(scope="module")
def tiny_dir() -> Path:
    return Path(ensure_tiny())


def build(tiny_dir: Path, runtime: RuntimeConfig, chunked_prefill_tokens: int = 2048) -> Engine:
    model = MoeCausalLM.from_pretrained(tiny_dir, runtime)
    pool = KvPool.for_model(model, capacity_tokens=512)
    config = EngineConfig(max_running_requests=8, chunked_prefill_tokens=chunked_prefill_tokens)
    return Engine(model, pool, lambda seq, ids, pos, all_logits: SeqChunk(seq, ids, pos, all_logits), config)


async def generate(engine: Engine, prompts: tuple[list[int], ...], params: SamplingParams) -> list[list[int]]:
    task = asyncio.create_task(engine.run())
    try:
        streams = [engine.submit(f"r{i}", p, params) for i, p in enumerate(prompts)]

        async def tokens(stream) -> list[int]:
            return [t async for e in stream for t in e.new_token_ids]

        return list(await asyncio.gather(*(tokens(s) for s in streams)))
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


GREEDY = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def alone(tiny_dir: Path) -> list[list[int]]:
    engine = build(tiny_dir, MODES["resident"])
    return [asyncio.run(generate(engine, (p,), GREEDY))[0] for p in PROMPTS]


@pytest.mark.parametrize("mode", sorted(MODES))
async def test_batched_greedy_equals_alone_in_every_mode(tiny_dir: Path, alone: list[list[int]], mode: str) -> None:
    # a small prefill chunk also mixes prompt chunks with other requests' decode tokens
    engine = build(tiny_dir, MODES[mode], chunked_prefill_tokens=6)
    batched = await generate(engine, PROMPTS, GREEDY)
    assert batched == alone
    assert all(len(t) == NEW_TOKENS for t in batched)
    # they really ran together: 4 requests alone would take at least 4 x 12 steps
    assert engine.steps <= NEW_TOKENS + 6


async def test_generated_logprobs_equal_prompt_logprobs_of_the_same_text(tiny_dir: Path) -> None:
    engine = build(tiny_dir, MODES["resident"])
    prompt = list(PROMPTS[0])
    task = asyncio.create_task(engine.run())
    try:
        events = [
            e async for e in engine.submit("gen", prompt, SamplingParams(max_tokens=6, ignore_eos=True, logprobs=3))
        ]
        generated = [lp for e in events for lp in e.new_logprobs]
        full = prompt + [lp.token_id for lp in generated]
        scored = [e async for e in engine.submit("score", full, SamplingParams(max_tokens=1, prompt_logprobs=3))]
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    prompt_lps = scored[0].prompt_logprobs
    assert prompt_lps is not None and len(prompt_lps) == len(full) and prompt_lps[0] is None
    for gen, entry in zip(generated, prompt_lps[len(prompt) :]):
        assert entry is not None and entry.token_id == gen.token_id
        assert math.isclose(entry.logprob, gen.logprob, abs_tol=1e-4)
        assert [t for t, _ in entry.top] == [t for t, _ in gen.top]
        assert gen.top[0][0] == gen.token_id  # greedy picks the top token


async def run_streams(engine: Engine, prompts: tuple[list[int], ...], params: SamplingParams) -> list[dict]:
    """Every request's timings once it ended (generation.engine_timings, as the server's last chunk has them)."""
    task = asyncio.create_task(engine.run())
    try:
        streams = [engine.submit(f"t{i}", p, params) for i, p in enumerate(prompts)]

        async def drain(stream) -> None:
            async for _ in stream:
                pass

        await asyncio.gather(*(drain(s) for s in streams))
        return [engine_timings(s, len(p)) for s, p in zip(streams, prompts)]
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


@pytest.mark.parametrize("mode", ["paged-k4", "resident"])
async def test_each_request_carries_the_host_side_of_its_own_prefill_steps(tiny_dir: Path, mode: str) -> None:
    layers = MoeCausalLM.from_pretrained(tiny_dir, MODES[mode]).config.num_layers
    paged_layers = layers if mode.startswith("paged") else 0  # resident layers are not host-planned
    # alone, in chunks of 6: the 11-token prompt takes two steps, none shared
    engine = build(tiny_dir, MODES[mode], chunked_prefill_tokens=6)
    (alone,) = await run_streams(engine, (PROMPTS[2],), SamplingParams(max_tokens=3, ignore_eos=True))
    assert alone["prefill_steps"] == 2 and alone["prefill_shared_steps"] == 0
    assert alone["prefill_layer_steps"] == 2 * paged_layers
    host_ms = alone["prefill_host_wait_ms"] + alone["prefill_host_plan_ms"] + alone["prefill_router_ms"]
    assert 0 < alone["prefill_issue_ms"] <= alone["prompt_ms"]  # issued inside the time to its first token
    assert host_ms <= alone["prefill_issue_ms"]  # the paged layers' host time is part of the step's issue
    assert 0 < alone["prefill_issue_cpu_ms"] <= alone["prefill_issue_ms"] + 1  # the engine thread's CPU time
    if sys.platform.startswith("linux"):  # the rest of it: queued for a CPU, switches, and where it ran
        off_cpu_ms = alone["prefill_issue_ms"] - alone["prefill_issue_cpu_ms"]
        assert 0 <= alone["prefill_issue_run_delay_ms"] <= off_cpu_ms + 1
        assert alone["prefill_issue_voluntary_switches"] >= 0 and alone["prefill_issue_involuntary_switches"] >= 0
        assert alone["prefill_cpu_id_first"] >= 0 and alone["prefill_cpu_id_last"] >= 0
    assert (alone["prefill_host_plan_ms"] > 0) == (paged_layers > 0)
    # two prompts in one step (a budget that takes both whole): the step's figures go to each, said shared
    engine = build(tiny_dir, MODES[mode], chunked_prefill_tokens=64)
    both = await run_streams(engine, (PROMPTS[0], PROMPTS[2]), SamplingParams(max_tokens=3, ignore_eos=True))
    assert [t["prefill_steps"] for t in both] == [1, 1] and [t["prefill_shared_steps"] for t in both] == [1, 1]
    assert both[0]["prefill_issue_ms"] == both[1]["prefill_issue_ms"]
    assert [t["prefill_layer_steps"] for t in both] == [paged_layers, paged_layers]


async def test_a_step_gives_its_prefill_figures_to_the_prompt_chunks_it_ran_not_to_the_decode_tokens(
    tiny_dir: Path,
) -> None:
    layouts: list[list[tuple[str, int]]] = []
    submitted = threading.Event()

    def hold(layout: list[tuple[str, int]]) -> None:  # the engine thread, before each step
        layouts.append(layout)
        if layout == [("a", 1)]:  # a decodes: wait until b has arrived, so b's prompt joins a's next decode step
            submitted.wait(timeout=30)

    model = MoeCausalLM.from_pretrained(tiny_dir, MODES["paged-k4"])
    pool = KvPool.for_model(model, capacity_tokens=512)
    engine = Engine(model, pool, lambda seq, ids, pos, all_logits: SeqChunk(seq, ids, pos, all_logits),
                    EngineConfig(max_running_requests=8), step_hooks=[hold])  # fmt: skip
    task = asyncio.create_task(engine.run())
    try:
        decoding = engine.submit("a", PROMPTS[0], SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
        assert (await decoding.__anext__()).new_token_ids  # a's prompt ran; a decodes from here on
        arriving = engine.submit("b", PROMPTS[2], SamplingParams(max_tokens=2, ignore_eos=True))
        submitted.set()
        outputs = [e async for e in decoding], [e async for e in arriving]
        assert sum(len(e.new_token_ids) for e in outputs[0]) == NEW_TOKENS - 1
        a, b = engine_timings(decoding, len(PROMPTS[0])), engine_timings(arriving, len(PROMPTS[2]))
    finally:
        submitted.set()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert [("a", 1), ("b", len(PROMPTS[2]))] in layouts  # b's prompt ran beside a's decode token
    # that step's figures are b's alone; a keeps its own prompt's one step, shared with no other prompt
    assert (a["prefill_steps"], b["prefill_steps"]) == (1, 1)
    assert a["prefill_shared_steps"] == b["prefill_shared_steps"] == 0


async def test_a_one_token_prompt_has_no_prefill_step(tiny_dir: Path) -> None:
    engine = build(tiny_dir, MODES["paged-k4"])
    (timings,) = await run_streams(engine, ([77],), SamplingParams(max_tokens=2, ignore_eos=True))
    assert timings["predicted_n"] == 2 and not any(key.startswith("prefill_") for key in timings)
