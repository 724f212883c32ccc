"""Graphed decode checked against eager decode, telling a routing near-tie flip from a bug.

A generated model's bf16 router logits often sit 1-2 ulps apart at the top-k boundary, so any
rounding-level difference between the graphed step's kernels and eager's (compiled fusion, Triton
attention) can route a token to another expert; with greedy feedback that sequence then diverges
completely. A plain output tolerance cannot tell that from a bug, so `check_graphed_decode`:
- decodes greedily with the eager model, recording every MoE layer's routed ids and router logits;
- decodes with the graphed model TEACHER-FORCED on eager's tokens (a divergence cannot come from a
  different token), its graphed steps tracing their routed ids (`GraphedDecoder.trace`);
- finds each sequence's first step whose id sets differ at some layer (its flip) and requires a
  near-tie in eager's logits there, else raises;
- compares every output of a sequence before its flip within the relative tolerance; after its
  flip the sequence's KV differs legitimately and nothing of it is compared.
Works on CPU too (the static step runs uncaptured there).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from paged_experts.kv import KvPool
from paged_experts.model import MoeCausalLM, SeqChunk
from paged_experts.moe import StepContext
from paged_experts.moe.layer import MoeLayer

MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}
Route = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # x [T, H] -> ids [T, k], weights [T, k]
NextTokens = Callable[[int, list[torch.Tensor]], list[int]]  # (decode step, last outputs) -> tokens to feed


@dataclass(frozen=True)
class LayerRouting:
    """One MoE layer's routing of one eager step's T token rows (CPU tensors)."""

    ids: torch.Tensor  # [T, k] routed expert ids, sorted per row
    top: torch.Tensor | None  # [T, k+1] largest router logits, descending, model dtype; None: an override routed
    amax: torch.Tensor | None  # [T] largest |logit| of each row (sets its ulp)


@dataclass(frozen=True)
class Decoded:
    prefill: list[torch.Tensor]  # [1, V] fp32 per sequence
    steps: list[list[torch.Tensor]]  # [step][sequence] -> [1, V] fp32
    tokens: list[list[int]]  # [step][sequence]: the token fed at that decode step


@dataclass(frozen=True)
class Flip:
    """A sequence's first decode step whose routed id sets differ, explained by a near-tie."""

    step: int
    seq: int
    layer: int
    margin_ulps: float  # eager's k-th minus (k+1)-th logit, in ulps of the row's largest |logit|
    eager_ids: tuple[int, ...]
    graphed_ids: tuple[int, ...]


@dataclass(frozen=True)
class GraphCheck:
    checked: int  # outputs compared: every prefill output, decode outputs before their sequence's flip
    skipped: int  # decode outputs at or after their sequence's flip
    flips: tuple[Flip, ...]
    worst: float  # worst relative difference among the checked outputs
    worst_skipped: float  # ... among the skipped ones: what a plain tolerance would have tripped on


