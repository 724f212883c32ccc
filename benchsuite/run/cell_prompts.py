"""The prompts of a cell: the same prompts for every engine (seeded order), per prompt class.

Owns turning a cell's workload and prompt class into `records.LoadRequest`s: natural prompts
(bundled or ShareGPT), exact-length prompts cut with the model's tokenizer (sent as token ids),
and dataset `random` (uniformly random token ids). Pools are cached per (workload, class,
tokenizer) in a dict the caller keeps for the run, so every server of a run gets the same prompts.
"""

from __future__ import annotations

import random
from pathlib import Path

from benchsuite.config.plan import CellSpec
from benchsuite.engines.base import EngineAdapter, ServerSpec
from benchsuite.errors import RunError
from benchsuite.load import datasets
from benchsuite.records import LoadRequest

RANDOM_SHORT_TOKENS = 32  # dataset `random`: length of a `short` prompt (random token ids)

PromptCache = dict[tuple[str, str, str], list[datasets.Prompt]]


def cell_requests(cache: PromptCache, adapter: EngineAdapter, spec: ServerSpec, cell: CellSpec) -> list[LoadRequest]:
    """The measured requests, the same prompts for every engine (seeded order); warmups reuse
    the first ones."""
    workload = cell.workload_spec
    count = workload.num_requests
    prompts = _prompt_pool(cache, adapter, spec, cell, count)
    order = list(range(len(prompts)))
    random.Random(workload.seed).shuffle(order)
    chosen = [prompts[order[i % len(order)]] for i in range(count)]
    return [
        LoadRequest(
            prompt_id=p.prompt_id,
            prompt_class=cell.prompt_class,
            prompt=p.token_ids if p.token_ids is not None else p.text,  # exact lengths travel as ids
            max_tokens=workload.output_tokens,
        )
        for p in chosen
    ]


def _prompt_pool(
    cache: PromptCache, adapter: EngineAdapter, spec: ServerSpec, cell: CellSpec, count: int
) -> list[datasets.Prompt]:
    workload = cell.workload_spec
    exact_tokens = int(cell.prompt_class) if cell.prompt_class.isdigit() else None
    if exact_tokens is None and workload.dataset == "random":
        exact_tokens = RANDOM_SHORT_TOKENS
    tokenizer: Path | None
    if workload.dataset == "random":  # random ids need only the vocabulary size: a GGUF file is enough
        tokenizer = _vocab_source(adapter, spec)
    else:
        tokenizer = _tokenizer_dir(adapter, spec) if exact_tokens is not None else None
    key = (cell.workload, cell.prompt_class, str(tokenizer))
    if key not in cache:
        natural = (
            datasets.load_sharegpt(Path(workload.path or ""), count, workload.seed)
            if workload.dataset == "sharegpt"
            else datasets.bundled_prompts()
        )
        if workload.dataset == "random" and exact_tokens is not None and tokenizer is not None:
            pool = _random_token_prompts(tokenizer, exact_tokens, count, workload.seed)
        elif exact_tokens is not None and tokenizer is not None:
            pool = datasets.exact_length_prompts(tokenizer, exact_tokens, count, workload.seed, source=natural)
        else:
            pool = natural
        if not pool:
            raise RunError(f"workload {cell.workload}: no prompts for class {cell.prompt_class}")
        cache[key] = list(pool)
    return cache[key]


def _random_token_prompts(vocab_source: Path, n_tokens: int, n: int, seed: int) -> list[datasets.Prompt]:
    """Dataset `random`: uniformly random ids of the learned vocabulary, the no-locality extreme.
    `vocab_source` is an HF tokenizer directory or a GGUF file (its tokenizer.ggml.tokens)."""
    if vocab_source.is_file() and vocab_source.suffix.lower() == ".gguf":
        vocab_size = datasets.gguf_vocab_size(vocab_source)
    else:
        vocab_size = datasets.load_tokenizer(vocab_source).get_vocab_size(with_added_tokens=False)
    rng = random.Random(seed)
    return [
        datasets.Prompt(
            f"rand{n_tokens}-s{seed}-{i}", "", str(n_tokens), tuple(rng.randrange(vocab_size) for _ in range(n_tokens))
        )
        for i in range(n)
    ]


def _vocab_source(adapter: EngineAdapter, spec: ServerSpec) -> Path:
    """Where dataset `random` reads the vocabulary size: the engine's GGUF file when it serves one, else the
    tokenizer."""
    found = adapter.gguf_file(spec)
    return Path(found) if found is not None else _tokenizer_dir(adapter, spec)


def _tokenizer_dir(adapter: EngineAdapter, spec: ServerSpec) -> Path:
    """The model's tokenizer, for exact-length prompts: the adapter's `tokenizer_dir` hook."""
    found = adapter.tokenizer_dir(spec)
    if found is None:
        raise RunError(f"engine {spec.name}: kind {spec.kind} cannot name its tokenizer; exact-length prompts need it")
    return Path(found)
