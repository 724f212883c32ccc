"""Synthetic routing sources: uniform, Zipf popularity, temporal reuse, and the calibrated
`qwen3-30b-a3b` preset (DESIGN.md section 8). Everything made with them is labelled
`synthetic:<spec>` (`routing_label`).

The generative model, per (request stream, layer), token by token:
- each of the previous token's k experts is kept with probability `keep_prob`;
- the remaining slots are drawn without replacement (Gumbel top-k) from a mixture:
  `recency_mix` x a power law over the layer's recency stack (rank r = r-th most recently used
  expert of this stream, weight (r + 1)^-recency_alpha, previous token's experts excluded) plus
  `1 - recency_mix` x a popularity over a fixed per-layer permutation of experts: a working set
  of the first `working_set` x E experts holds `working_set_mass` of it, Zipf(`zipf_s`) inside,
  the rest is uniform over all E (defaults: working set = all experts, i.e. plain Zipf);
- layers differ in temporal locality: layer l scales keep_prob and recency_mix by a strength
  lambda_l in [layer_strength_min, 1] (spread over layers with shape `layer_strength_gamma`),
  which is what spreads consecutive-token overlap over layers (published: 7.9%-59.7%); a layer
  with little reuse still routes mostly inside its working set (so it caches well at large K),
  except layers weaker than `working_set_knee`, whose working-set mass shrinks in proportion.

Owns `RoutingParams`, `parse_spec`, `RoutingProcess` (the vectorised generator),
`SyntheticRouter` (the `Router` callable the runtime's `router_override` takes), `make_router`
and `routing_label`.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, replace

import numpy as np
import torch


@dataclass(frozen=True)
class RoutingParams:
    keep_prob: float = 0.0
    recency_mix: float = 0.0
    recency_alpha: float = 1.0
    zipf_s: float = 0.0
    working_set: float = 1.0  # fraction of E
    working_set_mass: float = 1.0
    working_set_knee: float = 0.0  # layers with strength below the knee spread their routing wider
    layer_strength_min: float = 1.0  # 1.0: every layer alike
    layer_strength_gamma: float = 1.0


# Calibrated with benchmarks/calibrate_routing.py against DESIGN.md section 8 (E=128, top_k=8,
# 48 layers, one stream of 3,225 decode tokens replayed through paged_experts.residency).
QWEN3_30B_A3B = RoutingParams(
    keep_prob=0.58,
    recency_mix=0.85,
    recency_alpha=1.2,
    zipf_s=0.8,
    working_set=0.58,
    working_set_mass=0.965,
    working_set_knee=0.25,
    layer_strength_min=0.0,
    layer_strength_gamma=0.5,
)
PRESETS: dict[str, RoutingParams] = {"qwen3-30b-a3b": QWEN3_30B_A3B}


def parse_spec(spec: str) -> RoutingParams:
    """`uniform`, `zipf:<s>`, `reuse:<p>`, a preset name, or comma-joined parts
    (`reuse:0.4,zipf:1.2,recency:0.8,alpha:1.0,ws:0.5,wsmass:0.95`)."""
    spec = spec.strip().lower()
    if spec in PRESETS:
        return PRESETS[spec]
    params = RoutingParams()
    fields = {"zipf": "zipf_s", "reuse": "keep_prob", "recency": "recency_mix", "alpha": "recency_alpha",
              "ws": "working_set", "wsmass": "working_set_mass"}  # fmt: skip
    for part in spec.split(","):
        name, _, value = part.partition(":")
        if name == "uniform" and not value:
            continue
        if name not in fields or not value:
            raise ValueError(
                f"unknown routing spec {part!r}: use uniform, zipf:<s>, reuse:<p>, recency:<mix>,"
                f" alpha:<a> or a preset ({', '.join(PRESETS)})"
            )
        v = float(value)
        if name in ("reuse", "recency", "ws", "wsmass") and not 0.0 <= v <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {v}")
        if v < 0:
            raise ValueError(f"{name} must be >= 0, got {v}")
        params = replace(params, **{fields[name]: v})
    return params


def routing_label(spec: str) -> str:
    return f"synthetic:{spec.strip().lower()}"


def layer_strengths(num_layers: int, params: RoutingParams, seed: int = 0) -> np.ndarray:
    """[L] locality strength per layer, spread over [min, 1] and assigned to layers in a seeded order."""
    u = (np.arange(num_layers) + 0.5) / num_layers
    lam = params.layer_strength_min + (1.0 - params.layer_strength_min) * u**params.layer_strength_gamma
    return lam[np.random.default_rng([seed, 7]).permutation(num_layers)]


class StreamState:
    """One request stream's routing memory for a set of layers."""

    def __init__(self, num_rows: int, num_experts: int, top_k: int) -> None:
        self.prev = np.full((num_rows, top_k), -1, dtype=np.int64)  # [B, k], -1 before the first token
        self.last_use = np.zeros((num_rows, num_experts))  # [B, E] step of last use, 0 = never
        self.clock = 0


