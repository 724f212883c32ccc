"""The whole decode step as one CUDA graph per (batch size, KV bucket): resident models, and paged
models whose residency lives on the device (`device_residency`: LRU plan, page-in kernel reading
pinned host memory, grouped matmuls over the slots) for batch sizes B with B x top_k <= K.

Eager decode launches ~80 small kernels per layer (about 4,000 a token for 48 layers): at batch 1
the GPU waits on Python. A step whose chunks are all one-token decodes (no observers; no router
override, or a synthetic router whose ids for every layer are drawn before the step and passed in
with the other inputs; every layer resident or device-planned paged) is instead run as a static computation over fixed-shape buffers:
- tokens [B], positions [B], new KV rows [B] and a KV row table [B, L] (each sequence's rows of
  positions 0..L-1, padded with its row 0), L = the step's longest context rounded up to a power
  of two (at least 64): one graph per (B, L bucket), captured on first use;
- attention runs over the padded L with an additive mask (positions beyond the token's own get the
  dtype's minimum, i.e. probability exactly 0), so the result equals the eager per-sequence
  attention within rounding (not bit for bit: the softmax reduces over a longer row);
- MoE layers run on the device with no host sync through `MoeLayer.decode_pass`: resident layers
  over their experts, paged ones as an LRU plan, the page-in kernel, then the slots; each layer's
  union, hits and misses are written to a static vector that the counters read lazily after the
  replay;
- with `RuntimeConfig.prefetch_next_layer`, between a paged layer's page-ins and its expert pass the
  next layer's experts are predicted (its norm and router on this layer's residual stream) and
  paged in on a second stream (`PagedLayer.prefetch`); the next layer waits for that copy.
Host work per step: build one int64 tensor of indices, one host->device copy, replay, and the
logits' device->host copy (the step's only sync). On CPU the same static body runs uncaptured
(tests compare it with the eager path).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from paged_experts.kernels import attn_triton
from paged_experts.kernels.copy_kernel import graph_safe
from paged_experts.kernels.fused import expert_backend, experts_over_rows, route_logits
from paged_experts.moe import page_in_stream

if TYPE_CHECKING:
    from paged_experts.kv import KvPool
    from paged_experts.model import MoeCausalLM, SeqChunk

log = logging.getLogger(__name__)

MIN_BUCKET = 64


def bucket(length: int) -> int:
    b = MIN_BUCKET
    while b < length:
        b *= 2
    return b


class _Captured:
    def __init__(
        self, inputs: torch.Tensor, graph: torch.cuda.CUDAGraph | None, logits: torch.Tensor, stats: torch.Tensor,
        ids: torch.Tensor,
    ):
        self.inputs = inputs  # [B * 3 + B * L] int64 on the device
        self.graph = graph
        self.logits = logits  # [B, V]
        self.stats = stats  # [layers, 3] union, hits, misses; [layers, 5] + prefetched, prefetch used
        self.ids = ids  # [layers, B, k] the step's routed experts (for `trace`)


class GraphedDecoder:
    """Runs eligible decode steps of `model` as static (CUDA-graphed on CUDA) computations."""

    def __init__(self, model: MoeCausalLM, batch_sizes: Sequence[int], compile_layers: bool = False) -> None:
        if not model.graphable():
            raise ValueError(
                "CUDA-graph decode needs every layer resident or paged with device planning, got placements "
                f"{sorted(set(model.layer_placements()))}"
            )
        self.model = model
        self._paged = [m for m in model._moe if m.placement == "paged"]
        fits = [b for b in sorted(set(batch_sizes)) if all(m.fits_one_wave(b) for m in model._moe)]
        if len(fits) < len(set(batch_sizes)):
            log.info(
                "decode graphs: batch sizes above K // top_k = %d stay eager (host-planned waves)",
                self._paged[0].device_residency.num_slots // model.config.top_k,  # type: ignore[union-attr]
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
        self._entries: dict[tuple[int, int], _Captured] = {}
        self._mempool = torch.cuda.graph_pool_handle() if self.capture else None
        self.replays = 0
        self.captured: list[tuple[int, int]] = []
        # Next-layer prefetch (RuntimeConfig.prefetch_next_layer): while a layer computes, the next
        # paged layer's router reads this layer's residual stream and its predicted experts page in
        # on a second stream (the fork and join are captured as graph dependencies).
        self.prefetch = bool(model.runtime.prefetch_next_layer) and bool(self._paged)
        self._predict_fn = torch.compile(predict_logits, dynamic=False) if compile_layers else predict_logits
        # When a list: each step appends its routed ids [layers, B, k] (device tensors), e.g. for a
        # benchmark's LRU replay of the exact routing it ran.
        self.trace: list[torch.Tensor] | None = None
        self._inv_freq = model._inv_freq.to(model.device)  # [D/2]
        # compile_layers: the per-layer attention block and expert pass go through torch.compile
        # (one compiled function per shape serves every layer), fusing the ~100 small kernels a
        # layer launches; the graph then captures the compiled kernels.
        # The 'triton' expert backend's routing and expert kernels are already one launch each
        # (moe_triton): they run uncompiled, inside the graph, beside the compiled attention.
        self.triton = expert_backend() == "triton" and model.device.type == "cuda"
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
                moe.device_residency.compile()  # type: ignore[union-attr]
        log.info(
            "decode step graphs enabled for batch sizes %s (captured on first use per KV bucket)%s%s%s",
            list(self.batch_sizes), ", layers compiled" if compile_layers else "",
            ", routing and experts as moe_triton kernels" if self.triton else "",
            ", next-layer prefetch" if self.prefetch else "",
        )

    def accepts(self, chunks: Sequence[SeqChunk]) -> bool:
        m = self.model
        if m.routing_observers or len(chunks) not in self.batch_sizes:
            return False
        if m.router_override is not None and not hasattr(m.router_override, "plan"):
            return False  # only routers that draw a whole step up front (routing.SyntheticRouter)
        pool = chunks[0].seq.pool
        return all(len(c.token_ids) == 1 and not c.all_logits and c.seq.pool is pool for c in chunks)

    def step(self, chunks: Sequence[SeqChunk]) -> list[torch.Tensor]:
        """One decode step (KV reserved and committed here, as `MoeCausalLM.forward` does)."""
        m = self.model
        pool = chunks[0].seq.pool
        pool.check_reserve([(c.seq, c.start_pos, 1) for c in chunks])
        for c in chunks:
            pool.reserve(c.seq, c.start_pos, 1)
        if pool is not self._pool:  # graphs address the pool's K/V tensors: a new pool, new graphs
            self._entries.clear()
            self._pool = pool
            if self.capture:  # and a fresh memory pool: reusing the freed graphs' pool trips the allocator
                torch.cuda.synchronize()
                self._mempool = torch.cuda.graph_pool_handle()
        b = len(chunks)
        length = bucket(max(c.start_pos for c in chunks) + 1)
        host = self._host_inputs(chunks, pool, length)  # [B * 3 + B * L]
        planned = m.router_override is not None
        if planned:  # the synthetic router's ids for every layer, drawn now: [B, layers, k]
            ids = m.router_override.plan([c.seq.seq_id for c in chunks], [c.start_pos for c in chunks])  # type: ignore[union-attr]
            host = torch.cat([host, torch.from_numpy(ids).reshape(-1)])
        if self.capture:
            host = host.pin_memory()  # copied with non_blocking: no sync before the replay
        key = (b, length, planned)
        entry = self._entries.get(key)
        fresh = entry is None
        if entry is None:
            entry = self._build(key, host)  # uncaptured (CPU): this ran the step already
        else:
            entry.inputs.copy_(host, non_blocking=True)
        if entry.graph is not None:
            entry.graph.replay()
        elif not fresh:  # a step runs once: a paged body plans and pages in
            entry.logits, entry.stats, entry.ids = self._body(entry.inputs, b, length, planned)
        self.replays += 1
        if self.trace is not None:
            self.trace.append(entry.ids.clone())
        for moe in self._paged:  # a replay planned on the device: the host planner must pull first
            moe.after_replay()
        pairs = b * m.config.top_k  # [layers, 3 or 5] union, hits, misses(, prefetches): read with the counters, later
        m.counters.record_layers_device(0, m.layer_placements(), entry.stats.clone(), pairs)  # type: ignore[attr-defined]
        logits = entry.logits.to("cpu", torch.float32)  # [B, V]: the step's one sync
        for c in chunks:
            pool.commit(c.seq, c.start_pos + 1)
        return list(torch.split(logits, 1))

    def _host_inputs(self, chunks: Sequence[SeqChunk], pool: KvPool, length: int) -> torch.Tensor:
        bs = pool.block_size
        b = len(chunks)
        tokens = torch.tensor([int(c.token_ids[0]) for c in chunks], dtype=torch.long)  # [B]
        positions = torch.tensor([c.start_pos for c in chunks], dtype=torch.long)  # [B]
        table = torch.empty(b, length, dtype=torch.long)  # [B, L]
        pos = torch.arange(length)  # [L]
        for i, c in enumerate(chunks):
            blocks = torch.tensor(c.seq.blocks, dtype=torch.long)  # [nb]
            p = pos.clamp(max=c.start_pos)  # padded positions reuse the last real row (finite values)
            table[i] = blocks[p // bs] * bs + p % bs
        new_rows = table[torch.arange(b), positions]  # [B]
        return torch.cat([tokens, positions, new_rows, table.reshape(-1)])

    def _build(self, key: tuple[int, int, bool], host: torch.Tensor) -> _Captured:
        m = self.model
        b, length, planned = key
        inputs = host.to(m.device)
        if not self.capture:
            entry = _Captured(inputs, None, *self._body(inputs, b, length, planned))
        else:
            t0 = time.perf_counter()
            saved = [m.device_residency.state() for m in self._paged]  # type: ignore[union-attr]
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._body(inputs, b, length, planned)  # warm-up: same inputs, so its KV writes are the step's own
            torch.cuda.current_stream().wait_stream(side)
            # The warm-up planned (and paged in) this step; rewind the residency so the replay
            # plans it again and its counters see the step's real misses. The replay re-pages the
            # same experts into the same slots (same state, same routing), so slots match maps.
            for m, state in zip(self._paged, saved):
                m.device_residency.load_state(state)  # type: ignore[union-attr]
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._mempool):
                outputs = self._body(inputs, b, length, planned)
            entry = _Captured(inputs, graph, *outputs)
            log.info(
                "captured decode step graph: batch %d, KV bucket %d%s, %.2f s",
                b, length, ", synthetic routing ids as input" if planned else "", time.perf_counter() - t0,
            )
            self.captured.append((b, length))
        self._entries[key] = entry
        return entry

    def _body(self, inputs: torch.Tensor, b: int, length: int, planned: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Static decode step: [B] tokens -> logits [B, V], per-layer stats [layers, 3] ([layers, 5]
        with prefetch) and routed ids [layers, B, k].
        planned: the inputs end with the synthetic router's ids [B, layers, k] for this step."""
        from paged_experts.model import rms_norm

        m = self.model
        cfg, dt = m.config, m.runtime.torch_dtype
        assert self._pool is not None
        tokens, positions, new_rows = inputs[:b], inputs[b : 2 * b], inputs[2 * b : 3 * b]
        table = inputs[3 * b : 3 * b + b * length].view(b, length)  # [B, L]
        planned_ids = inputs[3 * b + b * length :].view(b, -1, cfg.top_k) if planned else None  # [B, layers, k]
        freqs = positions.to(torch.float32)[:, None] * self._inv_freq[None, :]  # [B, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [B, D]
        cos, sin = emb.cos().to(dt), emb.sin().to(dt)
        keep = torch.arange(length, device=inputs.device)[None, :] <= positions[:, None]  # [B, L]
        zero = torch.zeros((), dtype=dt, device=inputs.device)
        mask = torch.where(keep, zero, torch.finfo(dt).min)  # [B, L]
        x = m._dense.embed[tokens]  # [B, H]
        stats: list[torch.Tensor | None] = []
        resident_ids: list[torch.Tensor] = []  # [B, k] per resident layer: their stats come at the end
        routed: list[torch.Tensor] = []  # [B, k] per layer
        copy_stream = page_in_stream(inputs.device) if self.prefetch else None
        for moe in self._paged:
            moe.drop_prefetch()  # a step interrupted by an error leaves none behind
        for layer_idx, (w, moe) in enumerate(zip(m._attention, m._moe)):
            kv_k, kv_v = self._pool.k[layer_idx], self._pool.v[layer_idx]
            if self.triton:
                q = self._attention_in(
                    x, w.input_norm, w.qkv_proj, w.q_norm, w.k_norm, kv_k, kv_v, cos, sin, new_rows,
                    cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps,
                )
                attn = attn_triton.decode_attention(q, kv_k, kv_v, table, positions)  # [B, nh*D]
                x, h, logits = self._attention_out(x, attn, w.o_proj, w.post_norm, moe.router_weight, cfg.rms_norm_eps)
            else:
                x, h, logits = self._attention_fn(
                    x, w.input_norm, w.qkv_proj, w.o_proj, w.q_norm, w.k_norm, w.post_norm, moe.router_weight,
                    kv_k, kv_v, cos, sin, new_rows, table, mask, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                    cfg.rms_norm_eps,
                )
            ids, weights = self._route_fn(
                logits, cfg.top_k, cfg.norm_topk_prob,
                None if planned_ids is None else planned_ids[:, layer_idx % planned_ids.shape[1]],
            )
            routed.append(ids)
            # resident: stats None (tallied below); paged: plan, page-in, next layer's prefetch, slots
            out, layer_stats = moe.decode_pass(
                h, ids, weights, self._experts_fn, lambda i=layer_idx, xi=x: self._prefetch_next(i, xi, copy_stream)
            )
            if layer_stats is None:
                resident_ids.append(ids)
            stats.append(layer_stats)
            x = x + out
        hidden = rms_norm(x, m._dense.final_norm, cfg.rms_norm_eps)  # [B, H]
        if resident_ids:  # every resident layer's union in one pass, not five small kernels per layer
            fills = iter(resident_union_stats(torch.stack(resident_ids), cfg.num_experts))
            stats = [next(fills) if st is None else st for st in stats]
        if self.prefetch:  # one width: layers without a prefetch report zero prefetches
            stats = [F.pad(st, (0, 5 - st.shape[0])) for st in stats]  # type: ignore[union-attr]
        return F.linear(hidden, m._dense.lm_head), torch.stack(stats), torch.stack(routed)  # type: ignore[arg-type]

    def _prefetch_next(self, layer_idx: int, x: torch.Tensor, copy_stream: torch.cuda.Stream | None) -> None:
        """Predicts layer `layer_idx + 1`'s experts from the residual stream x [B, H] after this
        layer's attention (that layer's own norm and router: the stream changes little per layer)
        and starts paging them in, if that layer is paged and prefetch is on."""
        m = self.model
        if not self.prefetch or layer_idx + 1 >= len(m._moe):
            return
        nxt = m._moe[layer_idx + 1]
        if not nxt.can_prefetch:
            return
        cfg = m.config
        logits = self._predict_fn(x, m._attention[layer_idx + 1].post_norm, nxt.router_weight, cfg.rms_norm_eps)  # [B, E]
        predicted, _ = route_logits(logits, cfg.top_k, cfg.norm_topk_prob)  # [B, k]
        nxt.prefetch(predicted, copy_stream)