def ulp(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Spacing of `dtype` values at |v| (fp32 tensor of v's shape)."""
    mag = v.float().abs().clamp(min=torch.finfo(dtype).tiny)
    return torch.exp2(torch.floor(torch.log2(mag)) - MANTISSA_BITS[dtype])


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """|a - b| max over |b| max (at least 1): the CUDA tests' measure."""
    return ((a - b).abs().max() / b.abs().max().clamp(min=1)).item()


@contextmanager
def record_routing(model: MoeCausalLM) -> Iterator[list[list[LayerRouting]]]:
    """Yields [forward][layer] routings, filled as `model` runs. Ids come from a routing observer
    (it also sees a router override's ids); logits from wrapping each layer's `route_on_device`,
    which computes them as `F.linear(x, router_weight)`, in the model dtype."""
    steps: list[list[LayerRouting]] = []
    pending: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    k = model.config.top_k

    def wrap(moe: MoeLayer, route: Route) -> Route:
        def route_on_device(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            logits = F.linear(x, moe.router_weight)  # [T, E]
            pending[moe.layer_idx] = (logits.topk(k + 1, dim=-1).values.cpu(), logits.abs().amax(-1).cpu())
            return route(x)

        return route_on_device

    def observe(layer_idx: int, ids: torch.Tensor, weights: torch.Tensor, ctx: StepContext) -> None:
        if layer_idx == 0:  # a forward's first layer opens its record
            steps.append([])
        top, amax = pending.pop(layer_idx, (None, None))
        steps[-1].append(LayerRouting(ids.cpu().sort(dim=-1).values, top, amax))

    layers = model.moe_layers
    for moe in layers:
        moe.route_on_device = wrap(moe, moe.route_on_device)  # type: ignore[method-assign, assignment]
    model.routing_observers.append(observe)
    try:
        yield steps
    finally:
        model.routing_observers.remove(observe)
        for moe in layers:
            del moe.route_on_device  # the instance attribute: the class's method shows again


def _decode(model: MoeCausalLM, prompts: Sequence[Sequence[int]], steps: int, next_tokens: NextTokens) -> Decoded:
    pool = KvPool.for_model(model, capacity_tokens=512)
    seqs = [pool.new_sequence() for _ in prompts]
    last = model.forward([SeqChunk(s, list(p), 0) for s, p in zip(seqs, prompts)])
    prefill = list(last)
    outs: list[list[torch.Tensor]] = []
    fed: list[list[int]] = []
    for step in range(steps):
        tokens = next_tokens(step, last)
        last = model.forward([SeqChunk(s, [t], s.num_tokens) for s, t in zip(seqs, tokens)])
        outs.append(list(last))
        fed.append(tokens)
    return Decoded(prefill, outs, fed)


def decode_greedy(model: MoeCausalLM, prompts: Sequence[Sequence[int]], steps: int) -> Decoded:
    """Each sequence fed its own argmax (mod 1000, as the CUDA tests' `decode`)."""
    return _decode(model, prompts, steps, lambda _, last: [int(lg[-1].argmax()) % 1000 for lg in last])


def decode_forced(model: MoeCausalLM, prompts: Sequence[Sequence[int]], tokens: list[list[int]]) -> Decoded:
    """Each decode step fed `tokens[step]` (another run's tokens), whatever this model predicts."""
    return _decode(model, prompts, len(tokens), lambda step, _: tokens[step])


def find_flips(
    eager: list[list[LayerRouting]], trace: list[torch.Tensor], dtype: torch.dtype, tie_ulps: float
) -> dict[int, Flip]:
    """Each sequence's first decode step whose id sets differ at some layer (eager [step][layer],
    trace [step] -> [layers, B, k]); raises where eager's logits show no near-tie at the first
    differing layer."""
    flips: dict[int, Flip] = {}
    k = trace[0].shape[-1]
    for step, (layers, graphed) in enumerate(zip(eager, trace)):
        graphed = graphed.sort(dim=-1).values  # [layers, B, k]
        for seq in range(graphed.shape[1]):
            differ = [i for i, lr in enumerate(layers) if not torch.equal(lr.ids[seq], graphed[i, seq])]
            if seq in flips or not differ:
                continue
            layer = differ[0]  # later layers of this step may differ as its consequence
            lr = layers[layer]
            margin = math.inf
            if lr.top is not None and lr.amax is not None:
                margin = ((lr.top[seq, k - 1].float() - lr.top[seq, k].float()) / ulp(lr.amax[seq], dtype)).item()
            eager_ids, graphed_ids = tuple(lr.ids[seq].tolist()), tuple(graphed[layer, seq].tolist())
            if not margin <= tie_ulps:
                raise AssertionError(
                    f"decode step {step}, sequence {seq}, layer {layer}: graphed routed {graphed_ids}, eager "
                    f"{eager_ids}, with a top-k margin of {margin:.2f} ulps (> {tie_ulps}): not a near-tie"
                )
            flips[seq] = Flip(step, seq, layer, margin, eager_ids, graphed_ids)
    return flips


def check_graphed_decode(
    eager_model: MoeCausalLM,
    graphed_model: MoeCausalLM,
    prompts: Sequence[Sequence[int]],
    steps: int,
    *,
    rel_tol: float = 5e-2,
    tie_ulps: float = 4.0,
    min_checked: float = 0.5,
) -> GraphCheck:
    """`graphed_model` (its `enable_cuda_graphs` called, every decode step's batch size graphed)
    against `eager_model` of the same weights and runtime; raises AssertionError on a flip that is
    no near-tie, an output outside `rel_tol` before its sequence's flip, or fewer than
    `min_checked` of the decode outputs checked."""
    graphs = graphed_model.decode_graphs
    assert graphs is not None, "enable_cuda_graphs on the graphed model first"
    with record_routing(eager_model) as routing:
        eager = decode_greedy(eager_model, prompts, steps)
    assert len(routing) == steps + 1, f"eager routing recorded for {len(routing)} of {steps + 1} forwards"
    graphs.trace = []
    try:
        graphed = decode_forced(graphed_model, prompts, eager.tokens)
        trace = [t.cpu() for t in graphs.trace]
    finally:
        graphs.trace = None  # a failed step leaves the model untraced, as it was
    assert len(trace) == steps, f"{len(trace)} of {steps} decode steps ran graphed"
    flips = find_flips(routing[1:], trace, graphed_model.runtime.torch_dtype, tie_ulps)  # [0]: the prefill
    checked = [(f"prefill of sequence {i}", a, b) for i, (a, b) in enumerate(zip(graphed.prefill, eager.prefill))]
    worst_skipped = 0.0
    for step, (outs, want) in enumerate(zip(graphed.steps, eager.steps)):
        for seq, (a, b) in enumerate(zip(outs, want)):
            if seq not in flips or step < flips[seq].step:
                checked.append((f"decode step {step} of sequence {seq}", a, b))
            else:
                worst_skipped = max(worst_skipped, relative_difference(a, b))
    worst = 0.0
    for name, a, b in checked:
        diff = relative_difference(a, b)
        assert diff <= rel_tol, f"{name}: relative difference {diff:.3g} > {rel_tol} before any routing flip"
        worst = max(worst, diff)
    decode_outputs = steps * len(prompts)
    skipped = decode_outputs - (len(checked) - len(prompts))
    assert skipped <= (1 - min_checked) * decode_outputs, (
        f"only {decode_outputs - skipped} of {decode_outputs} decode outputs checked (flips: {list(flips.values())})"
    )
    return GraphCheck(len(checked), skipped, tuple(flips.values()), worst, worst_skipped)
