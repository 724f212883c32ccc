"""The whole decode step as one static computation per batch size, captured as a CUDA graph on
CUDA: resident models, and paged models whose residency lives on the device (`device_residency`:
LRU plan, page-in kernel reading pinned host memory, grouped matmuls over the slots) for batch
sizes B with B x top_k <= K.

Eager decode launches ~80 small kernels per layer (about 4,000 a token for 48 layers): at batch 1
the GPU waits on Python. A step whose chunks are all one-token decodes (no router
override, or a synthetic router, which draws every layer's ids inside the graph from each token's
request id and position in the inputs; every layer resident or device-planned paged) instead
replays a graph over
fixed-shape buffers:
- tokens [B], positions [B], new KV rows [B], then a KV table: with the triton backend each
  sequence's block table [B, W] (W = the pool's blocks), which `attn_triton`'s split attention
  walks in chunks of the context (one program per chunk, a fixed grid sized for the pool's capacity:
  chunks past a sequence's position exit at once), so ONE graph per batch size serves every context
  length at every batch size; with the torch
  attention, the KV rows of positions 0..L-1 [B, L] with an additive mask, L the step's longest
  context rounded up to a power of two (at least 64): one graph per (B, L bucket);
- MoE layers run on the device with no host sync through `MoeLayer.decode_pass`: resident layers
  over their experts, paged ones as an LRU plan, the page-in kernel, then the slots; each
  layer's union, hits and misses (and prefetches) are added to a device tally inside the graph,
  which the counters read at their next snapshot (no per-step host work);
- with `RuntimeConfig.prefetch_next_layer`, between a paged layer's page-ins and its expert pass the
  next layer's experts are predicted (its norm and router on this layer's residual stream) and
  paged in on a second stream (`PagedLayer.prefetch`); the next layer waits for that copy;
- the step's logits [B, V] and each row's argmax [B] are the graph's outputs (`StepLogits`): a
  greedy engine reads back B token ids, not B x V logits.
Host work per step: fill one pinned int64 buffer in place, one host->device copy, the replay.
`prepare(pool)` captures every graph a step on that pool could use before serving (a server is
ready only then), so no capture or compile happens inside a measured request; a step whose graph
was not prepared captures it on first use. On CPU the same static body runs uncaptured (tests
compare it with the eager path).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from paged_experts.attention import attention_in, attention_out, rms_norm, rope_tables
from paged_experts.decode.blocks import attention_block, predict_logits, resident_union_stats, route_block
from paged_experts.decode.inputs import Entry, StepKey, bucket, buckets_up_to, fill, fill_dummy, new_entry, table_width
from paged_experts.kernels import attn_triton
from paged_experts.kernels.copy_kernel import graph_safe
from paged_experts.kernels.fused import experts_over_rows, route_logits
from paged_experts.kv import KvPool, SeqChunk
from paged_experts.moe import page_in_stream
from paged_experts.moe.layer import StepContext
from paged_experts.residency import dma_proxy
from paged_experts.residency.device import DuelShadows
from paged_experts.routing.record import observe_step
from paged_experts.step import StepLogits

log = logging.getLogger(__name__)

STAT_COLUMNS = 5  # union, hits, misses, prefetched, prefetch used
_TALLY_COLUMNS = STAT_COLUMNS + 1  # + union max


class DecodeModel(Protocol):
    """What the static decode step reads of its model (paged_experts.model.MoeCausalLM)."""

    config: Any
    runtime: Any
    counters: Any
    router_override: Any
    routing_observers: list[Any]

    @property
    def moe_layers(self) -> tuple[Any, ...]: ...

    @property
    def attention_layers(self) -> tuple[Any, ...]: ...

    @property
    def dense(self) -> Any: ...

    @property
    def rope_inv_freq(self) -> torch.Tensor: ...

    @property
    def device(self) -> torch.device: ...

    def layer_placements(self) -> tuple[str, ...]: ...

    def graphable(self) -> bool: ...


class GraphedDecoder:
    """Runs eligible decode steps of `model` as static (CUDA-graphed on CUDA) computations."""

    def __init__(self, model: DecodeModel, batch_sizes: Sequence[int], compile_layers: bool = False) -> None:
        if not model.graphable():
            raise ValueError(
                "CUDA-graph decode needs every layer resident or paged with device planning, got placements "
                f"{sorted(set(model.layer_placements()))}"
            )
        self.model = model
        self._layers = model.moe_layers
        self._paged = [m for m in self._layers if m.placement == "paged"]
        # a duel's shadows, which no plan of the step reads: one launch for every paged layer at the step's end
        self._shadows = DuelShadows([m.device_residency for m in self._paged])
        fits = [b for b in sorted(set(batch_sizes)) if all(m.fits_one_wave(b) for m in self._layers)]
        if len(fits) < len(set(batch_sizes)):
            log.info(
                "decode graphs: batch sizes above K // top_k = %d stay eager (host-planned waves)",
                self._paged[0].device_residency.num_slots // model.config.top_k,
            )
        self.batch_sizes = tuple(fits)
        self.capture = model.device.type == "cuda"
        if self.capture and model.runtime.dtype == "float32":
            raise ValueError(
                "CUDA-graph decode needs bfloat16 or float16: fp32 grouped matmuls fall back to a per-group loop "
                "that reads the group offsets on the host"
            )
        if self.capture and self._paged and not graph_safe(model.device):
            raise ValueError("CUDA-graph decode of paged layers needs Triton (the device page-in kernel)")
        self._pool: KvPool | None = None
        self._split: attn_triton.SplitPlan | None = None
        self._entries: dict[StepKey, Entry] = {}
        self._mempool = torch.cuda.graph_pool_handle() if self.capture else None
        self.replays = 0
        self.captured: list[tuple[int, int]] = []  # (B, KV bucket; 0 = bucket-free)
        # Next-layer prefetch (RuntimeConfig.prefetch_next_layer): while a layer computes, the next
        # paged layer's router reads this layer's residual stream and its predicted experts page in
        # on a second stream (the fork and join are captured as graph dependencies).
        self.prefetch = bool(model.runtime.prefetch_next_layer) and bool(self._paged)
        self._predict_fn = torch.compile(predict_logits, dynamic=False) if compile_layers else predict_logits
        # When a list: each step appends its routed ids [layers, B, k] (device tensors), e.g. for a
        # benchmark's LRU replay of the exact routing it ran.
        self.trace: list[torch.Tensor] | None = None
        self._inv_freq = model.rope_inv_freq.to(model.device)  # [D/2]
        # Counters of graphed steps: added up on the device inside the graph, read at a snapshot.
        self._tally = torch.zeros(len(self._layers), _TALLY_COLUMNS, dtype=torch.long, device=model.device)
        self._tally_steps = 0
        self._tally_pairs = 0
        if hasattr(model.counters, "add_device_tally"):
            model.counters.add_device_tally(self.drain_tally)
        # compile_layers: the per-layer attention block and expert pass go through torch.compile
        # (one compiled function per shape serves every layer), fusing the ~100 small kernels a
        # layer launches; the graph then captures the compiled kernels.
        # The 'triton' expert backend's routing and expert kernels are already one launch each
        # (moe_triton): they run uncompiled, inside the graph, beside the compiled attention.
        self.triton = model.runtime.kernel_backend == "triton" and model.device.type == "cuda"
        compile_moe = compile_layers and not self.triton
        self._attention_fn = torch.compile(attention_block, dynamic=False) if compile_layers else attention_block
        # ... and attention splits around attn_triton's decode kernel: two compiled halves
        self._attention_in = torch.compile(attention_in, dynamic=False) if compile_layers else attention_in
        self._attention_out = torch.compile(attention_out, dynamic=False) if compile_layers else attention_out
        self._route_fn = torch.compile(route_block, dynamic=False) if compile_moe else route_block
        self._experts_fn = torch.compile(experts_over_rows, dynamic=False) if compile_moe else experts_over_rows
        self.compiled = compile_layers
        if compile_layers:  # the paged layers' LRU plans too (one compiled function for all)
            for moe in self._paged:
                moe.device_residency.compile()
        log.info(
            "decode step graphs enabled for batch sizes %s (%s)%s%s%s",
            list(self.batch_sizes), "one per batch size" if self.triton else "one per batch size and KV bucket",
            ", layers compiled" if compile_layers else "",
            ", routing, experts and attention as Triton kernels" if self.triton else "",
            ", next-layer prefetch" if self.prefetch else "",
        )  # fmt: skip

    # ---- eligibility and the step ------------------------------------------------------------

    def accepts(self, chunks: Sequence[SeqChunk]) -> bool:
        m = self.model
        if len(chunks) not in self.batch_sizes:
            return False
        if m.router_override is not None and not hasattr(m.router_override, "draw_device"):
            return False  # only routers that draw on the device from (request, position) (routing.SyntheticRouter)
        pool = chunks[0].seq.pool
        return all(len(c.token_ids) == 1 and not c.all_logits and c.seq.pool is pool for c in chunks)

    def step(self, chunks: Sequence[SeqChunk], token_source: torch.Tensor | None = None) -> StepLogits:
        """One decode step (KV reserved and committed here, as `MoeCausalLM.run_step` does).
        `token_source` [B] on the device replaces the chunks' token ids (the previous step's argmax:
        copied into the inputs in stream order, after that step and before this one)."""
        m = self.model
        pool = chunks[0].seq.pool
        pool.check_reserve([(c.seq, c.start_pos, 1) for c in chunks])
        for c in chunks:
            pool.reserve(c.seq, c.start_pos, 1)
        self._use_pool(pool)
        b = len(chunks)
        planned = m.router_override is not None
        key = (b, 0 if self.triton else bucket(max(c.start_pos for c in chunks) + 1), planned)
        entry = self._entries.get(key)
        fresh = entry is None
        if entry is None:
            entry = new_entry(pool, key, self.model.device, self.capture)
        requests = None
        if planned:  # request ordinals: the router's draw inside the graph reads them with the positions
            requests = m.router_override.request_ids([c.seq.seq_id for c in chunks], [c.start_pos for c in chunks])
        fill(entry, pool, key, chunks, requests)
        if token_source is not None:
            entry.inputs[:b].copy_(token_source[:b])
        if fresh:
            self._build(entry, key)  # uncaptured (CPU): this ran the step already
        if entry.graph is not None:
            entry.graph.replay()
            if entry.rings:  # its page-ins on the DMA proxy: nothing more issued until their copies are queued
                dma_proxy.replayed(entry.rings)
        elif not fresh:  # CPU: a step runs once (a paged body plans and pages in)
            entry.logits, entry.greedy, entry.ids, entry.weights = self._body(entry.inputs, key)
        self.replays += 1
        self._tally_steps += 1
        self._tally_pairs += b * m.config.top_k
        if self.trace is not None:
            assert entry.ids is not None  # set by the step's capture or its eager run
            self.trace.append(entry.ids.clone())
        for moe in self._paged:  # a replay planned on the device: the host planner must pull first
            moe.after_replay()
        for c in chunks:
            pool.commit(c.seq, c.start_pos + 1)
        if m.routing_observers:  # after the step's bookkeeping: an observer that raises leaves the model consistent
            # views of the graph's static outputs, rewritten by the next replay: an observer copies what it keeps
            # (--record-routing's recorder stages them to pinned host memory in stream order, without waiting)
            assert entry.ids is not None
            ctx = StepContext(seq_ids=tuple(c.seq.seq_id for c in chunks), positions=tuple(c.start_pos for c in chunks))
            observe_step(m.routing_observers, [moe.layer_idx for moe in self._layers], entry.ids, entry.weights, ctx)
        assert entry.logits is not None and entry.greedy is not None
        return StepLogits(entry.logits, entry.greedy, (1,) * b)

    # ---- before serving ----------------------------------------------------------------------

    def prepare(self, pool: KvPool) -> int:
        """Captures every graph a decode step on `pool` can replay (each batch size; with the torch
        attention, each KV bucket up to the pool's capacity; the synthetic router's input layout if
        one is set) and returns how many. The pool must hold no live sequence: the captures write
        dummy KV rows. The caller restores the paged layers' residency and slots afterwards."""
        self._use_pool(pool)
        planned = self.model.router_override is not None
        buckets = [0] if self.triton else buckets_up_to(pool.capacity_tokens)
        done = 0
        for b in self.batch_sizes:
            for length in buckets:
                key = (b, length, planned)
                if key in self._entries:
                    continue
                entry = new_entry(pool, key, self.model.device, self.capture)
                fill_dummy(entry, key)
                self._build(entry, key)
                done += 1
        if self.capture:
            torch.cuda.synchronize()
        return done

    def drain_tally(self) -> tuple[list[list[int]], int, int, tuple[str, ...]] | None:
        """The graphed steps' per-layer sums since the last drain ([layers, 6]: union, hits, misses,
        prefetched, prefetch used, union max), their number and routed pairs; zeroes them. Called by
        the counters between steps (it reads the device once)."""
        if not self._tally_steps:
            self._tally.zero_()  # what warm-up and capture bodies added is no served step's
            return None
        rows = self._tally.tolist()
        self._tally.zero_()
        steps, pairs = self._tally_steps, self._tally_pairs
        self._tally_steps = self._tally_pairs = 0
        return rows, steps, pairs, self.model.layer_placements()

    # ---- buffers -----------------------------------------------------------------------------

    def _use_pool(self, pool: KvPool) -> None:
        if pool is self._pool:
            return
        # graphs address the pool's K/V tensors: a new pool, new graphs
        self._entries.clear()
        self._pool = pool
        # the split attention's chunks cover the pool's whole table: fixed per pool, every length served
        self._split = attn_triton.split_plan(pool.num_blocks * pool.block_size)
        if self.capture:  # and a fresh memory pool: reusing the freed graphs' pool trips the allocator
            torch.cuda.synchronize()
            self._mempool = torch.cuda.graph_pool_handle()

    @contextmanager
    def _graph_body(self) -> Iterator[None]:
        """Paged layers plan with their compiled LRU plan inside the static step only (eager steps
        of other shapes keep the plain one: no compile inside a served request)."""
        for moe in self._paged:
            moe.device_residency.in_static_step = True
        try:
            yield
        finally:
            for moe in self._paged:
                moe.device_residency.in_static_step = False

    def _build(self, entry: Entry, key: StepKey) -> None:
        b, length, _ = key
        if not self.capture:
            with self._graph_body():
                entry.logits, entry.greedy, entry.ids, entry.weights = self._body(entry.inputs, key)
        else:
            t0 = time.perf_counter()
            saved = [moe.device_residency.state() for moe in self._paged]
            tally = self._tally.clone()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side), self._graph_body():
                self._body(entry.inputs, key)  # warm-up: same inputs, so its KV writes are the step's own
            torch.cuda.current_stream().wait_stream(side)
            # The warm-up planned (and paged in) this step; rewind the residency so the replay
            # plans it again and its counters see the step's real misses. The replay re-pages the
            # same experts into the same slots (same state, same routing), so slots match maps.
            for moe, state in zip(self._paged, saved):
                moe.device_residency.load_state(state)
            self._tally.copy_(tally)
            self._shadows.warm(b * self.model.config.top_k)  # the batch's first launch, before the capture
            graph = torch.cuda.CUDAGraph()
            rings = dma_proxy.captured_rings()
            try:
                with torch.cuda.graph(graph, pool=self._mempool), self._graph_body():
                    entry.logits, entry.greedy, entry.ids, entry.weights = self._body(entry.inputs, key)
            except BaseException:
                self._shadows.discard()  # the failed capture's deferred shadows: nothing ran them or will
                raise
            entry.graph = graph
            entry.rings = dma_proxy.rings_since(rings)
            log.info(
                "captured decode step graph: batch %d, %s%s, %.2f s",
                b, f"KV bucket {length}" if length else "any context length",
                ", synthetic routing drawn inside" if key[2] else "", time.perf_counter() - t0,
            )  # fmt: skip
            self.captured.append((b, length))
        self._entries[key] = entry

    # ---- the static step ---------------------------------------------------------------------

    def _body(
        self, inputs: torch.Tensor, key: StepKey
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Static decode step: [B] tokens -> logits [B, V], argmax [B], routed ids and weights [layers, B, k];
        adds the step's per-layer stats to the device tally. The inputs end with each token's
        request id [B] when key[2] (planned): the synthetic router draws every layer's ids from
        them and the positions, here, inside the graph."""
        m = self.model
        b, length, planned = key
        cfg, dt = m.config, m.runtime.torch_dtype
        assert self._pool is not None
        width = table_width(self._pool, key)
        tokens, positions, new_rows = inputs[:b], inputs[b : 2 * b], inputs[2 * b : 3 * b]
        table = inputs[3 * b : 3 * b + b * width].view(b, width)  # [B, W]: block table, or KV rows [B, L]
        planned_ids = None
        if planned:  # [B, layers, k] drawn on the device: no host work per token
            planned_ids = m.router_override.draw_device(inputs[3 * b + b * width :], positions)
        cos, sin = rope_tables(positions, self._inv_freq, dt)  # [B, D]
        mask = None
        if length:
            keep = torch.arange(length, device=inputs.device)[None, :] <= positions[:, None]  # [B, L]
            mask = torch.where(keep, torch.zeros((), dtype=dt, device=inputs.device), torch.finfo(dt).min)  # [B, L]
        x = m.dense.embed[tokens]  # [B, H]
        stats: list[torch.Tensor | None] = []
        resident_ids: list[torch.Tensor] = []  # [B, k] per resident layer: their stats come at the end
        routed: list[torch.Tensor] = []  # [B, k] per layer
        routed_weights: list[torch.Tensor] = []  # [B, k] per layer (for routing observers: --record-routing)
        copy_stream = page_in_stream(inputs.device) if self.prefetch else None
        for moe in self._paged:
            moe.drop_prefetch()  # a step interrupted by an error leaves none behind
        for layer_idx, (w, moe) in enumerate(zip(m.attention_layers, self._layers)):
            kv_k, kv_v = self._pool.k[layer_idx], self._pool.v[layer_idx]
            if length == 0:
                q = self._attention_in(
                    x, w.input_norm, w.qkv_proj, w.q_norm, w.k_norm, kv_k, kv_v, cos, sin, new_rows,
                    cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps, w.qkv_scale,
                )  # fmt: skip
                attn = attn_triton.decode_attention_split(
                    q, kv_k, kv_v, table, positions, self._pool.block_size, self._split
                )  # [B, nh*D]
                x, h, logits = self._attention_out(
                    x, attn, w.o_proj, w.post_norm, moe.router_weight, cfg.rms_norm_eps, w.o_scale
                )
            else:
                assert mask is not None  # length > 0: the padded rows' mask
                x, h, logits = self._attention_fn(
                    x, w.input_norm, w.qkv_proj, w.o_proj, w.q_norm, w.k_norm, w.post_norm, moe.router_weight,
                    kv_k, kv_v, cos, sin, new_rows, table, mask, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                    cfg.rms_norm_eps, w.qkv_scale, w.o_scale,
                )  # fmt: skip
            assert logits is not None  # every layer has a router
            ids, weights = self._route_fn(
                logits, cfg.top_k, cfg.norm_topk_prob,
                None if planned_ids is None else planned_ids[:, layer_idx % planned_ids.shape[1]],
                m.runtime.kernel_backend,
            )  # fmt: skip
            routed.append(ids)
            routed_weights.append(weights)
            # resident: stats None (tallied below); paged: plan, page-in, next layer's prefetch, slots
            out, layer_stats = moe.decode_pass(
                h, ids, weights, self._experts_fn, lambda i=layer_idx, xi=x: self._prefetch_next(i, xi, copy_stream)
            )
            if layer_stats is None:
                resident_ids.append(ids)
            stats.append(layer_stats)
            x = x + out
        self._shadows.flush()  # every duel layer's shadows of this step (deferred where captured), one launch
        hidden = rms_norm(x, m.dense.final_norm, cfg.rms_norm_eps)  # [B, H]
        fills: Iterator[torch.Tensor] = iter(())
        if resident_ids:  # every resident layer's union in one pass, not five small kernels per layer
            fills = iter(resident_union_stats(torch.stack(resident_ids), cfg.num_experts))
        rows = [next(fills) if st is None else st for st in stats]
        step_stats = torch.stack([F.pad(st, (0, STAT_COLUMNS - st.shape[0])) for st in rows])  # [layers, 5]
        self._tally[:, :STAT_COLUMNS] += step_stats
        torch.maximum(self._tally[:, STAT_COLUMNS], step_stats[:, 0], out=self._tally[:, STAT_COLUMNS])
        logits = F.linear(hidden, m.dense.lm_head)  # [B, V]
        return logits, logits.argmax(dim=-1), torch.stack(routed), torch.stack(routed_weights)

    def _prefetch_next(self, layer_idx: int, x: torch.Tensor, copy_stream: torch.cuda.Stream | None) -> None:
        """Predicts layer `layer_idx + 1`'s experts from the residual stream x [B, H] after this
        layer's attention (that layer's own norm and router: the stream changes little per layer)
        and starts paging them in, if that layer is paged and prefetch is on."""
        m = self.model
        if not self.prefetch or layer_idx + 1 >= len(self._layers):
            return
        nxt = self._layers[layer_idx + 1]
        if not nxt.can_prefetch:
            return
        cfg = m.config
        post_norm = m.attention_layers[layer_idx + 1].post_norm
        logits = self._predict_fn(x, post_norm, nxt.router_weight, cfg.rms_norm_eps)  # [B, E]
        predicted, _ = route_logits(logits, cfg.top_k, cfg.norm_topk_prob, backend=m.runtime.kernel_backend)  # [B, k]
        nxt.prefetch(predicted, copy_stream)
