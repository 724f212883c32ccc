"""Outside oracle: our logits match transformers' Qwen3MoeForCausalLM on the same generated checkpoint
(fp32, eager attention), for a full prompt and for incremental decode through our KV pool."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from paged_experts.kv import KvPool
from paged_experts.model import MoeCausalLM, SeqChunk
from paged_experts.runtime import RuntimeConfig
from paged_experts.weights.synth import write_checkpoint

transformers = pytest.importorskip("transformers")

TOL = {"rtol": 1e-4, "atol": 1e-4}
TOKENS = [17, 4, 250, 250, 1001, 3, 64, 512, 9, 77, 300, 12, 8, 640, 2, 99]


pytestmark = pytest.mark.usefixtures("torch_one_thread")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint("tiny", tmp_path_factory.mktemp("tiny") / "ckpt", seed=11)


@pytest.fixture(scope="module")
def hf_logits(ckpt: Path) -> torch.Tensor:
    hf = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32, attn_implementation="eager")
    assert type(hf).__name__ == "Qwen3MoeForCausalLM"
    with torch.no_grad():
        return hf(torch.tensor([TOKENS])).logits[0].float()  # [n, V]


@pytest.mark.parametrize("runtime", [RuntimeConfig(mode="resident"), RuntimeConfig(mode="paged", resident_experts=4)])
def test_full_prompt_matches_transformers(ckpt: Path, hf_logits: torch.Tensor, runtime: RuntimeConfig) -> None:
    model = MoeCausalLM.from_pretrained(ckpt, runtime)
    seq = KvPool.for_model(model, 64).new_sequence()
    ours = model.forward([SeqChunk(seq, TOKENS, 0, all_logits=True)])[0]
    # Logits have std ~16 here, so 1e-4 is a tight bound; a wrong norm, RoPE or routing is off by >0.1.
    torch.testing.assert_close(ours, hf_logits, **TOL)
    assert torch.equal(ours.argmax(-1), hf_logits.argmax(-1))


def test_incremental_decode_matches_transformers(ckpt: Path, hf_logits: torch.Tensor) -> None:
    model = MoeCausalLM.from_pretrained(ckpt, RuntimeConfig(mode="paged", resident_experts=6))
    seq = KvPool.for_model(model, 64, block_size=4).new_sequence()
    rows = [model.forward([SeqChunk(seq, TOKENS[:5], 0, all_logits=True)])[0]]
    rows += [model.forward([SeqChunk(seq, [t], i)])[0] for i, t in enumerate(TOKENS[5:], start=5)]
    torch.testing.assert_close(torch.cat(rows), hf_logits, **TOL)


def test_logits_are_peaked(hf_logits: torch.Tensor) -> None:
    """The synth init must give confident greedy choices, not near-uniform logits."""
    top2 = hf_logits.topk(2, dim=-1).values  # [n, 2]
    assert hf_logits.std() > 8.0
    assert float((top2[:, 0] - top2[:, 1]).median()) > 1.0
