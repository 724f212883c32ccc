"""Paging simulator: regrouping, hand-computed counts, policy bounds, speed model, CLI labels, and
equality with the runtime's own counters on the same routing."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from benchsuite.cli import main as cli_main
from benchsuite.tools.simulate import SimOptions, batched_steps, simulate
from paged_experts.routing.trace import TraceMeta, TraceWriter, build_trace, read_trace, synthesize_trace


def _trace(layouts: list[list[tuple[str, int]]], ids: list[list[int]], num_experts: int, top_k: int):
    arr = np.array(ids, dtype=np.int64).reshape(-1, 1, top_k)  # one layer
    meta = TraceMeta(num_layers=1, num_experts=num_experts, top_k=top_k, source="model")
    return build_trace(meta, layouts, arr, None)


def test_batched_steps_closed_loop() -> None:
    layouts = [[("a", 3)], [("a", 1)], [("a", 1)], [("b", 1)], [("c", 1)], [("c", 1)], [("c", 1)]]
    trace = _trace(layouts, [[0]] * 9, 4, 1)
    names = lambda steps: [[c.request for c in s] for s in steps]  # noqa: E731
    assert names(batched_steps(trace, 2, include_prefill=False)) == [["a", "b"], ["a", "c"], ["c"], ["c"]]
    assert names(batched_steps(trace, 1, include_prefill=True)) == [["a"]] * 3 + [["b"]] + [["c"]] * 3
    assert [[c.num_tokens for c in s] for s in batched_steps(trace, 0, include_prefill=True)][0] == [3]
    assert len(batched_steps(trace, 0, include_prefill=False)) == 6


def test_hand_computed_lru_and_belady() -> None:
    # E=6, top_k=2, K=3: slots start with experts 0, 1, 2
    trace = _trace([[("r", 1)]] * 5, [[0, 1], [2, 3], [0, 2], [3, 2], [1, 0]], 6, 2)
    lru, belady = simulate(trace, SimOptions(ks=(3,), policies=("lru", "belady"), expert_bytes=10.0))
    # LRU: [0,1] 2 hits; [2,3] 3 misses, evicts 0 (tie with 1, lowest id); [0,2] 0 misses, evicts 1;
    # [3,2] 2 hits; [1,0] 1 misses, evicts 2 (tie with 3)
    assert (lru.total.hits, lru.total.misses) == (7, 3)
    assert lru.bytes_per_token == pytest.approx(3 * 10.0 / 5)
    # Belady evicts 1 at step 2 (next used at step 4, after 0): only [2,3] and [1,0] miss
    assert (belady.total.hits, belady.total.misses) == (8, 2)
    assert lru.total.waves_per_step == 1.0 and lru.total.union_per_step == 2.0


def test_waves_union_and_speed_model() -> None:
    # two requests with disjoint experts; batched together the union (4) exceeds K=2: waves of
    # (K - protected) // 2 experts, so that each wave's page-in copies while the previous one computes:
    # step 1 nothing protected, 4 waves of 1; step 2 keeps expert 3 (the latest of the top 2) in place:
    # waves [3, 2], [0], [1]
    layouts = [[("a", 1)], [("a", 1)], [("b", 1)], [("b", 1)]]
    trace = _trace(layouts, [[0, 1], [0, 1], [2, 3], [2, 3]], 8, 2)
    opts = SimOptions(ks=(2,), concurrencies=(1, 2), expert_bytes=1e6, link_b_per_s=1e9, compute_s_per_step=1e-3)
    single, batched = simulate(trace, opts)
    assert single.total.waves_per_step == 1.0 and single.total.misses == 2
    assert batched.total.steps == 2 and batched.total.union_per_step == 4.0 and batched.total.waves == 7
    # batched: each step serves its 2 resident experts first, then pages the other 2 (2 ms each)
    assert (batched.total.hits, batched.total.misses) == (4, 4)
    assert batched.predicted_tok_per_s == pytest.approx(4 / 4e-3)
    # single: steps miss 0, 0, 2, 0 -> 1 + 1 + 2 + 1 ms for 4 tokens
    assert single.predicted_tok_per_s == pytest.approx(4 / 5e-3)
    assert simulate(trace, SimOptions(ks=(2,), expert_bytes=1e6))[0].predicted_tok_per_s is None


@pytest.mark.parametrize("seed", range(4))
def test_belady_bounds_online_policies(seed: int) -> None:
    trace = synthesize_trace("reuse:0.3,zipf:0.8", 2, 32, 4, requests=3, tokens_per_request=60, seed=seed)
    results = simulate(
        trace, SimOptions(ks=(4, 8, 16), policies=("lru", "lfu", "random", "belady"), concurrencies=(1, 3))
    )
    for r in results:
        assert r.total.hits + r.total.misses == sum(s.union for s in r.layers)
        best = next(b for b in results if (b.policy, b.k, b.concurrency) == ("belady", r.k, r.concurrency))
        assert best.total.misses <= r.total.misses


def test_cli_labels_synthetic(tmp_path: Path, capsys) -> None:
    path = tmp_path / "s.trace"
    assert cli_main(["trace", "synth", "--preset", "qwen3-30b-a3b", "--tokens", "30", "--requests", "4",
                     "--layers", "2", "-o", str(path)]) == 0  # fmt: skip
    capsys.readouterr()
    argv = ["simulate", str(path), "--k", "8,16", "--policy", "lru,belady", "--concurrency", "1,4",
            "--link-gbps", "50", "--compute-ms-per-token", "4.9"]  # fmt: skip
    assert cli_main(argv) == 0
    table = capsys.readouterr().out
    assert table.startswith("SYNTHETIC routing (synthetic:qwen3-30b-a3b)") and "max(compute_ms_per_step" in table
    assert cli_main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["synthetic"] is True and len(out["results"]) == 8
    assert all(r["predicted_tok_per_s"] > 0 and len(r["layers"]) == 2 for r in out["results"])
    assert cli_main(["simulate", str(path), "--k", "4"]) == 2  # K < top_k
    assert cli_main(["simulate", str(path), "--policy", "fifo"]) == 2


# ------------------------------------------------------------ equality with the runtime


@pytest.mark.parametrize(("routing", "keep"), [(None, "recent"), ("reuse:0.5", "recent"), ("reuse:0.5", "lru")])
def test_simulator_counts_equal_runtime_counters(
    tmp_path: Path, torch_one_thread: None, routing: str | None, keep: str
) -> None:
    from paged_experts.kv import KvPool
    from paged_experts.model import MoeCausalLM, SeqChunk
    from paged_experts.routing.sources import make_router
    from paged_experts.runtime import RuntimeConfig
    from paged_experts.weights.synth import write_checkpoint

    k_slots = 8
    ckpt = write_checkpoint("tiny", tmp_path / "ckpt", seed=3)
    runtime_config = RuntimeConfig(mode="paged", resident_experts=k_slots, prefill_residency=keep)
    model = MoeCausalLM.from_pretrained(ckpt, runtime_config)
    if routing is not None:
        model.router_override = make_router(routing, model.config, seed=1)
    writer = TraceWriter(
        tmp_path / "run.trace", model.config, source="model" if routing is None else f"synthetic:{routing}"
    )
    model.routing_observers.append(lambda layer, ids, weights, ctx: writer.observe(layer, ids, weights))
    pool = KvPool.for_model(model, 256)
    seqs = {name: pool.new_sequence() for name in "abc"}
    prompts = {"a": [5, 6, 7, 8, 9], "b": [11, 12, 13], "c": [20, 21, 22, 23]}
    pos = {name: 0 for name in seqs}
    nxt: dict[str, list[int]] = dict(prompts)

    def step(names: list[str]) -> None:
        chunks = [SeqChunk(seqs[n], nxt[n], pos[n]) for n in names]
        writer.begin_step([(n, len(nxt[n])) for n in names])
        for n, logits in zip(names, model.forward(chunks)):
            pos[n] += len(nxt[n])
            nxt[n] = [int(logits[-1].argmax())]

    step(["a", "b"])  # two prefills in one step
    for _ in range(3):
        step(["a", "b"])
    step(["a", "b", "c"])  # c's prefill joins two decodes: union > K, several waves
    for _ in range(4):
        step(["a", "b", "c"])
    writer.close()
    runtime = model.counters.snapshot()
    trace = read_trace(tmp_path / "run.trace")
    (sim,) = simulate(trace, SimOptions(ks=(k_slots,), concurrencies=(0,), include_prefill=True, prefill_keep=(keep,)))
    assert sum(layer.waves for layer in runtime.layers) > len(runtime.layers) * 10  # waves beyond one per step
    assert len(sim.layers) == len(runtime.layers)
    for s, r in zip(sim.layers, runtime.layers):
        assert (s.hits, s.misses, s.waves, s.union, s.steps) == (r.hits, r.misses, r.waves, r.union_sum, r.steps)
    p, q = runtime.prefill, sim.prefill  # the two steps with prompt chunks
    assert q is not None and q.steps == 2 * len(runtime.layers)
    assert (p.steps, p.layer_steps, p.hits, p.misses, p.waves) == (2, q.steps, q.hits, q.misses, q.waves)


def _prefill_then_decode_trace() -> object:
    """E=16, top_k=2: a 12-token prompt over experts 4..15 ending on (5, 4), (7, 6); decode tokens then
    route to (5, 4), (7, 6), (5, 6): what the prompt's last tokens used."""
    prompt = [[4 + (2 * t) % 12, 4 + (2 * t + 1) % 12] for t in range(10)] + [[5, 4], [7, 6]]
    decode = [[5, 4], [7, 6], [5, 6]] * 3
    layouts = [[("r", len(prompt))]] + [[("r", 1)]] * len(decode)
    return _trace(layouts, prompt + decode, 16, 2)


