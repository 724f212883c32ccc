"""Prompt sources: bundled set, ShareGPT loading and its errors, exact-length prompts, and the
cross-engine prompt-length check."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from benchsuite.engines.base import Fairness
from benchsuite.errors import UserError
from benchsuite.load.datasets import (
    bundled_prompts,
    exact_length_prompts,
    load_sharegpt,
    prompt_length_mismatches,
)
from benchsuite.records import RequestRecord


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<unk>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator([p.text for p in bundled_prompts()], trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tokenizer.save(str(path))
    return path


def test_bundled_prompts_are_many_distinct_and_varied() -> None:
    prompts = bundled_prompts()
    assert len(prompts) >= 100
    assert len({p.prompt_id for p in prompts}) == len(prompts)
    assert len({p.text for p in prompts}) == len(prompts)
    assert all(p.prompt_class == "short" and p.token_ids is None and p.text.strip() for p in prompts)
    words = [len(p.text.split()) for p in prompts]
    assert min(words) < 15 and max(words) > 60  # varied length
    rows = [
        json.loads(line)
        for line in Path(__file__).parent.parent.joinpath("benchsuite/data/prompts.jsonl").read_text().splitlines()
    ]
    topics = Counter(row["topic"] for row in rows)
    assert len(topics) >= 10 and max(topics.values()) <= len(rows) // 4


def _write_sharegpt(path: Path) -> None:
    items = [
        {"id": "a", "conversations": [{"from": "human", "value": "first question"}, {"from": "gpt", "value": "x"}]},
        {"id": "b", "conversations": [{"from": "gpt", "value": "greeting"}, {"from": "human", "value": "second"}]},
        {"id": "c", "conversations": [{"from": "gpt", "value": "only the model speaks"}]},
        {"id": "a", "conversations": [{"from": "human", "value": "duplicate id"}]},
        {"id": "e", "conversations": [{"from": "human", "value": "   "}]},
    ]
    path.write_text(json.dumps(items))


def test_sharegpt_takes_first_human_turn_seeded(tmp_path: Path) -> None:
    path = tmp_path / "sg.json"
    _write_sharegpt(path)
    prompts = load_sharegpt(path, 3, seed=1)
    assert sorted(p.text for p in prompts) == ["duplicate id", "first question", "second"]
    assert len({p.prompt_id for p in prompts}) == 3
    assert all(p.prompt_class == "sharegpt" for p in prompts)
    assert [p.prompt_id for p in load_sharegpt(path, 3, seed=1)] == [p.prompt_id for p in prompts]
    orders = {tuple(p.prompt_id for p in load_sharegpt(path, 3, seed=s)) for s in range(10)}
    assert len(orders) > 1


def test_sharegpt_jsonl_is_accepted(tmp_path: Path) -> None:
    path = tmp_path / "sg.jsonl"
    path.write_text('{"id": "1", "conversations": [{"from": "human", "value": "hi"}]}\n')
    assert [p.text for p in load_sharegpt(path, 1, 0)] == ["hi"]


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "not found"),
        ("{broken", "not JSON"),
        ('{"a": 1}', "expected a JSON list"),
        ('[{"text": "no conversations"}]', "no item has a 'conversations' list"),
        ('[{"conversations": [{"from": "human", "value": "one"}]}]', "only 1 conversations"),
    ],
)
def test_sharegpt_errors_are_user_errors(tmp_path: Path, content: str | None, message: str) -> None:
    path = tmp_path / "sg.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(UserError, match=message):
        load_sharegpt(path, 2, 0)


@pytest.mark.parametrize("n_tokens", [1, 37, 2048])
def test_exact_length_prompts_have_exactly_n_tokens(tokenizer_file: Path, n_tokens: int) -> None:
    prompts = exact_length_prompts(tokenizer_file.parent, n_tokens, 3, seed=5)
    assert len(prompts) == 3
    for p in prompts:
        assert p.token_ids is not None and len(p.token_ids) == n_tokens
        assert p.prompt_class == str(n_tokens)
        assert p.text
    assert len({p.token_ids for p in prompts}) == 3 or n_tokens == 1
    again = exact_length_prompts(tokenizer_file, n_tokens, 3, seed=5)
    assert [p.token_ids for p in again] == [p.token_ids for p in prompts]


def test_exact_length_prompt_text_is_natural_language(tokenizer_file: Path) -> None:
    (p,) = exact_length_prompts(tokenizer_file, 300, 1, seed=0)
    bundled = " ".join(b.text for b in bundled_prompts())
    words = p.text.split()
    assert sum(w in bundled for w in words) / len(words) > 0.9


def test_missing_tokenizer_is_a_user_error(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="tokenizer not found"):
        exact_length_prompts(tmp_path, 10, 1, 0)


def _r(prompt_id: str, prompt_tokens: int | None) -> RequestRecord:
    return RequestRecord(
        cell_id="c",
        request_index=0,
        warmup=False,
        cold=False,
        prompt_id=prompt_id,
        prompt_class="short",
        max_tokens=4,
        t_sent_s=0.0,
        t_first_token_s=None,
        t_done_s=None,
        prompt_tokens=prompt_tokens,
    )


def test_prompt_length_mismatches_across_engines() -> None:
    found = prompt_length_mismatches(
        {
            "sglang": [_r("p1", 10), _r("p2", 20), _r("p3", 7)],
            "llamacpp": [_r("p1", 11), _r("p2", 20), _r("p3", None)],
            "builtin": [_r("p1", 10), _r("p2", 20)],
        }
    )
    assert [m.prompt_id for m in found] == ["p1"]
    assert found[0].prompt_tokens_by_engine == {"builtin": (10,), "llamacpp": (11,), "sglang": (10,)}
    assert prompt_length_mismatches({"one": [_r("p", 5), _r("p", 6)]})[0].prompt_tokens_by_engine == {"one": (5, 6)}
    assert prompt_length_mismatches({}) == []


@pytest.mark.parametrize("prompt_class", ["short", "16"])
def test_random_dataset_on_a_gguf_file_needs_only_its_vocabulary(
    tiny_model_dir: Path, tmp_path: Path, prompt_class: str
) -> None:
    from benchsuite.config.plan import CellSpec
    from benchsuite.config.schema import Workload
    from benchsuite.engines.base import ServerSpec
    from benchsuite.engines.llamacpp.adapter import LlamaCppAdapter, LlamaCppOptions
    from benchsuite.engines.llamacpp.gguf_export import export_gguf
    from benchsuite.load.datasets import gguf_vocab_size, load_tokenizer
    from benchsuite.run.cell_prompts import RANDOM_SHORT_TOKENS, cell_requests

    gguf = tmp_path / "tiny.gguf"
    export_gguf(tiny_model_dir, gguf, "f32")
    vocab = load_tokenizer(tiny_model_dir).get_vocab_size(with_added_tokens=False)
    assert gguf_vocab_size(gguf) == vocab  # the learned tokens, as the HF path draws them: no special token
    options = LlamaCppOptions(model=str(gguf))
    spec = ServerSpec("llama", "llamacpp", options, Fairness(512, False), 1, "sid")
    workload = Workload(dataset="random", prompt_classes=[prompt_class], num_requests=5, output_tokens=4)
    cell = CellSpec("cid", "sid", "llama", {}, "w", workload, prompt_class, 1, 0)
    requests = cell_requests({}, LlamaCppAdapter(), spec, cell)
    length = RANDOM_SHORT_TOKENS if prompt_class == "short" else 16
    assert len(requests) == 5 and all(len(r.prompt) == length for r in requests)
    assert all(0 <= t < gguf_vocab_size(gguf) for r in requests for t in r.prompt)
    assert len({tuple(r.prompt) for r in requests}) == 5
