"""Model and KV pool behaviour: ragged batches, chunked prefill, incremental decode, block isolation,
capacity accounting in tokens, sharded loading."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from paged_experts.config import MoeModelConfig
from paged_experts.kv import KvCapacityError, KvPool
from paged_experts.model import MoeCausalLM, SeqChunk
from paged_experts.runtime import RuntimeConfig
from paged_experts.weights.synth import write_checkpoint

TOL = {"rtol": 1e-4, "atol": 1e-4}


pytestmark = pytest.mark.usefixtures("torch_one_thread")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint("tiny", tmp_path_factory.mktemp("tiny") / "ckpt", seed=5)


@pytest.fixture(scope="module")
def model(ckpt: Path) -> MoeCausalLM:
    return MoeCausalLM.from_pretrained(ckpt, RuntimeConfig(mode="paged", resident_experts=8))


def full_logits(model: MoeCausalLM, tokens: list[int]) -> torch.Tensor:
    pool = KvPool.for_model(model, 128)
    seq = pool.new_sequence()
    return model.forward([SeqChunk(seq, tokens, 0, all_logits=True)])[0]


def test_output_shapes_and_dtype(model: MoeCausalLM) -> None:
    pool = KvPool.for_model(model, 64)
    a, b = pool.new_sequence(), pool.new_sequence()
    out = model.forward([SeqChunk(a, [1, 2, 3], 0, all_logits=True), SeqChunk(b, [4, 5], 0)])
    v = model.config.vocab_size
    assert out[0].shape == (3, v) and out[1].shape == (1, v)
    assert all(o.dtype == torch.float32 and o.device.type == "cpu" for o in out)
    assert a.num_tokens == 3 and b.num_tokens == 2


def test_ragged_batch_equals_sequences_alone(model: MoeCausalLM) -> None:
    prompts = [[3, 4, 5, 6, 7], [100, 200], [9, 8, 7, 6, 5, 4, 3, 2, 1]]
    alone = [full_logits(model, p) for p in prompts]
    pool = KvPool.for_model(model, 128)
    seqs = [pool.new_sequence() for _ in prompts]
    batched = model.forward([SeqChunk(s, p, 0, all_logits=True) for s, p in zip(seqs, prompts)])
    for a, b in zip(alone, batched):
        torch.testing.assert_close(a, b, **TOL)


def test_chunked_prefill_and_decode_equal_one_shot(model: MoeCausalLM) -> None:
    tokens = [11, 22, 33, 44, 55, 66, 77, 88, 99, 111, 222, 333, 444, 555, 666, 777, 888, 999]
    ref = full_logits(model, tokens)  # [n, V]
    pool = KvPool.for_model(model, 32, block_size=4)
    seq = pool.new_sequence()
    got = [model.forward([SeqChunk(seq, tokens[:7], 0, all_logits=True)])[0]]
    got.append(model.forward([SeqChunk(seq, tokens[7:13], 7, all_logits=True)])[0])
    for i in range(13, len(tokens)):
        got.append(model.forward([SeqChunk(seq, [tokens[i]], i)])[0])
    torch.testing.assert_close(torch.cat(got), ref, **TOL)
    assert pool.used_tokens == 20  # 18 tokens in blocks of 4


def test_sequences_never_read_other_blocks(model: MoeCausalLM) -> None:
    """A new sequence reusing a freed sequence's blocks, next to a live neighbour, sees only its own K/V."""
    pool = KvPool.for_model(model, 32, block_size=4)
    a, b = pool.new_sequence(), pool.new_sequence()
    model.forward([SeqChunk(a, [500] * 12, 0), SeqChunk(b, [600] * 8, 0)])
    freed_blocks = set(a.blocks)
    pool.free(a)
    c = pool.new_sequence()
    out = model.forward([SeqChunk(c, [1, 2, 3, 4, 5], 0, all_logits=True), SeqChunk(b, [7], 8)])
    assert set(c.blocks) <= freed_blocks and not set(c.blocks) & set(b.blocks)
    torch.testing.assert_close(out[0], full_logits(model, [1, 2, 3, 4, 5]), **TOL)
    torch.testing.assert_close(out[1], full_logits(model, [600] * 8 + [7])[-1:], **TOL)


def test_capacity_is_counted_in_tokens(model: MoeCausalLM) -> None:
    pool = KvPool.for_model(model, 32, block_size=8)
    assert (pool.capacity_tokens, pool.free_tokens, pool.used_tokens) == (32, 32, 0)
    a, b = pool.new_sequence(), pool.new_sequence()
    assert pool.can_fit(a, 32) and not pool.can_fit(a, 33)
    model.forward([SeqChunk(a, list(range(1, 18)), 0)])  # 17 tokens -> 3 blocks
    assert pool.used_tokens == 24 and pool.free_tokens == 8
    assert pool.can_fit(a, 15) and not pool.can_fit(a, 16)  # 7 fit in its own blocks, 8 more in the free one
    assert pool.can_fit(b, 8) and not pool.can_fit(b, 9)
    with pytest.raises(KvCapacityError, match="free"):
        model.forward([SeqChunk(b, list(range(1, 10)), 0)])
    assert b.blocks == [] and pool.free_tokens == 8  # a failed step reserves nothing
    with pytest.raises(KvCapacityError):  # together they need 2 blocks, only 1 is free
        model.forward([SeqChunk(a, list(range(8)), 17), SeqChunk(b, [1], 0)])
    assert a.num_tokens == 17 and b.blocks == []
    pool.free(a)
    assert pool.free_tokens == 32
    with pytest.raises(ValueError, match="freed"):
        pool.can_fit(a, 1)


