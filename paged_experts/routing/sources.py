"""Synthetic routing sources: uniform, Zipf popularity, temporal reuse, and the calibrated
`qwen3-30b-a3b` preset (DESIGN.md section 8). Everything made with them is labelled
`synthetic:<spec>` (`routing_label`).

The generative model, per (request, layer) (the draws themselves: `routing_draw`):
- each of a token's k expert slots keeps its expert from the previous token with probability
  `keep_prob` (an epoch per slot that advances at rate 1 - keep_prob);
- a slot starting a new epoch takes, with probability `recency_mix`, the expert some slot held a
  power-law distance (delta^-`recency_alpha`) before (recent reuse), otherwise a draw from a
  popularity over a fixed per-layer permutation of experts: a working set of the first
  `working_set` x E experts holds `working_set_mass` of it, Zipf(`zipf_s`) inside, the rest is
  uniform over all E (defaults: working set = all experts, i.e. plain Zipf); a token's k experts
  are distinct;
- layers differ in temporal locality: layer l scales keep_prob and recency_mix by a strength
  lambda_l in [layer_strength_min, 1] (spread over layers with shape `layer_strength_gamma`),
  which is what spreads consecutive-token overlap over layers (published: 7.9%-59.7%); a layer
  with little reuse still routes mostly inside its working set (so it caches well at large K),
  except layers weaker than `working_set_knee`, whose working-set mass shrinks in proportion.

Draws are a pure function of (seed, request id, position, layer): a counter-based hash, no random
stream and no per-request state, so runs repeat exactly, a request's routing does not depend on its
batch-mates, and any token is drawn without its predecessors. The graphed decode step draws inside
its graph (`SyntheticRouter.draw_device`: one Triton kernel, routing/draw_triton.py) from the
request ordinals and positions in its inputs; an eager step (a prefill chunk) draws every layer of
its tokens at once on the model's device (`plan`: the same kernel on CUDA, on a stream of its own),
checks them there in one pass (`bad_ids`), and copies them to the host once (one wait per step, for
the draw alone: the host planner of paged prefill reads them, layers ahead of the device). Both
copies stay layer-major until the next step, so each layer takes its ids as two views (`PlannedIds`)
with no host work beyond the weights' two launches. On the CPU the torch draw (routing_draw.draw)
runs, ~1,300 small ops per call.

Memory and host time (Qwen3-30B-A3B: 48 layers, E = 128, k = 8): the device tables are 54 KB
(`DrawTables.nbytes`), a draw writes [T, 48, 8] int64 ids (3 KB a token: 6.3 MB for a 2,048-token
prompt, kept on the device and on the host until the next step; the torch draw off CUDA also holds
~12 temporaries of 256-token slices, ~24 MB). Host time per decode token: none (inside the graph);
per eager step: one kernel launch, one check, one copy back of its ids. The host generator of issue
29 drew each token of a stream in turn: ~0.4 ms a token, 0.8-1.0 s of a 2,048-token prompt's TTFT;
until 2026-12-03 each layer then sliced, checked (a sort of its [T, k] on the host), pinned and sent
its ids again: 56-68 ms of host time in a 2,048-token prompt on the H200 (`router_s`), 29-33 ms
after, 22.5 ms of which the draw kernel's (1.1 ms since its binary search). The H200 figures of the
draw come from tests/cuda/test_routing_draw_cuda.py, which prints them.

Owns `RoutingProcess` (the per-layer parameters and their draw
tables), `SyntheticRouter` (the `Router` callable the runtime's `router_override` takes),
`PlannedIds` (the ids it returns) and `bad_ids`, `make_router`; the specs (`RoutingParams`, presets,
`parse_spec`, `routing_label`) live in paged_experts.routing.specs.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from paged_experts.routing import draw_triton as routing_triton
from paged_experts.routing.draw import DrawTables, build_tables, draw
from paged_experts.routing.specs import RoutingParams, parse_spec, routing_label
from paged_experts.upload import to_device


def layer_strengths(num_layers: int, params: RoutingParams, seed: int = 0) -> np.ndarray:
    """[L] locality strength per layer, spread over [min, 1] and assigned to layers in a seeded order."""
    u = (np.arange(num_layers) + 0.5) / num_layers
    lam = params.layer_strength_min + (1.0 - params.layer_strength_min) * u**params.layer_strength_gamma
    return lam[np.random.default_rng([seed, 7]).permutation(num_layers)]


class RoutingProcess:
    """The generator for L layers: per-layer parameters, their draw tables, and `draw`."""

    def __init__(self, num_layers: int, num_experts: int, top_k: int, params: RoutingParams, seed: int = 0) -> None:
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, {num_experts}]")
        self.num_layers, self.num_experts, self.top_k = num_layers, num_experts, top_k
        self.params = params
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
        self.tables = build_tables(self.keep_prob, self.recency_mix, pop, params.recency_alpha, top_k, seed)

    def draw(self, requests: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """requests [T], positions [T] int64 -> [T, L, k] int64 ids, on the inputs' device."""
        return draw(self.tables.to(requests.device), requests, positions)


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


