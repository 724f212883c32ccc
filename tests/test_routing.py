"""Synthetic routing: spec parsing, per-stream reuse, the Router contract, and the calibrated
qwen3-30b-a3b preset's LRU curve against DESIGN.md section 8 (replayed through residency)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from benchsuite.tools.simulate import SimOptions, simulate
from paged_experts.routing.sources import RoutingProcess, make_router, synth_stream
from paged_experts.routing.specs import QWEN3_30B_A3B, RoutingParams, parse_spec, routing_label
from paged_experts.routing.trace import synthesize_trace

PUBLISHED_LRU = {8: 0.424, 16: 0.647, 32: 0.810, 64: 0.918}
PUBLISHED_OVERLAP = 0.427


def overlap(ids: np.ndarray) -> np.ndarray:
    """[L] share of each token's experts also routed to its predecessor. ids: [N, L, k]."""
    return (ids[1:, :, :, None] == ids[:-1, :, None, :]).any(axis=3).mean(axis=(0, 2))


def test_parse_spec() -> None:
    assert parse_spec("uniform") == RoutingParams()
    assert parse_spec("zipf:1.2") == RoutingParams(zipf_s=1.2)
    assert parse_spec("reuse:0.4") == RoutingParams(keep_prob=0.4)
    assert parse_spec("reuse:0.4,zipf:0.8") == RoutingParams(keep_prob=0.4, zipf_s=0.8)
    assert parse_spec("Qwen3-30B-A3B") is QWEN3_30B_A3B
    for bad in ("reuse:1.5", "zipf", "lognormal:1", "zipf:-1"):
        with pytest.raises(ValueError):
            parse_spec(bad)
    assert routing_label("zipf:1.2") == "synthetic:zipf:1.2"


def test_rows_are_distinct_and_in_range() -> None:
    ids = synth_stream(RoutingProcess(3, 16, 4, parse_spec("qwen3-30b-a3b"), seed=1), 200)  # [200, 3, 4]
    assert ids.min() >= 0 and ids.max() < 16
    assert all(len(set(row)) == 4 for row in ids.reshape(-1, 4).tolist())


def test_uniform_zipf_and_reuse_strength() -> None:
    uniform = synth_stream(RoutingProcess(2, 64, 4, parse_spec("uniform"), 0), 2000)
    counts = np.bincount(uniform.ravel(), minlength=64)
    assert counts.max() / counts.mean() < 1.3
    assert overlap(uniform).mean() == pytest.approx(4 / 64, abs=0.015)
    zipf = synth_stream(RoutingProcess(2, 64, 4, parse_spec("zipf:1.2"), 0), 2000)
    assert np.sort(np.bincount(zipf.ravel(), minlength=64))[-1] > 4 * counts.mean()
    low = overlap(synth_stream(RoutingProcess(2, 64, 4, parse_spec("reuse:0.2"), 0), 2000)).mean()
    high = overlap(synth_stream(RoutingProcess(2, 64, 4, parse_spec("reuse:0.7"), 0), 2000)).mean()
    assert low == pytest.approx(0.2 + 0.8 * 3.2 / 60, abs=0.03)  # kept + chance among the others
    assert high > low + 0.4
    assert overlap(synth_stream(RoutingProcess(1, 64, 4, parse_spec("reuse:1.0"), 0), 50)).min() == 1.0


def test_router_contract_draws_per_sequence_and_position() -> None:
    """Also: a step's ids for every layer are drawn once (the graphed decode step draws them itself)."""
    config = SimpleNamespace(num_layers=2, num_experts=32, top_k=4)  # the runtime's MoeModelConfig names
    router = make_router("reuse:1.0", config, seed=0)
    assert router.label == "synthetic:reuse:1.0"
    logits = torch.randn(3, 32)
    ctx = SimpleNamespace(seq_ids=(7, 7, 9), positions=(0, 1, 0))  # prefill of 7 (2 tokens) + start of 9
    planned, weights = router(0, logits, ctx)
    ids = planned.host
    assert ids.shape == (3, 4) and ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert torch.equal(planned.device, ids)  # the model's device: the CPU here
    assert torch.allclose(weights.sum(dim=1), torch.ones(3))
    assert set(ids[0].tolist()) == set(ids[1].tolist())  # token 1 keeps token 0's experts (p = 1)
    assert set(ids[0].tolist()) != set(ids[2].tolist())  # another request, other experts
    step2 = router(0, torch.randn(2, 32), SimpleNamespace(seq_ids=(9, 7), positions=(1, 2)))[0].host
    assert set(step2[0].tolist()) == set(ids[2].tolist()) and set(step2[1].tolist()) == set(ids[1].tolist())
    # requests are ordinals, not pool ids: another router fed the same requests under other
    # sequence ids, one at a time, draws the same experts
    other = make_router("reuse:1.0", config, seed=0)
    alone = [other(0, torch.randn(2, 32), SimpleNamespace(seq_ids=(40, 40), positions=(0, 1)))[0].host]
    alone.append(other(0, torch.randn(1, 32), SimpleNamespace(seq_ids=(41,), positions=(0,)))[0].host)
    assert torch.equal(torch.cat(alone), ids)
    router.forget(7)  # a finished sequence: its id seen again is a new request
    assert router.request_ids([7, 9], [5, 2]) == [2, 1]
    assert router.request_ids([9], [0]) == [3]  # position 0 again: a new request
    (restart, _, _), _ = make_router("uniform", {"num_experts": 32, "num_experts_per_tok": 4, "num_hidden_layers": 1})(
        0, torch.randn(1, 32), SimpleNamespace(seq_ids=(1,), positions=(0,))
    )
    assert restart.shape == (1, 4)


