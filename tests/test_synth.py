"""Generated checkpoints: HF layout, seeded reproducibility, tokenizer round trip and special tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from tokenizers import Tokenizer

from paged_experts.config import MoeModelConfig
from paged_experts.weights.synth import (
    PRESETS,
    SPECIAL_TOKENS,
    ensure_tiny,
    hf_config_for,
    main,
    train_tokenizer,
    write_checkpoint,
)

FILES = (
    "config.json", "generation_config.json", "model.safetensors", "source_weights.json", "tokenizer.json",
    "tokenizer_config.json",
)  # fmt: skip


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint("tiny", tmp_path_factory.mktemp("a") / "ckpt", seed=1)


@pytest.fixture(scope="module")
def tokenizer(ckpt: Path) -> Tokenizer:
    return Tokenizer.from_file(str(ckpt / "tokenizer.json"))


def test_layout_and_config(ckpt: Path, tokenizer: Tokenizer) -> None:
    assert sorted(p.name for p in ckpt.iterdir()) == sorted(FILES)
    hf = json.loads((ckpt / "config.json").read_text())
    assert hf["model_type"] == "qwen3_moe" and hf["architectures"] == ["Qwen3MoeForCausalLM"]
    assert hf["vocab_size"] == tokenizer.get_vocab_size(with_added_tokens=True)
    assert 1000 <= hf["vocab_size"] <= 2048
    assert hf["bos_token_id"] == tokenizer.token_to_id("<|endoftext|>")
    assert hf["eos_token_id"] == tokenizer.token_to_id("<|im_end|>")
    cfg = MoeModelConfig.from_dir(ckpt)
    assert (cfg.num_layers, cfg.num_experts, cfg.top_k) == (4, 32, 4)
    with safe_open(str(ckpt / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        assert f.get_tensor("model.layers.3.mlp.experts.31.down_proj.weight").shape == (64, 32)
        assert f.get_tensor("model.layers.0.mlp.experts.0.gate_proj.weight").shape == (32, 64)
    assert "model.layers.0.mlp.gate.weight" in names and "lm_head.weight" in names
    assert len([n for n in names if ".mlp.experts." in n]) == 4 * 32 * 3


def test_same_seed_same_bytes_other_seed_other_weights(ckpt: Path, tmp_path: Path) -> None:
    again = write_checkpoint("tiny", tmp_path / "again", seed=1)
    for name in FILES:
        assert (again / name).read_bytes() == (ckpt / name).read_bytes(), name
    other = write_checkpoint("tiny", tmp_path / "other", seed=2)
    assert (other / "model.safetensors").read_bytes() != (ckpt / "model.safetensors").read_bytes()
    assert (other / "tokenizer.json").read_bytes() == (ckpt / "tokenizer.json").read_bytes()


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=200))
def test_any_text_round_trips(text: str) -> None:
    tok = _cached_tokenizer()
    # NFC normalisation is part of the tokenizer (as in Qwen's), so compare normalised text.
    import unicodedata

    assert tok.decode(tok.encode(text).ids, skip_special_tokens=False) == unicodedata.normalize("NFC", text)


_TOK: list[Tokenizer] = []


def _cached_tokenizer() -> Tokenizer:
    if not _TOK:
        _TOK.append(train_tokenizer(PRESETS["tiny"].bpe_vocab_size))
    return _TOK[0]


def test_special_tokens_and_chat_template(ckpt: Path, tokenizer: Tokenizer) -> None:
    learned = tokenizer.get_vocab_size(with_added_tokens=False)
    ids = [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS]
    assert ids == [learned, learned + 1, learned + 2]  # appended after the learned vocabulary
    text = "<|im_start|>user\nHello there, how is the river today?<|im_end|>\n"
    enc = tokenizer.encode(text)
    assert enc.ids[0] == ids[1] and ids[2] in enc.ids
    assert tokenizer.decode(enc.ids, skip_special_tokens=False) == text
    transformers = pytest.importorskip("transformers")
    hf_tok = transformers.AutoTokenizer.from_pretrained(ckpt)
    prompt = hf_tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert hf_tok.eos_token == "<|im_end|>" and hf_tok.decode(hf_tok.encode("the old bridge")) == "the old bridge"


def test_natural_text_compresses(tokenizer: Tokenizer) -> None:
    text = "The farmers sold bread and honey at the market while the river ran past the old town."
    assert len(tokenizer.encode(text).ids) < len(text) / 2.5  # real merges learned, not bytes


def test_layers_and_dtype_overrides_and_cli(tmp_path: Path) -> None:
    assert (
        main(
            ["--preset", "tiny", "--out", str(tmp_path / "cli"), "--layers", "2", "--dtype", "bfloat16", "--seed", "4"]
        )
        == 0
    )
    cfg = MoeModelConfig.from_dir(tmp_path / "cli")
    assert cfg.num_layers == 2 and cfg.torch_dtype == "bfloat16"
    with safe_open(str(tmp_path / "cli" / "model.safetensors"), framework="pt") as f:
        assert str(f.get_tensor("model.layers.1.mlp.experts.0.up_proj.weight").dtype) == "torch.bfloat16"
        assert not any(n.startswith("model.layers.2.") for n in f.keys())
    with pytest.raises(FileExistsError):
        write_checkpoint("tiny", tmp_path / "cli")


def test_qwen3_shape_preset_has_real_per_layer_shapes() -> None:
    p = PRESETS["qwen3-30b-a3b-shape"]
    cfg = MoeModelConfig.from_hf_config(hf_config_for(p, 4096, 4093, 4095))
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_experts, cfg.top_k) == (48, 2048, 128, 8)
    assert (cfg.moe_intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (768, 32, 4, 128)
    assert cfg.torch_dtype == "bfloat16" and cfg.vocab_size == 4096
    assert cfg.expert_bytes() == 3 * 2048 * 768 * 2 and cfg.kv_bytes_per_token() == 98_304


def test_ensure_tiny_generates_once(tmp_path: Path) -> None:
    first = ensure_tiny(tmp_path)
    mtime = (first / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny(tmp_path) == first and (first / "model.safetensors").stat().st_mtime_ns == mtime
    assert first.name.startswith("tiny-v") and [p.name for p in tmp_path.iterdir()] == [first.name]
