"""The counter-based synthetic routing draw (paged_experts.routing.draw): a pure function of (seed,
request, position, layer); distinct, in-range ids; the Triton kernel equal to the torch draw bit for
bit in the interpreter (TRITON_INTERPRET=1, in a child interpreter: Triton reads it at import)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from interpreted import run_interpreted

from paged_experts.routing import draw_triton as routing_triton
from paged_experts.routing.sources import RoutingProcess
from paged_experts.routing.specs import parse_spec

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU torch wheel ships no Triton
    triton = None

if triton is not None and routing_triton.available():

    @triton.jit
    def _count_le_probe(cdf, us, out, N: tl.constexpr, STEPS: tl.constexpr, KP: tl.constexpr):  # pragma: no cover
        lanes = tl.program_id(0) * KP + tl.arange(0, KP)
        tl.store(out + lanes, routing_triton._count_le(cdf, tl.load(us + lanes), N, STEPS))


# (layers, experts, top_k, spec): k not a power of two, E not a power of two, a strong reuse, the preset
DRAW_CASES = ((3, 16, 4, "qwen3-30b-a3b"), (2, 10, 3, "reuse:0.6,recency:0.9,zipf:1.5"), (2, 128, 8, "qwen3-30b-a3b"),
              (1, 8, 8, "zipf:2"))  # fmt: skip


def _inputs(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    requests = torch.randint(0, 1 << 40, (n,), generator=gen)
    positions = torch.cat([torch.arange(n // 2), torch.randint(0, 70000, (n - n // 2,), generator=gen)])
    return requests, positions


def check_triton_draw(device: str = "cpu", n_tokens: int = 8) -> None:
    from paged_experts.routing import draw_triton as routing_triton

    for i, (layers, e, k, spec) in enumerate(DRAW_CASES):
        process = RoutingProcess(layers, e, k, parse_spec(spec), seed=i)
        tables = process.tables.to(device)
        requests, positions = (x.to(device) for x in _inputs(n_tokens, i))
        want = process.draw(requests, positions)
        got = routing_triton.draw(tables, requests, positions)
        assert torch.equal(got.cpu(), want.cpu()), (spec, (got != want).nonzero()[:5].tolist())
        print("ok", (layers, e, k, spec))


def check_count_le() -> None:
    """The kernel's binary search against torch.searchsorted(right=True) (the torch draw's), on CDFs with
    flat stretches, at every CDF value, one below and one above it, and past both ends, for sizes around
    powers of two (its step count is N.bit_length())."""
    gen = torch.Generator().manual_seed(0)
    for n in (1, 2, 3, 7, 8, 9, 63, 64, 65, 127, 128, 129, 511, 512, 513):
        cdf = torch.randint(0, max(2, n // 2), (n,), generator=gen).sort().values  # repeats: flat stretches
        u = torch.cat([cdf, cdf - 1, cdf + 1, torch.tensor([-1, int(cdf.max()) + 1])])
        u = torch.cat([u, u[: (-u.numel()) % 8]])  # whole programs of 8 lanes
        out = torch.empty_like(u)
        _count_le_probe[(u.numel() // 8,)](cdf, u, out, N=n, STEPS=n.bit_length(), KP=8)
        want = torch.searchsorted(cdf, u, right=True)
        assert torch.equal(out, want), (n, (out != want).nonzero()[:5].tolist())
    print("count_le ok")


def test_count_le_is_searchsorted_in_the_interpreter() -> None:
    pytest.importorskip("triton")
    assert "count_le ok" in run_interpreted("test_routing_draw", "check_count_le")


def test_draws_are_a_pure_function_of_seed_request_position_layer() -> None:
    process = RoutingProcess(4, 32, 4, parse_spec("qwen3-30b-a3b"), seed=3)
    requests, positions = _inputs(64, 0)
    whole = process.draw(requests, positions)  # [64, 4, 4]
    alone = torch.cat([process.draw(requests[i : i + 1], positions[i : i + 1]) for i in range(64)])
    assert torch.equal(whole, alone)  # batch-mates change nothing
    shuffled = torch.randperm(64)
    assert torch.equal(process.draw(requests[shuffled], positions[shuffled]), whole[shuffled])
    other_seed = RoutingProcess(4, 32, 4, parse_spec("qwen3-30b-a3b"), seed=4).draw(requests, positions)
    assert not torch.equal(other_seed, whole)
    ids = whole.numpy()
    assert ids.min() >= 0 and ids.max() < 32
    assert all(len(set(row)) == 4 for row in ids.reshape(-1, 4).tolist())


def test_rows_distinct_even_when_popularity_is_one_expert() -> None:
    """A Zipf so steep that nearly every draw is expert 0: the dedup rounds then the probe still
    give k distinct ids."""
    process = RoutingProcess(2, 12, 6, parse_spec("zipf:3.0,reuse:0.9,recency:1.0"), seed=0)
    ids = process.draw(torch.zeros(300, dtype=torch.long), torch.arange(300)).numpy()
    assert all(len(set(row)) == 6 for row in ids.reshape(-1, 6).tolist())
    assert np.bincount(ids[:, 0].ravel(), minlength=12).argmax() == np.argmax(process.popularity[0])


def test_triton_draw_equals_torch_in_the_interpreter() -> None:
    pytest.importorskip("triton")
    out = run_interpreted("test_routing_draw", "check_triton_draw")
    assert out.count("ok ") == len(DRAW_CASES)