def attention_in(
    x: torch.Tensor, input_norm: torch.Tensor, qkv_proj: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor,
    kv_k: torch.Tensor, kv_v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, new_rows: torch.Tensor,
    num_heads: int, num_kv_heads: int, head_dim: int, eps: float,
) -> torch.Tensor:
    """x [B, H] -> rotated queries [B, nh, D]; this step's keys and values written to their KV rows."""
    from paged_experts.model import rms_norm, rotate_half, split_qkv

    q, k, v = split_qkv(F.linear(rms_norm(x, input_norm, eps), qkv_proj), num_heads, num_kv_heads, head_dim)
    q = rms_norm(q, q_norm, eps)  # [B, nh, D]
    k = rms_norm(k, k_norm, eps)  # [B, kvh, D]
    q = q * cos[:, None, :] + rotate_half(q) * sin[:, None, :]
    k = k * cos[:, None, :] + rotate_half(k) * sin[:, None, :]
    kv_k.index_copy_(0, new_rows, k)  # [slots, kvh, D]
    kv_v.index_copy_(0, new_rows, v)
    return q


def torch_attention(q: torch.Tensor, kv_k: torch.Tensor, kv_v: torch.Tensor, table: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """q [B, nh, D] over the KV rows `table` [B, L] with the additive mask [B, L] -> [B, nh * D]."""
    b, num_heads, head_dim = q.shape
    groups = num_heads // kv_k.shape[1]
    keys = kv_k[table].repeat_interleave(groups, dim=2).transpose(1, 2)  # [B, nh, L, D]
    values = kv_v[table].repeat_interleave(groups, dim=2).transpose(1, 2)  # [B, nh, L, D]
    scores = torch.matmul(q[:, :, None, :], keys.transpose(2, 3)) * head_dim**-0.5  # [B, nh, 1, L]
    scores = scores + mask[:, None, None, :]
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)  # [B, nh, 1, L]
    return torch.matmul(probs, values).reshape(b, num_heads * head_dim)  # [B, nh*D]


