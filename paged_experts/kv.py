"""KV pool sized in tokens: fixed-size blocks handed to sequences, one K and one V tensor per layer.

Capacity is fixed in TOKENS (DESIGN.md section 6: memory knobs must be compared in tokens) and
must be a multiple of `block_size`; `used_tokens` counts whole blocks held by sequences. A
sequence only ever reads and writes the cache rows of its own blocks.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from paged_experts.upload import to_device


class _HasKvShape(Protocol):
    """What `KvPool.for_model` reads of a model (its config's KV shape, its dtype and device)."""

    config: Any
    runtime: Any


class KvCapacityError(RuntimeError):
    """A chunk needs more KV blocks than the pool has free (check `can_fit` before a forward)."""


@dataclass(frozen=True)
class SeqChunk:
    """Tokens of one sequence at positions [start_pos, start_pos + len(token_ids)) in one step."""

    seq: KvSequence
    token_ids: Sequence[int]
    start_pos: int
    all_logits: bool = False


class KvSequence:
    """A handle to one sequence's blocks; create with `KvPool.new_sequence()`."""

    def __init__(self, pool: KvPool, seq_id: int) -> None:
        self.pool = pool
        self.seq_id = seq_id
        self.blocks: list[int] = []
        self.num_tokens = 0  # tokens whose K/V are stored
        self.freed = False

    def __repr__(self) -> str:
        return f"KvSequence(id={self.seq_id}, tokens={self.num_tokens}, blocks={len(self.blocks)})"


class KvPool:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        capacity_tokens: int,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if capacity_tokens < block_size or capacity_tokens % block_size != 0:
            raise ValueError(
                f"capacity_tokens ({capacity_tokens}) must be a positive multiple of block_size ({block_size})"
            )
        self.block_size = block_size
        self._capacity_tokens = capacity_tokens
        self.num_blocks = capacity_tokens // block_size
        self.device = torch.device(device)
        shape = (num_layers, capacity_tokens, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=self.device)  # [L, slots, KVH, D]
        self.v = torch.zeros(shape, dtype=dtype, device=self.device)  # [L, slots, KVH, D]
        self._free_blocks: list[int] = list(range(self.num_blocks - 1, -1, -1))  # pop() gives lowest first
        self._ids = itertools.count()
        self._live: dict[int, KvSequence] = {}

    @classmethod
    def for_model(cls, model: _HasKvShape, capacity_tokens: int, block_size: int = 16) -> KvPool:
        cfg = model.config
        return cls(
            num_layers=cfg.num_layers,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            capacity_tokens=capacity_tokens,
            block_size=block_size,
            dtype=model.runtime.torch_dtype,
            device=model.runtime.torch_device,
        )

    @property
    def capacity_tokens(self) -> int:
        return self._capacity_tokens

    @property
    def free_tokens(self) -> int:
        return len(self._free_blocks) * self.block_size

    @property
    def used_tokens(self) -> int:
        return self._capacity_tokens - self.free_tokens

    def new_sequence(self) -> KvSequence:
        seq = KvSequence(self, next(self._ids))
        self._live[seq.seq_id] = seq
        return seq

    def _blocks_needed(self, seq: KvSequence, total_tokens: int) -> int:
        return max(0, -(-total_tokens // self.block_size) - len(seq.blocks))

    def can_fit(self, seq: KvSequence, n_new_tokens: int) -> bool:
        self._check_live(seq)
        return self._blocks_needed(seq, seq.num_tokens + n_new_tokens) <= len(self._free_blocks)

    def check_reserve(self, requests: list[tuple[KvSequence, int, int]]) -> None:
        """Raises KvCapacityError unless every (seq, start_pos, num_tokens) fits together, so a
        step either reserves all its chunks or none."""
        needed = 0
        for seq, start_pos, num_tokens in requests:
            self._check_live(seq)
            if not 0 <= start_pos <= seq.num_tokens:
                raise ValueError(
                    f"sequence {seq.seq_id} holds {seq.num_tokens} tokens; chunk start_pos {start_pos} leaves a gap"
                )
            needed += self._blocks_needed(seq, start_pos + num_tokens)
        if needed > len(self._free_blocks):
            raise KvCapacityError(
                f"the step needs {needed} more KV blocks ({needed * self.block_size} tokens) "
                f"but only {self.free_tokens} tokens are free of {self.capacity_tokens}"
            )

    def reserve(self, seq: KvSequence, start_pos: int, num_tokens: int) -> None:
        """Makes room for positions [start_pos, start_pos + num_tokens); called by the model."""
        self._check_live(seq)
        if not 0 <= start_pos <= seq.num_tokens:
            raise ValueError(
                f"sequence {seq.seq_id} holds {seq.num_tokens} tokens; chunk start_pos {start_pos} leaves a gap"
            )
        needed = self._blocks_needed(seq, start_pos + num_tokens)
        if needed > len(self._free_blocks):
            raise KvCapacityError(
                f"sequence {seq.seq_id} needs {needed} more KV blocks ({needed * self.block_size} tokens) "
                f"but only {self.free_tokens} tokens are free of {self.capacity_tokens}"
            )
        for _ in range(needed):
            seq.blocks.append(self._free_blocks.pop())

    def commit(self, seq: KvSequence, end_pos: int) -> None:
        """Records that positions [0, end_pos) now hold valid K/V."""
        seq.num_tokens = max(seq.num_tokens, end_pos)

    def rows(self, seq: KvSequence, start_pos: int, end_pos: int) -> torch.Tensor:
        """Cache rows of positions [start_pos, end_pos) of `seq`: [end_pos - start_pos] int64 on the device."""
        if end_pos > len(seq.blocks) * self.block_size:
            raise ValueError(f"positions up to {end_pos} are not reserved for sequence {seq.seq_id}")
        pos = torch.arange(start_pos, end_pos)  # [n]
        blocks = torch.tensor(seq.blocks, dtype=torch.long)  # [nb]
        return to_device(blocks[pos // self.block_size] * self.block_size + pos % self.block_size, self.device)

    def block_table(self, seqs: Sequence[KvSequence], width: int) -> list[list[int]]:
        """Each sequence's blocks, padded with block 0 to `width` entries (a decode step's table)."""
        return [seq.blocks + [0] * (width - len(seq.blocks)) for seq in seqs]

    def free(self, seq: KvSequence) -> None:
        self._check_live(seq)
        self._free_blocks.extend(reversed(seq.blocks))
        seq.blocks = []
        seq.num_tokens = 0
        seq.freed = True
        del self._live[seq.seq_id]

    def _check_live(self, seq: KvSequence) -> None:
        if seq.pool is not self:
            raise ValueError(f"sequence {seq.seq_id} belongs to another pool")
        if seq.freed:
            raise ValueError(f"sequence {seq.seq_id} was freed")