def test_prefill_keep_policies_and_the_decode_split() -> None:
    trace = _prefill_then_decode_trace()
    opts = SimOptions(ks=(4,), include_prefill=True, prefill_keep=("recent", "lru"), early_decode_steps=3)
    recent, lru = simulate(trace, opts)
    assert (recent.prefill_keep, lru.prefill_keep) == ("recent", "lru")
    for r in (recent, lru):
        assert r.prefill is not None and r.decode is not None and r.early is not None
        assert r.prefill.steps == 1 and r.decode.steps == 9 and r.early.steps == 3
        assert r.prefill.misses == 12 and r.prefill.hits == 0  # the same page-ins whatever the policy
        assert r.prefill.hits + r.decode.hits == r.total.hits
    assert recent.decode.misses == 0  # the prompt's last experts stayed
    assert lru.early.misses > 0 and lru.decode.hit_rate < recent.decode.hit_rate


def test_cli_prefill_keep_columns_and_bad_values(tmp_path: Path, capsys) -> None:
    path = tmp_path / "p.trace"
    assert cli_main(["trace", "synth", "--preset", "qwen3-30b-a3b", "--tokens", "8", "--prompt-tokens", "64",
                     "--requests", "2", "--layers", "2", "-o", str(path)]) == 0  # fmt: skip
    capsys.readouterr()
    assert cli_main(["simulate", str(path), "--k", "16", "--include-prefill", "--prefill-keep", "recent,lru"]) == 0
    table = capsys.readouterr().out
    assert "dec hit" in table and "early" in table and "recent" in table and "lru" in table
    assert cli_main(["simulate", str(path), "--include-prefill", "--prefill-keep", "newest"]) == 2
    assert "--prefill-keep" in capsys.readouterr().err