def attention_out(
    x: torch.Tensor, attn: torch.Tensor, o_proj: torch.Tensor, post_norm: torch.Tensor, router: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Residual [B, H] + o_proj(attention [B, nh*D]) -> (x [B, H], post-norm hidden [B, H], router logits [B, E])."""
    from paged_experts.model import rms_norm

    x = x + F.linear(attn, o_proj)  # [B, H]
    h = rms_norm(x, post_norm, eps)  # [B, H]
    return x, h, F.linear(h, router)


def attention_block(
    x: torch.Tensor, input_norm: torch.Tensor, qkv_proj: torch.Tensor, o_proj: torch.Tensor, q_norm: torch.Tensor,
    k_norm: torch.Tensor, post_norm: torch.Tensor, router: torch.Tensor, kv_k: torch.Tensor, kv_v: torch.Tensor,
    cos: torch.Tensor, sin: torch.Tensor, new_rows: torch.Tensor, table: torch.Tensor, mask: torch.Tensor,
    num_heads: int, num_kv_heads: int, head_dim: int, eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One layer's attention (KV row written in place) over padded KV rows and its router logits,
    all tensors passed in (one compiled function serves every layer):
    x [B, H] -> (x + attention [B, H], post-norm hidden [B, H], router logits [B, E])."""
    q = attention_in(
        x, input_norm, qkv_proj, q_norm, k_norm, kv_k, kv_v, cos, sin, new_rows, num_heads, num_kv_heads, head_dim, eps
    )
    return attention_out(x, torch_attention(q, kv_k, kv_v, table, mask), o_proj, post_norm, router, eps)


def predict_logits(x: torch.Tensor, post_norm: torch.Tensor, router: torch.Tensor, eps: float) -> torch.Tensor:
    """Residual stream x [B, H] -> a layer's router logits [B, E] as if x were its MoE input."""
    from paged_experts.model import rms_norm

    return F.linear(rms_norm(x, post_norm, eps), router)


def resident_union_stats(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """ids [R, B, k] of R resident layers -> [R, 3] (union, hits = union, misses = 0) per layer."""
    r = ids.shape[0]
    flat = ids.reshape(r, -1).to(torch.long)  # [R, B*k]
    seen = torch.zeros(r, num_experts, dtype=torch.long, device=ids.device)  # [R, E]
    union = seen.scatter_(1, flat, 1).sum(dim=1)  # [R]
    return torch.stack([union, union, torch.zeros_like(union)], dim=1)


def route_block(
    logits: torch.Tensor, top_k: int, norm_topk_prob: bool, planned_ids: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [B, E] -> expert ids [B, k], weights [B, k]. `planned_ids` [B, k]: a synthetic
    router's ids for this layer, whose weights are the softmax of the model's logits over them."""
    from paged_experts.routing import planned_weights

    if planned_ids is not None:  # synthetic routing: ids drawn on the host for the step, weights from the model
        return planned_ids, planned_weights(logits, planned_ids)
    return route_logits(logits, top_k, norm_topk_prob)
