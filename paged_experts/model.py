"""Compact Qwen3-MoE causal LM over ragged batches: one `forward` is one engine step.

All chunks' tokens are concatenated for the projections and the MoE layers (one wave plan per
layer per step); attention runs per sequence against that sequence's own KV rows in a `KvPool`.
Numerics follow transformers' Qwen3MoeForCausalLM (RMSNorm in fp32, RoPE cos/sin cast to the
model dtype, eager softmax in fp32) so its logits are an outside oracle for this code.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from paged_experts.config import MoeModelConfig
from paged_experts.counters import PagingCounters, TalliedCounters
from paged_experts.graphs import GraphedDecoder
from paged_experts.kv import KvPool, KvSequence
from paged_experts.loader import AttentionWeights, LoadedModel, load
from paged_experts.moe import (
    EXPERT_KERNELS,
    MoeLayer,
    PagedLayer,
    RouterOverride,
    RoutingObserver,
    StepContext,
)
from paged_experts.residency import LayerResidency
from paged_experts.runtime import RuntimeConfig


@dataclass(frozen=True)
class SeqChunk:
    """Tokens of one sequence at positions [start_pos, start_pos + len(token_ids))."""

    seq: KvSequence
    token_ids: Sequence[int]
    start_pos: int
    all_logits: bool = False


@dataclass(frozen=True)
class _ChunkRows:
    """Where one chunk sits in the step's token axis and in its sequence's KV rows."""

    token_slice: slice  # rows of this chunk in the step's [T, ...] tensors
    new_rows: torch.Tensor  # [n] KV rows written by this chunk
    all_rows: torch.Tensor  # [start_pos + n] KV rows attended to
    mask: torch.Tensor  # [n, start_pos + n] additive causal mask
    pool: KvPool = field(repr=False)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3 RMSNorm: normalise in fp32, cast back, then scale."""
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def split_qkv(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int) -> tuple[torch.Tensor, ...]:
    """[T, (nh + 2 kvh) D] fused projection -> q [T, nh, D], k [T, kvh, D], v [T, kvh, D]."""
    t = qkv.shape[0]
    q, k, v = torch.split(qkv, [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    return q.view(t, num_heads, head_dim), k.view(t, num_kv_heads, head_dim), v.view(t, num_kv_heads, head_dim)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class MoeCausalLM:
    def __init__(self, loaded: LoadedModel, runtime: RuntimeConfig, expert_kernel: str = "fused") -> None:
        self.config: MoeModelConfig = loaded.config
        self.runtime = runtime
        self._dense = loaded.dense
        self._attention = loaded.attention
        self._moe = loaded.moe
        # Device-side union tallies (read at snapshot) instead of a host sync per resident layer.
        c = loaded.counters
        self.counters: PagingCounters = TalliedCounters(c.num_layers, c.expert_bytes, c.mode)
        if self._moe:
            shared = replace(self._moe[0].shared, counters=self.counters)
            for layer in self._moe:
                layer.shared = shared
        self.set_expert_kernel(expert_kernel)
        self._graphs: GraphedDecoder | None = None
        self.router_override: RouterOverride | None = None
        self.routing_observers: list[RoutingObserver] = []
        cfg = self.config
        self._inv_freq = 1.0 / (
            cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim)
        )  # [D/2]

    @classmethod
    def from_pretrained(cls, path: str | Path, runtime: RuntimeConfig, expert_kernel: str = "fused") -> MoeCausalLM:
        """An HF checkpoint directory, or a synthetic model built in memory: a `synth:PRESET?layers=N&seed=S`
        path or a weightless directory written by `paged_experts.synth_memory` (no safetensors)."""
        from paged_experts import synth_memory

        loaded = synth_memory.load_synthetic(path, runtime) if synth_memory.is_synthetic(path) else load(path, runtime)
        model = cls(loaded, runtime, expert_kernel)
        sizes = [int(b) for b in os.environ.get("PAGED_EXPERTS_CUDA_GRAPHS", "").split(",") if b.strip()]
        if sizes and runtime.device == "cuda" and model.graphable():
            model.enable_cuda_graphs(sizes, compile_layers=os.environ.get("PAGED_EXPERTS_COMPILE", "") == "1")
        return model

    @classmethod
    def synthetic(
        cls, preset: str, runtime: RuntimeConfig, layers: int | None = None, seed: int = 0, expert_kernel: str = "fused"
    ) -> MoeCausalLM:
        """A model with seeded random weights built straight into the host store and device slots."""
        from paged_experts import synth_memory

        return cls(synth_memory.build(preset, runtime, layers=layers, seed=seed), runtime, expert_kernel)

    def enable_cuda_graphs(self, batch_sizes: Sequence[int], compile_layers: bool = False) -> None:
        """Decode steps of these batch sizes run as one captured graph each (resident models, and
        paged ones planned on the device for B x top_k <= K; on CPU the same static step runs
        uncaptured). `compile_layers`: torch.compile the per-layer blocks first (fewer kernels).
        `PAGED_EXPERTS_CUDA_GRAPHS=1,2,3,4` (and `PAGED_EXPERTS_COMPILE=1`) in the environment
        enable it in `from_pretrained` (the server needs no flag)."""
        self._graphs = GraphedDecoder(self, batch_sizes, compile_layers) if batch_sizes else None

    def graphable(self) -> bool:
        """Every layer resident, or paged with its residency on the device (decode can be captured)."""
        return all(m.graphable for m in self._moe)

    @property
    def moe_layers(self) -> tuple[MoeLayer, ...]:
        """The MoE block of every layer (`paged_experts.moe`: one class per placement)."""
        return tuple(self._moe)

    @property
    def graphs(self) -> GraphedDecoder | None:
        """The graphed decode path (`enable_cuda_graphs`), None when off."""
        return self._graphs

    @property
    def expert_planning(self) -> str:
        """'device' when paged steps that fit one wave are planned on the device, else 'host'."""
        return "device" if any(isinstance(m, PagedLayer) and m.device_lru is not None for m in self._moe) else "host"

    def lru_states(self) -> list[LayerResidency] | None:
        """A host copy of every layer's LRU state (the simulator's type), None unless every layer is paged."""
        paged = [m for m in self._moe if isinstance(m, PagedLayer)]
        return [m.lru_state() for m in paged] if len(paged) == len(self._moe) else None

    @property
    def graph_replays(self) -> int:
        return self._graphs.replays if self._graphs is not None else 0

    @property
    def captured_graphs(self) -> list[tuple[int, int]]:
        """(batch size, KV bucket) of every graph captured so far."""
        return list(self._graphs.captured) if self._graphs is not None else []

    def set_expert_kernel(self, kernel: str) -> None:
        """'fused' (grouped matmuls over the slot table, the default) or 'loop' (the per-expert reference)."""
        if kernel not in EXPERT_KERNELS:
            raise ValueError(f"expert_kernel must be one of {tuple(EXPERT_KERNELS)}, got {kernel!r}")
        for layer in self._moe:
            layer.set_kernel(kernel)
        self.expert_kernel = kernel

    @property
    def device(self) -> torch.device:
        return self.runtime.torch_device

    def layer_placements(self) -> tuple[str, ...]:
        return tuple(layer.placement for layer in self._moe)

    @torch.inference_mode()
    def forward(self, chunks: Sequence[SeqChunk]) -> list[torch.Tensor]:
        """Runs one step; returns fp32 CPU logits per chunk: [n, V] if all_logits else [1, V]."""
        if not chunks:
            return []
        self._check_chunks(chunks)
        if self._graphs is not None and self._graphs.accepts(chunks):
            return self._graphs.step(chunks)
        cfg, dev = self.config, self.device
        by_pool: dict[int, tuple[KvPool, list[tuple[KvSequence, int, int]]]] = {}
        for c in chunks:
            by_pool.setdefault(id(c.seq.pool), (c.seq.pool, []))[1].append((c.seq, c.start_pos, len(c.token_ids)))
        for pool, requests in by_pool.values():
            pool.check_reserve(requests)
        for c in chunks:
            c.seq.pool.reserve(c.seq, c.start_pos, len(c.token_ids))
        token_ids = [t for c in chunks for t in c.token_ids]
        positions = [c.start_pos + i for c in chunks for i in range(len(c.token_ids))]
        seq_ids = [c.seq.seq_id for c in chunks for _ in c.token_ids]
        ctx = StepContext(seq_ids=tuple(seq_ids), positions=tuple(positions))
        rows = self._chunk_rows(chunks)
        cos, sin = self._rope(torch.tensor(positions, dtype=torch.float32))  # [T, D], [T, D]
        x = self._dense.embed[torch.tensor(token_ids, dtype=torch.long, device=dev)]  # [T, H]
        for layer_idx, (attn, moe) in enumerate(zip(self._attention, self._moe)):
            x = x + self._attend(layer_idx, attn, rms_norm(x, attn.input_norm, cfg.rms_norm_eps), cos, sin, rows)
            h = rms_norm(x, attn.post_norm, cfg.rms_norm_eps)  # [T, H]
            x = x + moe.forward(h, ctx, self.router_override, self.routing_observers)
        for c in chunks:
            c.seq.pool.commit(c.seq, c.start_pos + len(c.token_ids))
        wanted = [r.token_slice if c.all_logits else slice(r.token_slice.stop - 1, r.token_slice.stop) for c, r in zip(chunks, rows)]
        index = torch.cat([torch.arange(s.start, s.stop) for s in wanted]).to(dev)  # [R]
        hidden = rms_norm(x[index], self._dense.final_norm, cfg.rms_norm_eps)  # [R, H]
        logits = F.linear(hidden, self._dense.lm_head).to("cpu", torch.float32)  # [R, V]
        return list(torch.split(logits, [s.stop - s.start for s in wanted]))

    def _check_chunks(self, chunks: Sequence[SeqChunk]) -> None:
        seen: set[int] = set()
        for c in chunks:
            if len(c.token_ids) == 0:
                raise ValueError(f"chunk for sequence {c.seq.seq_id} has no tokens")
            if c.seq.seq_id in seen:
                raise ValueError(f"sequence {c.seq.seq_id} appears in two chunks of one step")
            seen.add(c.seq.seq_id)
            bad = [t for t in c.token_ids if not 0 <= int(t) < self.config.vocab_size]
            if bad:
                raise ValueError(f"token ids {bad[:5]} outside the vocabulary [0, {self.config.vocab_size})")

    def _chunk_rows(self, chunks: Sequence[SeqChunk]) -> list[_ChunkRows]:
        out, start = [], 0
        for c in chunks:
            n, pool = len(c.token_ids), c.seq.pool
            end_pos = c.start_pos + n
            q_pos = torch.arange(c.start_pos, end_pos)[:, None]  # [n, 1]
            k_pos = torch.arange(end_pos)[None, :]  # [1, L]
            mask = torch.zeros(n, end_pos, dtype=self.runtime.torch_dtype)
            mask = mask.masked_fill(k_pos > q_pos, torch.finfo(self.runtime.torch_dtype).min)  # [n, L]
            out.append(
                _ChunkRows(
                    token_slice=slice(start, start + n),
                    new_rows=pool.rows(c.seq, c.start_pos, end_pos),
                    all_rows=pool.rows(c.seq, 0, end_pos),
                    mask=mask.to(self.device),
                    pool=pool,
                )
            )
            start += n
        return out

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None] * self._inv_freq[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
        dt, dev = self.runtime.torch_dtype, self.device
        return emb.cos().to(dev, dt), emb.sin().to(dev, dt)

    def _attend(
        self,
        layer_idx: int,
        w: AttentionWeights,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        rows: list[_ChunkRows],
    ) -> torch.Tensor:
        """h: [T, H] normed hidden states -> [T, H] attention output."""
        cfg = self.config
        q, k, v = split_qkv(F.linear(h, w.qkv_proj), cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        q = rms_norm(q, w.q_norm, cfg.rms_norm_eps)  # [T, nh, D]
        k = rms_norm(k, w.k_norm, cfg.rms_norm_eps)  # [T, kvh, D]
        q = q * cos[:, None, :] + rotate_half(q) * sin[:, None, :]
        k = k * cos[:, None, :] + rotate_half(k) * sin[:, None, :]
        groups = cfg.num_heads // cfg.num_kv_heads
        scale = cfg.head_dim**-0.5
        outs = []
        for r in rows:
            kv_k, kv_v = r.pool.k[layer_idx], r.pool.v[layer_idx]  # [slots, kvh, D]
            kv_k[r.new_rows] = k[r.token_slice]
            kv_v[r.new_rows] = v[r.token_slice]
            keys = kv_k[r.all_rows].repeat_interleave(groups, dim=1).transpose(0, 1)  # [nh, L, D]
            values = kv_v[r.all_rows].repeat_interleave(groups, dim=1).transpose(0, 1)  # [nh, L, D]
            qs = q[r.token_slice].transpose(0, 1)  # [nh, n, D]
            scores = torch.matmul(qs, keys.transpose(1, 2)) * scale + r.mask  # [nh, n, L]
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(qs.dtype)  # [nh, n, L]
            outs.append(torch.matmul(probs, values).transpose(0, 1).reshape(-1, cfg.num_heads * cfg.head_dim))  # [n, nh*D]
        return F.linear(torch.cat(outs, dim=0), w.o_proj)  # [T, H]