def test_staging_rows_replay_what_the_runtime_stages(tmp_path: Path, capsys) -> None:
    """`simulate --staging-rows N`: every layer but the first serves a large step's first page-ins from N staging
    rows (paged in all the same); decode-only replays and small steps stage nothing; bad values exit 2."""
    path = tmp_path / "p.trace"
    assert cli_main(["trace", "synth", "--preset", "qwen3-30b-a3b", "--tokens", "8", "--prompt-tokens", "256",
                     "--requests", "3", "--layers", "3", "-o", str(path)]) == 0  # fmt: skip
    trace = read_trace(path)
    base = SimOptions(ks=(32,), concurrencies=(1,), include_prefill=True)
    (plain,) = simulate(trace, base)
    (staged,) = simulate(trace, dataclasses.replace(base, staging_rows=16))
    assert plain.layers[0] == staged.layers[0]  # the first layer never stages
    assert staged.prefill is not None and plain.prefill is not None
    assert staged.prefill.misses >= plain.prefill.misses  # staged experts are page-ins, routed or not
    assert any(s.waves != p.waves for s, p in zip(staged.layers[1:], plain.layers[1:]))  # a STAGING wave planned
    decode_only = dataclasses.replace(base, include_prefill=False)
    assert simulate(trace, decode_only) == simulate(trace, dataclasses.replace(decode_only, staging_rows=16))
    with pytest.raises(ValueError, match="exceed the 96 experts outside K=32 slots"):
        simulate(trace, dataclasses.replace(base, staging_rows=97))
    capsys.readouterr()
    assert cli_main(["simulate", str(path), "--k", "32", "--include-prefill", "--staging-rows", "16"]) == 0
    assert "prefill staging rows 16" in capsys.readouterr().out
    assert cli_main(["simulate", str(path), "--include-prefill", "--staging-rows", "-1"]) == 2
    assert "--staging-rows must be in [0, 256]" in capsys.readouterr().err
