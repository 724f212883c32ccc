"""Prompt sources: the bundled prompt set, ShareGPT files, exact-length prompts, and the
cross-engine prompt-length check.

- `bundled_prompts()`: benchsuite/data/prompts.jsonl, natural-language prompts written for this
  project (varied topics and lengths); the `short` class uses them as they are.
- `load_sharegpt(path, n, seed)`: the common ShareGPT JSON (a list of {id, conversations:
  [{from: human|gpt, value}]}); the first human turn of each conversation, n of them sampled
  with a seeded shuffle.
- `exact_length_prompts(tokenizer, n_tokens, n, seed)`: natural text cut to exactly n_tokens
  tokens of the model's tokenizer (tokenizer.json); the token ids travel with the prompt so every
  engine receives exactly that length (send them as a token-id prompt).
- `prompt_length_mismatches(records_by_engine)`: prompts for which engines reported different
  usage.prompt_tokens (templates, BOS handling, tokenizers that differ).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from benchsuite.errors import RunError, UserError
from benchsuite.records import RequestRecord

SHORT_CLASS = "short"
SHAREGPT_CLASS = "sharegpt"
_HUMAN_ROLES = ("human", "user")


@dataclass(frozen=True)
class Prompt:
    prompt_id: str
    text: str
    prompt_class: str
    token_ids: tuple[int, ...] | None = None  # set for exact-length prompts


@dataclass(frozen=True)
class PromptLengthMismatch:
    prompt_id: str
    prompt_tokens_by_engine: dict[str, tuple[int, ...]]  # distinct counts each engine reported


def bundled_prompts() -> list[Prompt]:
    """The project's own prompt set, in file order, class `short`."""
    text = resources.files("benchsuite").joinpath("data/prompts.jsonl").read_text(encoding="utf-8")
    prompts = []
    for line in text.splitlines():
        if line.strip():
            row = json.loads(line)
            prompts.append(Prompt(prompt_id=row["id"], text=row["text"], prompt_class=SHORT_CLASS))
    return prompts


def load_sharegpt(path: str | Path, n: int, seed: int) -> list[Prompt]:
    """n first-human-turn prompts from a ShareGPT JSON (or JSON Lines) file, seeded sample."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise UserError(f"ShareGPT file not found: {path}")
    if n < 1:
        raise UserError(f"number of ShareGPT prompts must be >= 1, got {n}")
    items = _read_json_or_jsonl(path)
    if isinstance(items, dict) and "conversations" in items:
        items = [items]  # a JSON Lines file with a single conversation
    if not isinstance(items, list) or not items:
        raise UserError(
            f"{path}: expected a JSON list of conversations like "
            '[{"id": ..., "conversations": [{"from": "human", "value": ...}, ...]}]'
        )
    prompts: list[Prompt] = []
    seen_ids: set[str] = set()
    malformed = 0
    for index, item in enumerate(items):
        turns = item.get("conversations") if isinstance(item, dict) else None
        if not isinstance(turns, list):
            malformed += 1
            continue
        first = next((t for t in turns if isinstance(t, dict) and t.get("from") in _HUMAN_ROLES), None)
        if first is None or not isinstance(first.get("value"), str) or not first["value"].strip():
            continue
        prompt_id = str(item.get("id", index))
        if prompt_id in seen_ids:  # ShareGPT dumps repeat ids; keep each prompt addressable
            prompt_id = f"{prompt_id}#{index}"
        seen_ids.add(prompt_id)
        prompts.append(Prompt(prompt_id=prompt_id, text=first["value"], prompt_class=SHAREGPT_CLASS))
    if malformed == len(items):
        raise UserError(
            f"{path}: no item has a 'conversations' list; expected the ShareGPT format "
            '[{"id": ..., "conversations": [{"from": "human", "value": ...}, ...]}]'
        )
    if len(prompts) < n:
        raise UserError(f"{path}: only {len(prompts)} conversations start with a human turn, {n} requested")
    random.Random(seed).shuffle(prompts)
    return prompts[:n]


def _read_json_or_jsonl(path: Path) -> Any:
    text = path.read_text(encoding="utf-8", errors="replace")
    try:
        return json.loads(text)
    except json.JSONDecodeError as whole_error:
        rows = []
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                raise UserError(
                    f"{path}: not JSON ({whole_error.msg} at line {whole_error.lineno}) nor JSON Lines (line {number})"
                ) from None
        return rows


_GGUF_TOKEN_NORMAL = 1  # llama.cpp's LLAMA_TOKEN_TYPE_NORMAL


def gguf_vocab_size(path: str | Path) -> int:
    """Vocabulary size of a GGUF model for drawing random token ids: its tokenizer.ggml.tokens array
    without the trailing tokens that are not NORMAL (the special tokens appended after the learned
    vocabulary, padding), so it equals the HF tokenizer's `get_vocab_size(with_added_tokens=False)`
    and every engine of a model is sent the same random ids; else `<arch>.vocab_size`."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
    except (OSError, ValueError) as exc:
        raise RunError(f"{path}: cannot read as GGUF ({exc})") from None
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is not None and tokens.data:
        n = len(tokens.data)
        types = reader.fields.get("tokenizer.ggml.token_type")
        if types is not None and len(types.data) == n:
            kinds = [int(types.parts[i][0]) for i in types.data]
            while n > 1 and kinds[n - 1] != _GGUF_TOKEN_NORMAL:
                n -= 1
        return n
    arch = reader.fields.get("general.architecture")
    if arch is not None:
        size = reader.fields.get(f"{bytes(arch.parts[arch.data[0]]).decode()}.vocab_size")
        if size is not None:
            return int(size.parts[size.data[0]][0])
    raise RunError(f"{path}: the GGUF names no vocabulary (no tokenizer.ggml.tokens, no <arch>.vocab_size)")