def test_router_draws_a_step_once_for_all_layers() -> None:
    router = make_router("qwen3-30b-a3b", SimpleNamespace(num_layers=3, num_experts=32, top_k=4), seed=2)
    ctx = SimpleNamespace(seq_ids=(1, 2), positions=(0, 0))
    per_layer = [router(layer, torch.randn(2, 32), ctx)[0] for layer in range(3)]
    assert torch.equal(torch.stack([p.host for p in per_layer], dim=1), router.step_ids)  # [T, L, k]
    assert all(p.host.is_contiguous() and p.device.is_contiguous() for p in per_layer)  # views of the step's draw
    again = router(0, torch.randn(2, 32), ctx)[0]  # the same step asked again: no new draw
    assert again.host.data_ptr() == per_layer[0].host.data_ptr()
    first = router.plan([5, 6], [0, 0]).clone()  # two new requests
    assert torch.equal(router.plan([5, 6], [0, 0]), first)  # drawn again (another device): the same ordinals
    planned = router.plan([1, 2], [1, 1])  # the next step, drawn whole
    assert planned.shape == (2, 3, 4) and torch.equal(
        router(2, torch.randn(2, 32), SimpleNamespace(seq_ids=(1, 2), positions=(1, 1)))[0].host, planned[:, 2]
    )
    # the graphed step's draw (inputs on the device, no host sync) gives the same ids
    device_ids = router.draw_device(torch.tensor(router.request_ids([1, 2], [1, 1])), torch.tensor([1, 1]))
    assert torch.equal(device_ids, planned)


def test_router_weights_follow_model_logits() -> None:
    router = make_router("uniform", {"num_experts": 8, "top_k": 2, "num_layers": 1})
    logits = torch.randn(4, 8)
    planned, weights = router(0, logits, SimpleNamespace(seq_ids=(0, 1, 2, 3), positions=(0, 0, 0, 0)))
    ids = planned.host
    expected = torch.softmax(torch.gather(logits, 1, ids), dim=-1)
    assert torch.allclose(weights, expected)


def test_calibrated_preset_reproduces_published_lru_curve() -> None:
    """16 layers (the per-layer strength quantiles), one stream, batch 1, replayed by residency."""
    trace = synthesize_trace("qwen3-30b-a3b", 16, 128, 8, requests=1, tokens_per_request=1500, seed=0)
    assert trace.meta.synthetic
    results = simulate(trace, SimOptions(ks=tuple(PUBLISHED_LRU), policies=("lru",), concurrencies=(1,)))
    for r in results:
        assert r.total.hit_rate == pytest.approx(PUBLISHED_LRU[r.k], abs=0.03), r.k
    per_layer = overlap(trace.ids)
    assert per_layer.mean() == pytest.approx(PUBLISHED_OVERLAP, abs=0.03)
    assert per_layer.min() < 0.25 and per_layer.max() > 0.5  # layers differ (published 7.9%-59.7%)


def test_bad_ids_finds_an_id_out_of_range_or_twice_and_the_router_refuses_such_a_draw(monkeypatch) -> None:
    from paged_experts.routing.sources import bad_ids

    good = torch.tensor([[[0, 5, 31], [7, 2, 1]], [[30, 31, 0], [4, 8, 6]]])  # [L, T, k]
    assert not bool(bad_ids(good, 32))
    for layer, token, slot, value in [(0, 0, 1, 32), (1, 1, 0, -1), (1, 0, 2, 30), (0, 1, 0, 1)]:
        bad = good.clone()
        bad[layer, token, slot] = value  # out of range, negative, or an expert its row already has
        assert bool(bad_ids(bad, 32)), (layer, token, slot, value)
    assert not bool(bad_ids(torch.empty(3, 0, 4, dtype=torch.long), 32))  # an empty step
    router = make_router("uniform", {"num_experts": 32, "top_k": 3, "num_layers": 2})
    monkeypatch.setattr(router, "draw_device", lambda req, pos: torch.full((req.shape[0], 2, 3), 5))
    with pytest.raises(RuntimeError, match="outside \\[0, E\\) or one twice"):
        router(0, torch.randn(1, 32), SimpleNamespace(seq_ids=(1,), positions=(0,)))
