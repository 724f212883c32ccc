"""Text <-> tokens for the server: the checkpoint's tokenizer, its chat template, streaming
detokenization and stop strings.

Owns `TextCodec` (tokenizer.json + tokenizer_config.json of an HF directory; the chat template is
rendered with a sandboxed Jinja2 environment as transformers does), `Detokenizer` (text deltas
from a growing token list that never split a multi-byte character) and `StopMatcher` (holds back
text that could still become a stop string, truncates at the first stop string).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer


def _token_text(entry: Any) -> str | None:
    # tokenizer_config.json spells special tokens as a string or as an AddedToken dict
    if isinstance(entry, dict):
        return entry.get("content")
    return entry if isinstance(entry, str) else None


@dataclass(frozen=True)
class ChatTurn:
    role: str
    content: str


class TextCodec:
    def __init__(self, tokenizer: Tokenizer, config: dict[str, Any], extra_eos_ids: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.chat_template: str | None = config.get("chat_template")
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        eos_ids = set(extra_eos_ids)
        if self.eos_token is not None and (eos_id := tokenizer.token_to_id(self.eos_token)) is not None:
            eos_ids.add(eos_id)
        self.eos_token_ids: tuple[int, ...] = tuple(sorted(eos_ids))
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        # an upper bound on the text one token spells (byte-level vocabularies write a byte as a
        # character of up to 2 UTF-8 bytes): what bounds a prompt's bytes by its token limit
        self.max_token_bytes = max(
            (len(t.encode("utf-8")) for t in tokenizer.get_vocab(with_added_tokens=True)), default=1
        )
        self._template: Any = None

    @classmethod
    def from_dir(cls, path: str | Path, extra_eos_ids: Sequence[int] = ()) -> TextCodec:
        root = Path(path)
        tok_path = root / "tokenizer.json"
        if not tok_path.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {root}")
        config_path = root / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        if not isinstance(config.get("chat_template"), str):
            template_path = root / "chat_template.jinja"
            if template_path.is_file():
                config["chat_template"] = template_path.read_text()
        return cls(Tokenizer.from_file(str(tok_path)), config, extra_eos_ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # the batch API releases the GIL while it works (the single-text `encode` holds it), so a
        # long prompt encoded in a worker thread never stalls the event loop
        return list(self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def token_str(self, token_id: int) -> str:
        """How one token reads on its own (for logprobs tables); special tokens keep their text."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def render_chat(self, turns: Sequence[ChatTurn], add_generation_prompt: bool = True) -> str:
        if self.chat_template is None:
            raise ValueError("the checkpoint's tokenizer_config.json has no chat_template")
        if self._template is None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise_template_error
            self._template = env.from_string(self.chat_template)
        return str(
            self._template.render(
                messages=[{"role": t.role, "content": t.content} for t in turns],
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        )


def _raise_template_error(message: str) -> None:
    raise ValueError(f"chat template: {message}")


class Detokenizer:
    """Text deltas for a growing list of generated ids.

    Decodes the whole list each time (generations here are hundreds of tokens, so this is cheap)
    and withholds a trailing U+FFFD, which means a multi-byte character is still incomplete.
    """

    def __init__(self, codec: TextCodec) -> None:
        self._codec = codec
        self.ids: list[int] = []
        self.text = ""  # text already handed out

    def add(self, token_ids: Sequence[int], final: bool = False) -> str:
        self.ids.extend(token_ids)
        full = self._codec.decode(self.ids)
        if not final and full.endswith("\ufffd"):
            full = full.rstrip("\ufffd")
        if not full.startswith(self.text):
            # a later token changed how earlier bytes decode; hand out only what is new
            return ""
        delta = full[len(self.text) :]
        self.text = full
        return delta


class StopMatcher:
    """Feeds text deltas, returns what is safe to emit; `stopped` once a stop string appeared."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(stops)
        self._hold = max((len(s) for s in stops), default=1) - 1
        self._buffer = ""
        self.stopped = False

    def feed(self, delta: str) -> str:
        if self.stopped:
            return ""
        if not self._stops:
            return delta
        self._buffer += delta
        cut = min((i for s in self._stops if (i := self._buffer.find(s)) >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            out, self._buffer = self._buffer[:cut], ""
            return out
        keep = min(self._hold, len(self._buffer))
        # hold back only a tail that could still grow into a stop string
        while keep > 0 and not any(s.startswith(self._buffer[-keep:]) for s in self._stops):
            keep -= 1
        out = self._buffer[: len(self._buffer) - keep] if keep else self._buffer
        self._buffer = self._buffer[len(out) :]
        return out

    def flush(self) -> str:
        """The held-back tail, once the generation ended without a stop string."""
        out, self._buffer = ("" if self.stopped else self._buffer), ""
        return out