def test_bad_chunks_are_rejected(model: MoeCausalLM) -> None:
    pool = KvPool.for_model(model, 32)
    seq = pool.new_sequence()
    with pytest.raises(ValueError, match="gap"):
        model.forward([SeqChunk(seq, [1], 3)])
    with pytest.raises(ValueError, match="vocabulary"):
        model.forward([SeqChunk(seq, [model.config.vocab_size], 0)])
    with pytest.raises(ValueError, match="two chunks"):
        model.forward([SeqChunk(seq, [1], 0), SeqChunk(seq, [2], 1)])
    with pytest.raises(ValueError, match="multiple of block_size"):
        KvPool.for_model(model, 30, block_size=16)


def test_sharded_checkpoint_loads_identically(ckpt: Path, tmp_path: Path) -> None:
    sharded = write_checkpoint("tiny", tmp_path / "sharded", seed=5, max_shard_bytes=600_000)
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("model-*-of-*.safetensors"))) > 2
    tokens = [5, 6, 7, 8]
    rt = RuntimeConfig(mode="resident")
    a = full_logits(MoeCausalLM.from_pretrained(ckpt, rt), tokens)
    b = full_logits(MoeCausalLM.from_pretrained(sharded, rt), tokens)
    assert torch.equal(a, b)


def test_config_reads_qwen3_fields(ckpt: Path) -> None:
    cfg = MoeModelConfig.from_dir(ckpt)
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_experts, cfg.top_k) == (4, 64, 32, 4)
    assert cfg.norm_topk_prob and cfg.num_kv_heads == 2 and cfg.head_dim == 16
    assert cfg.expert_bytes("bfloat16") == 3 * 64 * 32 * 2
    assert cfg.slot_bytes("bfloat16") == 4 * cfg.expert_bytes("bfloat16")
    assert cfg.kv_bytes_per_token("bfloat16") == 2 * 4 * 2 * 16 * 2
    qwen = {
        "model_type": "qwen3_moe",
        "vocab_size": 151936,
        "hidden_size": 2048,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "moe_intermediate_size": 768,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "torch_dtype": "bfloat16",
    }
    big = MoeModelConfig.from_hf_config(qwen)
    assert big.kv_bytes_per_token("bfloat16") == 98_304  # DESIGN.md section 3
    assert big.expert_bytes("bfloat16") == 3 * 2048 * 768 * 2
    with pytest.raises(ValueError, match="unsupported model_type"):
        MoeModelConfig.from_hf_config({**qwen, "model_type": "llama"})
    with pytest.raises(ValueError, match="dense MLP layers"):
        MoeModelConfig.from_hf_config({**qwen, "mlp_only_layers": [0]})


def test_fused_expert_layout_loads_identically(ckpt: Path, tmp_path: Path) -> None:
    """transformers 5 may save experts fused (`gate_up_proj [E, 2I, H]`); both layouts load the same."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    cfg = MoeModelConfig.from_dir(ckpt)
    fused_dir = tmp_path / "fused"
    fused_dir.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (fused_dir / name).write_bytes((ckpt / name).read_bytes())
    tensors: dict[str, torch.Tensor] = {}
    with safe_open(str(ckpt / "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            if ".mlp.experts." not in name:
                tensors[name] = f.get_tensor(name)
        for layer in range(cfg.num_layers):
            p = f"model.layers.{layer}.mlp.experts"
            gate = torch.stack([f.get_tensor(f"{p}.{e}.gate_proj.weight") for e in range(cfg.num_experts)])  # [E, I, H]
            up = torch.stack([f.get_tensor(f"{p}.{e}.up_proj.weight") for e in range(cfg.num_experts)])  # [E, I, H]
            tensors[f"{p}.gate_up_proj"] = torch.cat([gate, up], dim=1).contiguous()  # [E, 2I, H]
            tensors[f"{p}.down_proj"] = torch.stack(
                [f.get_tensor(f"{p}.{e}.down_proj.weight") for e in range(cfg.num_experts)]
            )  # [E, H, I]
    save_file(tensors, str(fused_dir / "model.safetensors"))
    rt = RuntimeConfig(mode="paged", resident_experts=5)
    tokens = [9, 99, 999, 19, 29]
    a = full_logits(MoeCausalLM.from_pretrained(ckpt, rt), tokens)
    b = full_logits(MoeCausalLM.from_pretrained(fused_dir, rt), tokens)
    assert torch.equal(a, b)


def test_shape_mismatch_is_a_clear_error(ckpt: Path, tmp_path: Path) -> None:
    import json

    bad = tmp_path / "bad"
    bad.mkdir()
    for f in ckpt.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    hf = json.loads((ckpt / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**hf, "moe_intermediate_size": 1}))
    with pytest.raises(ValueError, match=r"gate_proj.weight has shape \(32, 64\), config.json implies \(1, 64\)"):
        MoeCausalLM.from_pretrained(bad, RuntimeConfig(mode="resident"))