def load_tokenizer(tokenizer_dir_or_file: str | Path) -> Any:
    """A `tokenizers.Tokenizer` from tokenizer.json or the directory that holds it."""
    from tokenizers import Tokenizer

    path = Path(tokenizer_dir_or_file).expanduser()
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise UserError(f"tokenizer not found: {file} (give tokenizer.json or the model directory)")
    try:
        return Tokenizer.from_file(str(file))
    except Exception as exc:  # the library raises a bare Exception for a malformed file
        raise UserError(f"cannot read tokenizer {file}: {exc}") from exc


def exact_length_prompts(
    tokenizer_dir_or_file: str | Path | Any,
    n_tokens: int,
    n: int,
    seed: int,
    source: Iterable[Prompt] | None = None,
) -> list[Prompt]:
    """n prompts of exactly n_tokens tokens (no special tokens added), class str(n_tokens).

    Each prompt is natural text: source prompts (the bundled set by default) in a seeded order,
    joined by blank lines, repeated as needed, cut at n_tokens tokens. `text` is the decoded cut;
    `token_ids` are the exact ids to send (re-encoding the text need not give the same count).
    `tokenizer_dir_or_file` may also be a loaded `tokenizers.Tokenizer`.
    """
    if n_tokens < 1 or n < 1:
        raise UserError(f"exact-length prompts need n_tokens >= 1 and n >= 1, got {n_tokens}, {n}")
    tokenizer = (
        load_tokenizer(tokenizer_dir_or_file)
        if isinstance(tokenizer_dir_or_file, (str, Path))
        else tokenizer_dir_or_file
    )
    paragraphs = [p.text for p in (source if source is not None else bundled_prompts())]
    if not paragraphs:
        raise UserError("exact-length prompts need at least one source prompt")
    encoded = [tokenizer.encode(text + "\n\n", add_special_tokens=False).ids for text in paragraphs]
    if not any(encoded):
        raise UserError("the tokenizer encodes every source prompt to zero tokens")
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        ids: list[int] = []
        while len(ids) < n_tokens:
            order = list(range(len(encoded)))
            rng.shuffle(order)
            for j in order:
                ids.extend(encoded[j])
                if len(ids) >= n_tokens:
                    break
        cut = tuple(ids[:n_tokens])
        prompts.append(
            Prompt(
                prompt_id=f"len{n_tokens}-s{seed}-{i}",
                text=tokenizer.decode(list(cut), skip_special_tokens=False),
                prompt_class=str(n_tokens),
                token_ids=cut,
            )
        )
    return prompts


def prompt_length_mismatches(
    records_by_engine: dict[str, list[RequestRecord]],
) -> list[PromptLengthMismatch]:
    """Prompts whose reported usage.prompt_tokens differ between engines (or within one engine).

    Records without a prompt_tokens count are ignored; sorted by prompt_id.
    """
    counts: dict[str, dict[str, set[int]]] = {}
    for engine, records in records_by_engine.items():
        for r in records:
            if r.prompt_tokens is not None:
                counts.setdefault(r.prompt_id, {}).setdefault(engine, set()).add(r.prompt_tokens)
    mismatches = []
    for prompt_id in sorted(counts):
        by_engine = counts[prompt_id]
        if len(set().union(*by_engine.values())) > 1:
            mismatches.append(
                PromptLengthMismatch(
                    prompt_id=prompt_id,
                    prompt_tokens_by_engine={e: tuple(sorted(v)) for e, v in sorted(by_engine.items())},
                )
            )
    return mismatches
