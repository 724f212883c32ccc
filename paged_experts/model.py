"""Compact Qwen3-MoE causal LM over ragged batches: one step is one engine step.

All chunks' tokens are concatenated for the projections and the MoE layers (one wave plan per
layer per step); attention runs per sequence against that sequence's own KV rows in a `KvPool`,
through `paged_experts.attention` (the same functions the static decode step uses). Numerics follow
transformers' Qwen3MoeForCausalLM (RMSNorm in fp32, RoPE cos/sin cast to the model dtype, eager
softmax in fp32) so its logits are an outside oracle for this code.

Public API: `run_step(chunks) -> StepLogits` (logits left on the device, with each row's argmax),
`forward(chunks)` (the same step, fp32 logits on the CPU), `prepare_decode(pool, max_batch)` (every
decode graph captured and every kernel compiled before serving), and the read-only views the server,
simulator and benchmarks use (`moe_layers`, `decode_graphs`, `layer_placements()`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from paged_experts import thread_clock
from paged_experts.attention import attend, attention_out, causal_mask, project_qkv, rms_norm, rope_tables
from paged_experts.config import MoeModelConfig
from paged_experts.decode.graphs import GraphedDecoder
from paged_experts.kv import KvPool, KvSequence, SeqChunk
from paged_experts.moe import (
    EXPERT_KERNELS,
    MoeLayer,
    PagedLayer,
    RouterOverride,
    RoutingObserver,
    StepContext,
)
from paged_experts.residency import dma_proxy
from paged_experts.residency.counters import PagingCounters, TalliedCounters
from paged_experts.residency.planner import LayerResidency
from paged_experts.runtime import RuntimeConfig
from paged_experts.step import StepLogits, is_prompt_chunk
from paged_experts.upload import to_device
from paged_experts.weights.loader import AttentionWeights, DenseWeights, LoadedModel, load

__all__ = ["MoeCausalLM", "SeqChunk", "StepLogits", "rms_norm"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _ChunkRows:
    """Where one chunk sits in the step's token axis and in its sequence's KV rows."""

    token_slice: slice  # rows of this chunk in the step's [T, ...] tensors
    new_rows: torch.Tensor  # [n] KV rows written by this chunk
    all_rows: torch.Tensor  # [start_pos + n] KV rows attended to
    mask: torch.Tensor  # [n, start_pos + n] additive causal mask
    pool: KvPool = field(repr=False)


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
        path or a weightless directory written by `paged_experts.weights.synth_memory` (no safetensors)."""
        from paged_experts.weights import synth_memory

        loaded = synth_memory.load_synthetic(path, runtime) if synth_memory.is_synthetic(path) else load(path, runtime)
        return cls(loaded, runtime, expert_kernel)

    @classmethod
    def synthetic(
        cls, preset: str, runtime: RuntimeConfig, layers: int | None = None, seed: int = 0, expert_kernel: str = "fused"
    ) -> MoeCausalLM:
        """A model with seeded random weights built straight into the host store and device slots."""
        from paged_experts.weights import synth_memory

        return cls(synth_memory.build(preset, runtime, layers=layers, seed=seed), runtime, expert_kernel)

    def enable_cuda_graphs(self, batch_sizes: Sequence[int], compile_layers: bool = False) -> None:
        """Decode steps of these batch sizes run as one captured graph each (resident models, and
        paged ones planned on the device for B x top_k <= K; on CPU the same static step runs
        uncaptured). `compile_layers`: torch.compile the per-layer blocks first (fewer kernels).
        Graphs are captured on first use, or all at once by `prepare_decode`."""
        self._graphs = GraphedDecoder(self, batch_sizes, compile_layers) if batch_sizes else None

    def graphable(self) -> bool:
        """Every layer resident, or paged with its residency on the device (decode can be captured)."""
        return all(m.graphable for m in self._moe)

    @property
    def graph_replays(self) -> int:
        return self._graphs.replays if self._graphs is not None else 0

    @property
    def captured_graphs(self) -> list[tuple[int, int]]:
        """(batch size, KV bucket; 0 for bucket-free graphs) of every graph captured so far."""
        return list(self._graphs.captured) if self._graphs is not None else []

    @property
    def decode_graphs(self) -> GraphedDecoder | None:
        """The static decode step (None when CUDA graphs are off)."""
        return self._graphs

    @property
    def moe_layers(self) -> tuple[MoeLayer, ...]:
        """The MoE block of every layer, in order (read-only view: counters, residency, slots)."""
        return tuple(self._moe)

    @property
    def expert_planning(self) -> str:
        """'device' when paged steps that fit one wave are planned on the device, else 'host'."""
        return "device" if any(isinstance(m, PagedLayer) and m.device_lru is not None for m in self._moe) else "host"

    def lru_states(self) -> list[LayerResidency] | None:
        """A host copy of every layer's LRU state (the simulator's type), None unless every layer is paged."""
        paged = [m for m in self._moe if isinstance(m, PagedLayer)]
        return [m.lru_state() for m in paged] if len(paged) == len(self._moe) else None

    @property
    def attention_layers(self) -> tuple[AttentionWeights, ...]:
        return tuple(self._attention)

    @property
    def dense(self) -> DenseWeights:
        """Embedding, final norm and LM head."""
        return self._dense

    @property
    def rope_inv_freq(self) -> torch.Tensor:
        """[D/2] RoPE inverse frequencies (fp32, CPU)."""
        return self._inv_freq

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

    def prepare_decode(self, pool: KvPool, max_batch: int) -> dict[str, float]:
        """Before serving: captures every decode graph a step on `pool` could replay and runs one
        eager step of each other decode batch size up to `max_batch` (so no capture, torch.compile
        or Triton JIT happens inside a measured request), then restores the starting residency and
        zeroes the counters. `pool` must hold no live sequence. Returns the seconds each part took."""
        t0 = time.perf_counter()
        saved = [m.device_residency.state() for m in self._moe if m.device_residency is not None]
        captured = self._graphs.prepare(pool) if self._graphs is not None else 0
        t1 = time.perf_counter()
        graphed = set(self._graphs.batch_sizes) if self._graphs is not None else set()
        eager = [b for b in range(1, max_batch + 1) if b not in graphed]
        observers, self.routing_observers = self.routing_observers, []  # warm-up steps are no served routing
        try:
            for b in eager:  # the step's kernels (Triton backends, grouped GEMMs) meet this shape now
                seqs = [pool.new_sequence() for _ in range(b)]
                try:
                    self.run_step([SeqChunk(s, [0], 0) for s in seqs])
                finally:
                    for s in seqs:
                        pool.free(s)
        finally:
            self.routing_observers = observers
        paged = [m for m in self._moe if isinstance(m, PagedLayer) and m.device_residency is not None]
        for m, state in zip(paged, saved):
            residency = m.device_residency
            assert residency is not None  # kept by the filter above
            residency.load_state(state)
            m.reload_slots()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        self.counters.reset()
        t2 = time.perf_counter()
        log.info(
            "decode prepared: %d graphs captured in %.2f s, eager batch sizes %s warmed in %.2f s",
            captured, t1 - t0, eager, t2 - t1,
        )  # fmt: skip
        return {"capture_s": t1 - t0, "eager_warmup_s": t2 - t1, "graphs": float(captured)}

    @torch.inference_mode()
    def forward(self, chunks: Sequence[SeqChunk]) -> list[torch.Tensor]:
        """Runs one step; returns fp32 CPU logits per chunk: [n, V] if all_logits else [1, V]."""
        rows = self.run_step(chunks).cpu_rows()
        self.check_device()
        return rows

    def check_device(self) -> None:
        """After a step's output reached the host: raises if the step's page-ins did not land (the DMA proxy
        failed, or a wait on it gave up: RuntimeConfig.overlap_copies='dma'), so its output is not used."""
        if self.runtime.overlap_copies == "dma":
            dma_proxy.check_all()

    @torch.inference_mode()
    def run_step(self, chunks: Sequence[SeqChunk], token_source: torch.Tensor | None = None) -> StepLogits:
        """Runs one step; the logits stay on the device (see `StepLogits`). `token_source` [B], on
        the device: the chunks' input tokens, e.g. the previous step's argmax, read there instead of
        the chunks' own (placeholder) token ids, so this step can be queued before that one's ids
        reach the host; only static decode steps take it."""
        if not chunks:
            return StepLogits.empty(self.device)
        self._check_chunks(chunks)
        if self._graphs is not None and self._graphs.accepts(chunks):
            return self._graphs.step(chunks, token_source)
        # the host's issue of a step that runs a prompt chunk (the thread's clocks cost ~4 us a reading: other eager
        # steps and graphed decode steps read none)
        started = thread_clock.read() if any(is_prompt_chunk(len(c.token_ids)) for c in chunks) else None
        opened = self.counters.prefill_steps_opened
        if token_source is not None:
            raise ValueError(
                "token_source is taken by static decode steps only (graphs on, every chunk one decode token)"
            )
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
        cos, sin = rope_tables(torch.tensor(positions, dtype=torch.float32), self._inv_freq, self.runtime.torch_dtype)
        # the step's host tensors go pinned (upload.to_device): a pageable copy blocks the issuing thread
        cos, sin = to_device(cos, dev), to_device(sin, dev)  # [T, D]
        x = self._dense.embed[to_device(torch.tensor(token_ids, dtype=torch.long), dev)]  # [T, H]
        for layer_idx, (attn, moe) in enumerate(zip(self._attention, self._moe)):
            x, h = self._attention_step(layer_idx, attn, x, cos, sin, rows)
            x = x + moe.forward(h, ctx, self.router_override, self.routing_observers)
        for c in chunks:
            c.seq.pool.commit(c.seq, c.start_pos + len(c.token_ids))
        wanted = [
            r.token_slice if c.all_logits else slice(r.token_slice.stop - 1, r.token_slice.stop)
            for c, r in zip(chunks, rows)
        ]
        index = to_device(torch.cat([torch.arange(s.start, s.stop) for s in wanted]), dev)  # [R]
        hidden = rms_norm(x[index], self._dense.final_norm, cfg.rms_norm_eps)  # [R, H]
        logits = F.linear(hidden, self._dense.lm_head)  # [R, V]
        greedy = logits.argmax(dim=-1)  # [R]
        prefill = self.counters.prefill_step_host(opened)
        if prefill is not None:  # everything of the step is issued: its host time ends here
            if started is None:  # the counters and this step's clocks must follow one rule (is_prompt_chunk)
                raise AssertionError("a prefill step opened without a prompt chunk: its issue time was not read")
            host = thread_clock.between(started, thread_clock.read())
            prefill = replace(
                prefill, issue_s=host.wall_s, issue_cpu_s=host.cpu_s, issue_run_delay_s=host.run_delay_s,
                issue_voluntary_switches=host.voluntary_switches, issue_involuntary_switches=host.involuntary_switches,
                cpu_id_first=host.cpu_id_first, cpu_id_last=host.cpu_id_last,
            )  # fmt: skip
        return StepLogits(logits, greedy, tuple(s.stop - s.start for s in wanted), prefill)

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
            out.append(
                _ChunkRows(
                    token_slice=slice(start, start + n),
                    new_rows=pool.rows(c.seq, c.start_pos, end_pos),
                    all_rows=pool.rows(c.seq, 0, end_pos),
                    mask=causal_mask(c.start_pos, n, self.runtime.torch_dtype, self.device),
                    pool=pool,
                )
            )
            start += n
        return out

    def _attention_step(
        self,
        layer_idx: int,
        w: AttentionWeights,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        rows: list[_ChunkRows],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's attention over ragged chunks: residual x [T, H] -> (x + attention [T, H],
        post-attention-norm hidden [T, H]). Each chunk writes and reads its own pool's KV rows."""
        cfg = self.config
        q, k, v = project_qkv(
            x,
            w.input_norm,
            w.qkv_proj,
            w.q_norm,
            w.k_norm,
            cos,
            sin,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.rms_norm_eps,
            w.qkv_scale,
        )  # [T, nh, D], [T, kvh, D], [T, kvh, D]
        outs = []
        for r in rows:
            kv_k, kv_v = r.pool.k[layer_idx], r.pool.v[layer_idx]  # [slots, kvh, D]
            kv_k.index_copy_(0, r.new_rows, k[r.token_slice])
            kv_v.index_copy_(0, r.new_rows, v[r.token_slice])
            outs.append(attend(q[r.token_slice][None], kv_k, kv_v, r.all_rows[None], r.mask[None])[0])  # [n, nh*D]
        x, h, _ = attention_out(x, torch.cat(outs, dim=0), w.o_proj, w.post_norm, None, cfg.rms_norm_eps, w.o_scale)
        return x, h