class RoutingProcess:
    """The generator for L layers; `next(state, rows)` routes one token for the given layer rows."""

    def __init__(self, num_layers: int, num_experts: int, top_k: int, params: RoutingParams, seed: int = 0) -> None:
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, {num_experts}]")
        self.num_layers, self.num_experts, self.top_k = num_layers, num_experts, top_k
        self.params = params
        self.rng = np.random.default_rng(seed)
        lam = layer_strengths(num_layers, params, seed)
        self.keep_prob = params.keep_prob * lam  # [L]
        self.recency_mix = params.recency_mix * lam  # [L]
        ranks = np.arange(1, num_experts + 1, dtype=np.float64)
        pop = np.empty((num_layers, num_experts))  # [L, E]
        perm_rng = np.random.default_rng([seed, 11])
        ws = max(1, min(num_experts, round(params.working_set * num_experts)))
        inner = ranks[:ws] ** -params.zipf_s
        for layer in range(num_layers):
            mass = params.working_set_mass
            if params.working_set_knee > 0:
                mass *= min(1.0, lam[layer] / params.working_set_knee)
            w = np.full(num_experts, (1.0 - mass) / num_experts)
            w[:ws] += mass * inner / inner.sum()
            pop[layer, perm_rng.permutation(num_experts)] = w
        self.popularity = pop
        self.recency_weights = ranks**-params.recency_alpha  # [E] by stack rank

    def new_state(self, num_rows: int | None = None) -> StreamState:
        return StreamState(num_rows or self.num_layers, self.num_experts, self.top_k)

    def next(self, state: StreamState, layers: np.ndarray) -> np.ndarray:
        """Route one token for `layers` ([B] layer index of each state row) -> [B, k] int64."""
        b, e, k = len(layers), self.num_experts, self.top_k
        rows = np.arange(b)
        first = state.prev[:, 0] < 0  # [B]
        weights = self.popularity[layers]  # [B, E]
        mix = self.recency_mix[layers][:, None]  # [B, 1]
        if mix.any():
            recency = state.last_use.copy()
            prev_valid = np.where(state.prev >= 0, state.prev, 0)
            recency[rows[:, None], prev_valid] = -1.0  # previous token's experts: not in the stack part
            # most recent first, ties in expert order: one integer key per expert (stamps are whole
            # numbers), so any sort gives the stable order, and integer sorts are the fast ones
            order = np.argsort((-recency).astype(np.int64) * e + np.arange(e), axis=1)
            stack = np.empty((b, e))
            np.put_along_axis(stack, order, np.broadcast_to(self.recency_weights, (b, e)), axis=1)
            stack[recency <= 0] = 0.0  # never used, or the previous token's
            norm = stack.sum(axis=1, keepdims=True)
            stack = np.divide(stack, norm, out=np.zeros_like(stack), where=norm > 0)
            use_mix = np.where(norm > 0, mix, 0.0)
            weights = (1.0 - use_mix) * weights + use_mix * stack
        keys = np.log(weights + 1e-300) - np.log(-np.log(self.rng.random((b, e))))  # Gumbel top-k keys
        keep = (self.rng.random((b, k)) < self.keep_prob[layers][:, None]) & ~first[:, None]  # [B, k]
        kept_rows, kept_cols = np.nonzero(keep)
        keys[kept_rows, state.prev[kept_rows, kept_cols]] = -np.inf
        top = np.argpartition(-keys, k - 1, axis=1)[:, :k]  # [B, k] the k best draws, unordered
        fresh = np.take_along_axis(
            top, np.argsort(-np.take_along_axis(keys, top, axis=1), axis=1), axis=1
        )  # best first
        kept_first = np.take_along_axis(state.prev, np.argsort(~keep, axis=1, kind="stable"), axis=1)
        n_kept = keep.sum(axis=1)[:, None]
        j = np.arange(k)[None, :]
        fill = np.take_along_axis(fresh, np.clip(j - n_kept, 0, k - 1), axis=1)
        out = np.where(j < n_kept, kept_first, fill)
        state.clock += 1
        state.prev = out
        state.last_use[rows[:, None], out] = state.clock
        return out


