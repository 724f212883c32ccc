"""Property test: under arbitrary routing (a router override drawn by hypothesis), paged equals
resident bit for bit at several K, while the paged models carry residency state from example to
example (any slot state must give the same result)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paged_experts.kv import KvPool
from paged_experts.model import MoeCausalLM, SeqChunk
from paged_experts.runtime import RuntimeConfig
from paged_experts.weights.synth import write_checkpoint

KS = (4, 5, 9, 17, 31)
NUM_EXPERTS, TOP_K, NUM_LAYERS = 32, 4, 4


pytestmark = pytest.mark.usefixtures("torch_one_thread")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[int, MoeCausalLM]:
    ckpt = write_checkpoint("tiny", tmp_path_factory.mktemp("tiny") / "ckpt", seed=7)
    out = {0: MoeCausalLM.from_pretrained(ckpt, RuntimeConfig(mode="resident"))}
    for k in KS:
        out[k] = MoeCausalLM.from_pretrained(ckpt, RuntimeConfig(mode="paged", resident_experts=k))
    return out


@st.composite
def steps(draw: st.DrawFn) -> tuple[list[list[int]], dict[int, list[list[int]]]]:
    """Prompts of 1-3 sequences and, per layer, each token's top_k distinct experts."""
    lengths = draw(st.lists(st.integers(1, 6), min_size=1, max_size=3))
    prompts = [draw(st.lists(st.integers(0, 1000), min_size=n, max_size=n)) for n in lengths]
    tokens = sum(lengths)
    expert_sets = st.lists(st.integers(0, NUM_EXPERTS - 1), min_size=TOP_K, max_size=TOP_K, unique=True)
    routing = {layer: draw(st.lists(expert_sets, min_size=tokens, max_size=tokens)) for layer in range(NUM_LAYERS)}
    return prompts, routing


def run(model: MoeCausalLM, prompts: list[list[int]], routing: dict[int, list[list[int]]]) -> list[torch.Tensor]:
    def override(layer: int, logits: torch.Tensor, ctx: object) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.tensor(routing[layer], dtype=torch.long)  # [T, k]
        weights = torch.softmax(logits.gather(1, ids).float(), dim=-1)  # [T, k] depends on the input
        return ids, weights

    model.router_override = override
    pool = KvPool.for_model(model, 64)
    return model.forward([SeqChunk(pool.new_sequence(), p, 0, all_logits=True) for p in prompts])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps())
def test_paged_equals_resident_under_random_routing(models: dict[int, MoeCausalLM], step: tuple) -> None:
    prompts, routing = step
    reference = run(models[0], prompts, routing)
    for k in KS:
        before = models[k].counters.snapshot()
        for a, b in zip(run(models[k], prompts, routing), reference):
            assert torch.equal(a, b), f"K={k}"
        after = models[k].counters.snapshot()
        union = [len({e for row in routing[layer] for e in row}) for layer in range(NUM_LAYERS)]
        for u, a, b in zip(union, after.layers, before.layers):  # one wave when the union fits K, else several
            assert (a.waves - b.waves == 1) if u <= k else (a.waves - b.waves >= 2)
        assert after.total.activations - before.total.activations == sum(union)