def _as_tuple(x: Any, n: int) -> tuple:  # x: None, a tensor or array, or a sequence (a tuple is kept as it is)
    if x is None:
        return (0,) * n
    if hasattr(x, "tolist"):
        return tuple(x.tolist())
    return tuple(x)


class SyntheticRouter:
    """`Router(layer_idx, router_logits [T, E], ctx) -> (PlannedIds: ids [T, k] int64 on the host and on the
    logits' device, weights [T, k] float32)`.

    Ignores the logits' choice: ids are the routing process's draws for each token's (request,
    position = `ctx.positions[t]`), the request being the ordinal of the sequence among those this
    router has seen start (`request_ids`: the n-th request routes alike whatever ids the KV pool
    gave it, whatever ran before or beside it). The ids never depend on the model, so a step's
    ids for ALL layers are drawn at once (`plan`) when the router first sees the step; the
    CUDA-graph decode step draws them inside its graph instead (`draw_device`). Weights are the
    softmax of the model's logits over the chosen ids (normalised to 1), so outputs stay a
    function of the model.
    """

    def __init__(self, spec: str, num_layers: int, num_experts: int, top_k: int, seed: int = 0) -> None:
        self.spec = spec
        self.label = routing_label(spec)
        self.process = RoutingProcess(num_layers, num_experts, top_k, parse_spec(spec), seed)
        self._tables: dict[torch.device, DrawTables] = {}
        self._requests: dict[Hashable, int] = {}  # live sequence -> its request ordinal
        self._streams: dict[torch.device, torch.cuda.Stream] = {}  # eager draws on CUDA
        self._next_request = 0
        self._step_key: tuple[tuple, tuple, torch.device] | None = None
        self._step_tokens: tuple[tuple, tuple] | None = None  # the last step's (seq_ids, positions), and:
        self._step_req = self._step_pos = torch.empty(0, dtype=torch.long)  # [T] its request ordinals, positions
        self._step_host = torch.empty(num_layers, 0, top_k, dtype=torch.long)  # [L, T, k] of the current step
        self._step_device = self._step_host  # [L, T, k] on the model's device

    def forget(self, seq_id: Hashable) -> None:
        """Drops a finished sequence's request ordinal (the server calls this when its KV is freed)."""
        self._requests.pop(seq_id, None)

    def request_ids(self, seq_ids: list, positions: list) -> list[int]:
        """Each token's request ordinal: a sequence not seen yet, or seen again at position 0
        in a later step (a new request), takes the next ordinal."""
        out = []
        in_step: set[Hashable] = set()  # a prefill chunk holds position 0 and the tokens after it
        for seq, pos in zip(seq_ids, positions):
            if seq not in in_step and (seq not in self._requests or int(pos) == 0):
                self._requests[seq] = self._next_request
                self._next_request += 1
            in_step.add(seq)
            out.append(self._requests[seq])
        return out

    def tables(self, device: torch.device) -> DrawTables:
        """The draw tables on `device` (copied there once; before any graph capture that reads them)."""
        if device not in self._tables:
            self._tables[device] = self.process.tables.to(device)
        return self._tables[device]

    def draw_device(self, requests: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """requests [B], positions [B] int64 on the device -> [B, L, k] ids there, with no host
        sync (graph-capturable): one Triton kernel on CUDA, the torch draw elsewhere."""
        tables = self.tables(requests.device)
        if requests.device.type == "cuda" and routing_triton.available():
            return routing_triton.draw(tables, requests, positions)
        return draw(tables, requests, positions)

    def plan(self, seq_ids: Sequence, positions: Sequence, device: torch.device | str = "cpu") -> torch.Tensor:
        """Draws one step on `device`, every layer of every token, checks it once (`bad_ids`) and keeps it
        layer-major on the device and on the host, so that a layer's ids are a contiguous [T, k] on both
        sides (`__call__`: no per-layer copy, check or host-to-device send). Returns the host's [T, L, k]."""
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:  # "cuda" names the current device: the key compares indices
            dev = torch.device("cuda", torch.cuda.current_device())
        tokens = (tuple(seq_ids), tuple(positions))
        if tokens != self._step_tokens:  # the same step drawn again (another device) keeps its request ordinals
            self._step_tokens = tokens
            self._step_req = torch.tensor(self.request_ids(list(seq_ids), list(positions)), dtype=torch.long)
            self._step_pos = torch.tensor([int(p) for p in positions], dtype=torch.long)
        req, pos = self._step_req, self._step_pos  # [T] each, on the host
        if dev.type == "cuda":  # on a stream of its own: the copy back waits for the draw, not the model's queue
            if dev not in self._streams:
                self._streams[dev] = torch.cuda.Stream(dev)
            stream, compute = self._streams[dev], torch.cuda.current_stream(dev)
            with torch.cuda.stream(stream):
                drawn = self.draw_device(to_device(req, dev), to_device(pos, dev))  # [T, L, k]
                on_device = drawn.transpose(0, 1).contiguous()  # [L, T, k]
                bad = bad_ids(on_device, self.process.num_experts)
                on_host = on_device.cpu()  # one kernel, one copy back per step
                invalid = bool(bad)
            compute.wait_stream(stream)  # the layers read on_device on the compute stream
            on_device.record_stream(compute)  # and may still, when the next step's draw frees it
        else:  # drawn on the host; another kind of device gets a copy of the draw
            on_host = self.draw_device(req, pos).transpose(0, 1).contiguous()  # [L, T, k]
            invalid = bool(bad_ids(on_host, self.process.num_experts))
            on_device = on_host if dev.type == "cpu" else on_host.to(dev)
        if invalid:  # the draw makes valid ids by construction (tests/test_routing_draw.py); never trusted blindly
            raise RuntimeError(f"synthetic router {self.spec!r} drew an expert id outside [0, E) or one twice")
        self._step_key = (*tokens, dev)
        self._step_host, self._step_device = on_host, on_device
        return on_host.transpose(0, 1)

    @property
    def step_ids(self) -> torch.Tensor:
        """[T, L, k] int64 ids of the last step drawn, on the host."""
        return self._step_host.transpose(0, 1)

    def __call__(self, layer_idx: int, router_logits: torch.Tensor, ctx: object) -> tuple[PlannedIds, torch.Tensor]:
        t = router_logits.shape[0]
        seq_ids = _as_tuple(getattr(ctx, "seq_ids", None), t)
        positions = _as_tuple(getattr(ctx, "positions", None), t)
        if (seq_ids, positions, router_logits.device) != self._step_key:  # a new step: draw all its layers
            self.plan(seq_ids, positions, router_logits.device)
        layer = layer_idx % self.process.num_layers
        ids = PlannedIds(self._step_host[layer], self._step_device[layer], self.process.num_experts)  # [T, k] each
        return ids, planned_weights(router_logits, ids.device)


class PlannedIds(NamedTuple):
    """One layer-step's ids from a router that drew and checked its whole step at once (`SyntheticRouter.plan`:
    in range, a token's k experts distinct), on both sides: the host copy for the planner, the device copy for
    the kernels. The layer takes them as they are (`MoeLayer.forward`): no check, read or copy per layer."""

    host: torch.Tensor  # [T, k] int64 on the host
    device: torch.Tensor  # [T, k] int64 on the model's device
    num_experts: int  # the E they were checked against (the layer refuses them for another E)


def bad_ids(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """ids [..., k] int64 -> a 0-dim bool on their device: whether some id is outside [0, num_experts) or some
    row names an expert twice (one sort over the last axis: one pass for a whole step on the GPU)."""
    ordered = ids.sort(dim=-1).values  # [..., k]
    outside = (ordered[..., :1] < 0).any() | (ordered[..., -1:] >= num_experts).any()
    return outside | (ordered[..., 1:] == ordered[..., :-1]).any()


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


def synth_stream(process: RoutingProcess, num_tokens: int, request: int = 0) -> np.ndarray:
    """[num_tokens, L, k] ids of one request's positions 0..num_tokens-1 over all layers of `process`."""
    req = torch.full((num_tokens,), request, dtype=torch.long)
    return process.draw(req, torch.arange(num_tokens)).numpy()