def random_weights(rng: np.random.Generator, n: int, k: int) -> np.ndarray:
    """[n, k] float32 routing weights summing to 1, descending (softmax of normal logits)."""
    z = np.sort(rng.standard_normal((n, k)), axis=1)[:, ::-1]
    w = np.exp(z - z.max(axis=1, keepdims=True))
    return (w / w.sum(axis=1, keepdims=True)).astype(np.float32)


def _config_field(config: object, *names: str) -> int:
    for n in names:
        v = config.get(n) if isinstance(config, dict) else getattr(config, n, None)
        if v is not None:
            return int(v)
    raise ValueError(f"routing config lacks {names[0]}")


def _as_list(x: object, n: int) -> list:
    if x is None:
        return [0] * n
    if hasattr(x, "tolist"):
        return list(x.tolist())
    return list(x)


class SyntheticRouter:
    """`Router(layer_idx, router_logits [T, E], ctx) -> (ids [T, k] int64 on the host, weights [T, k] float32)`.

    Ignores the logits' choice: ids come from the routing process, one stream per sequence
    (`ctx.seq_ids[t]`) holding every layer's memory; a token at position 0 starts its stream afresh.
    The ids never depend on the model, so a step's ids for ALL layers are drawn at once (`plan`),
    vectorised over layers, when the router first sees the step; the CUDA-graph decode step takes
    them as an input instead of calling the router per layer. Weights are the softmax of the
    model's logits over the chosen ids (normalised to 1), so outputs stay a function of the model.
    """

    def __init__(self, spec: str, num_layers: int, num_experts: int, top_k: int, seed: int = 0) -> None:
        self.spec = spec
        self.label = routing_label(spec)
        self.process = RoutingProcess(num_layers, num_experts, top_k, parse_spec(spec), seed)
        self._streams: dict[Hashable, StreamState] = {}
        self._step_key: tuple[tuple, tuple] | None = None
        self._step_ids = np.empty((0, num_layers, top_k), dtype=np.int64)  # [T, L, k] of the current step

    def forget(self, seq_id: Hashable) -> None:
        self._streams.pop(seq_id, None)

    def plan(self, seq_ids: list, positions: list) -> np.ndarray:
        """Draws one step: [T, L, k] int64 ids of every token for every layer (advances the streams)."""
        layers = np.arange(self.process.num_layers)
        out = np.empty((len(seq_ids), self.process.num_layers, self.process.top_k), dtype=np.int64)
        for i, (seq, pos) in enumerate(zip(seq_ids, positions)):
            state = self._streams.get(seq)
            if state is None or (pos == 0 and state.clock > 0):
                state = self._streams[seq] = self.process.new_state()
            out[i] = self.process.next(state, layers)
        self._step_key = (tuple(seq_ids), tuple(positions))
        self._step_ids = out
        return out

    def __call__(self, layer_idx: int, router_logits: torch.Tensor, ctx: object) -> tuple[torch.Tensor, torch.Tensor]:
        t = router_logits.shape[0]
        seq_ids = _as_list(getattr(ctx, "seq_ids", None), t)
        positions = _as_list(getattr(ctx, "positions", None), t)
        if (tuple(seq_ids), tuple(positions)) != self._step_key:  # a new step: draw all its layers
            self.plan(seq_ids, positions)
        ids = torch.from_numpy(np.ascontiguousarray(self._step_ids[:, layer_idx % self.process.num_layers]))  # [T, k]
        ids_dev = ids.pin_memory() if router_logits.device.type == "cuda" else ids
        ids_dev = ids_dev.to(router_logits.device, non_blocking=True)
        return ids, planned_weights(router_logits, ids_dev)  # ids on the host: the planner reads them with no sync


def planned_weights(router_logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """[T, E] logits, [T, k] chosen ids -> [T, k] float32 softmax over the chosen logits."""
    chosen = torch.gather(router_logits.float(), 1, ids)  # [T, k]
    return torch.softmax(chosen, dim=-1)


def make_router(spec: str, config: object, seed: int = 0) -> SyntheticRouter:
    """A synthetic router for a model config (needs num_experts and num_experts_per_tok / top_k)."""
    num_experts = _config_field(config, "num_experts", "num_local_experts", "n_routed_experts")
    top_k = _config_field(config, "num_experts_per_tok", "top_k")
    num_layers = _config_field(config, "num_moe_layers", "num_hidden_layers", "num_layers")
    return SyntheticRouter(spec, num_layers, num_experts, top_k, seed)


def synth_stream(process: RoutingProcess, num_tokens: int) -> np.ndarray:
    """[num_tokens, L, k] ids for one request stream over all layers of `process`."""
    state = process.new_state()
    layers = np.arange(process.num_layers)
    return np.stack([process.next(state, layers) for _ in range(num_tokens)])
