"""The routing trace: on-disk format (docs/trace-format.md), writer, reader and SGLang import.

A trace records, for every engine step, which tokens belong to which request (the layout) and,
per MoE layer, the routed expert ids and weights of every token. One file, a zip holding a JSON
header and `.npy` arrays; ids are uint8 (E <= 256) or int16, weights float16 or absent.

Owns: `TraceMeta`, `Trace`, `TraceWriter` (what the built-in server's `--record-routing PATH`
uses), `read_trace` / `write_trace` / `save_trace` / `build_trace`, `import_sglang_routed_experts`
and `synthesize_trace`.
"""

from __future__ import annotations

import base64
import io
import json
import os
import time
import zipfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from paged_experts.routing.sources import RoutingProcess, random_weights, synth_stream
from paged_experts.routing.specs import RoutingParams, parse_spec, routing_label

FORMAT_NAME = "moe-routing-trace"


class Rows(Protocol):
    """[T, k] rows whose values numpy reads (`np.asarray`): an array, or a staged device copy (routing.record)."""

    @property
    def shape(self) -> tuple[int, ...]: ...


FORMAT_VERSION = 1


@dataclass(frozen=True)
class TraceMeta:
    num_layers: int  # MoE layers recorded (trace layer i is model layer layer_ids[i])
    num_experts: int
    top_k: int
    source: str  # "model" | "synthetic:<spec>" | "sglang"
    model: str = ""
    layer_ids: tuple[int, ...] = ()
    weights: str = "recorded"  # "recorded" | "absent" (SGLang returns ids only)
    created_unix_s: float = 0.0
    notes: str = ""

    @property
    def synthetic(self) -> bool:
        return self.source.startswith("synthetic")


@dataclass(frozen=True)
class Chunk:
    """The tokens of one request in one step: rows [row_start, row_start + num_tokens) of the arrays."""

    request: str
    row_start: int
    num_tokens: int


@dataclass(frozen=True)
class Trace:
    meta: TraceMeta
    steps: tuple[tuple[Chunk, ...], ...]  # per step, its chunks in token order
    ids: np.ndarray  # [N, L, k] int64, N = all tokens of all steps in order
    weights: np.ndarray | None  # [N, L, k] float32, None when meta.weights == "absent"
    step_row_start: np.ndarray = field(repr=False)  # [S + 1] row offsets of the steps

    @property
    def num_tokens(self) -> int:
        return int(self.ids.shape[0])

    def step_ids(self, step: int, layer: int) -> np.ndarray:
        """[T_step, k] expert ids of one step for one layer."""
        return self.ids[self.step_row_start[step] : self.step_row_start[step + 1], layer]

    def requests(self) -> dict[str, list[Chunk]]:
        """Per request, its chunks in step order (the request's own stream)."""
        out: dict[str, list[Chunk]] = {}
        for chunks in self.steps:
            for c in chunks:
                out.setdefault(c.request, []).append(c)
        return out


def _meta_from(config_or_meta: object, source: str, model: str) -> TraceMeta:
    if isinstance(config_or_meta, TraceMeta):
        return config_or_meta
    get = config_or_meta.get if isinstance(config_or_meta, dict) else lambda n, d=None: getattr(config_or_meta, n, d)

    def first(*names: str) -> Any:  # a config value, checked by int() below
        for n in names:
            v = get(n, None)
            if v is not None:
                return v
        raise ValueError(f"config has none of {names}")

    return TraceMeta(
        num_layers=int(first("num_moe_layers", "num_hidden_layers", "num_layers")),
        num_experts=int(first("num_experts", "num_local_experts", "n_routed_experts")),
        top_k=int(first("num_experts_per_tok", "top_k")),
        source=source,
        model=model or str(get("name", "") or get("_name_or_path", "") or get("model_type", "") or ""),
    )


class TraceWriter:
    """Collects steps in memory and writes the trace file on `close()` (atomically)."""

    def __init__(self, path: str | Path, config_or_meta: object, source: str = "model", model: str = "") -> None:
        self.path = Path(path)
        self.meta = _meta_from(config_or_meta, source, model)
        self._steps: list[list[tuple[str, int]]] = []
        self._rows: list[dict[int, list[tuple[Rows, Rows | None]]]] = []
        # per step, or None: a whole step's routing in one entry (observe_step_rows: a graphed decode step; its few
        # objects, not ~3 per layer, are what the server's heap holds until close)
        self._wholes: list[tuple[tuple[int, ...], Rows, Rows | None] | None] = []
        self._closed = False
        self._complete_layers: set[int] = set()  # layers of the last complete step
        self.dropped_steps = 0  # steps whose forward raised part-way

    def begin_step(self, layout: list[tuple[str, int]]) -> None:
        """Start a step: (request id, tokens of that request in this step), in token order."""
        self._finish_step()
        self._steps.append([(str(r), int(n)) for r, n in layout])
        self._rows.append({})
        self._wholes.append(None)

    def observe(self, layer: int, ids, weights) -> None:
        """Routed ids [T, k] and weights [T, k] (or None) of one MoE layer in the current step (read now)."""
        ids_np = _to_numpy(ids).astype(np.int64).reshape(-1, self.meta.top_k)
        w_np = None if weights is None else _to_numpy(weights).astype(np.float32).reshape(ids_np.shape)
        self.observe_rows(layer, ids_np, w_np)

    def observe_rows(self, layer: int, ids: Rows, weights: Rows | None) -> None:
        """`observe` of rows already shaped [T, k] (int64 ids, float32 weights) that may become arrays later:
        numpy arrays, or routing.record's staged device copies, read (`np.asarray`) only when the trace is
        written."""
        if not self._steps:
            raise RuntimeError("observe() before begin_step()")
        if (
            len(ids.shape) != 2
            or ids.shape[1] != self.meta.top_k
            or (weights is not None and weights.shape != ids.shape)
        ):
            raise ValueError(
                f"layer {layer}: routed rows {ids.shape} / weights {None if weights is None else weights.shape}, "
                f"want [T, {self.meta.top_k}] both"
            )
        if self._wholes[-1] is not None:
            raise ValueError(f"layer {layer}: this step's routing was already observed whole")
        self._rows[-1].setdefault(int(layer), []).append((ids, weights))

    def observe_step_rows(self, layer_ids: Sequence[int], ids: Rows, weights: Rows | None) -> None:
        """The current step's routing at once: ids [L, T, k] (int64) and weights the same (float32) or None, layer
        `layer_ids[i]` in row i; arrays or staged device copies, as `observe_rows` takes."""
        if not self._steps:
            raise RuntimeError("observe() before begin_step()")
        want = (len(layer_ids), ids.shape[1] if len(ids.shape) == 3 else -1, self.meta.top_k)
        if tuple(ids.shape) != want or (weights is not None and tuple(weights.shape) != want):
            raise ValueError(
                f"a step's routing {ids.shape} / weights {None if weights is None else weights.shape}, want "
                f"[{len(layer_ids)}, T, {self.meta.top_k}] both"
            )
        if self._rows[-1] or self._wholes[-1] is not None:
            raise ValueError("this step's routing was already observed")
        self._wholes[-1] = (tuple(int(layer) for layer in layer_ids), ids, weights)

    def _observed_rows(self) -> dict[int, int]:
        """The current step's observed layers -> their token rows."""
        whole = self._wholes[-1]
        if whole is not None:
            return dict.fromkeys(whole[0], whole[1].shape[1])
        return {layer: sum(p[0].shape[0] for p in parts) for layer, parts in self._rows[-1].items()}

    def _finish_step(self) -> None:
        if not self._steps:
            return
        tokens = sum(n for _, n in self._steps[-1])
        observed = self._observed_rows()
        for layer, got in observed.items():
            if got != tokens:  # each layer is observed whole, so a short layer is a bug, not a failed step
                raise ValueError(f"step {len(self._steps) - 1} layer {layer}: {got} token rows, layout says {tokens}")
        expected_layers = set(self.meta.layer_ids) or self._complete_layers or set(range(self.meta.num_layers))
        if not observed or not set(observed) >= expected_layers:
            # The step's forward raised before its last MoE layer (or never ran): its routing is
            # not a step any engine served, so it is dropped and counted; later steps are unaffected.
            self._steps.pop()
            self._rows.pop()
            self._wholes.pop()
            self.dropped_steps += int(bool(observed))
            return
        self._complete_layers = set(observed)

    def close(self) -> Path:
        if self._closed:
            return self.path
        self._finish_step()
        self._closed = True
        layer_ids = sorted({layer for step in self._rows for layer in step} |
                           {layer for whole in self._wholes if whole is not None for layer in whole[0]})  # fmt: skip
        if self.meta.layer_ids:
            layer_ids = list(self.meta.layer_ids)
        if len(layer_ids) != self.meta.num_layers and self._rows:
            # the model may have dense layers: the trace holds the MoE layers actually observed
            meta_layers = len(layer_ids)
        else:
            meta_layers = self.meta.num_layers
        k = self.meta.top_k
        n = sum(sum(c for _, c in s) for s in self._steps)
        ids = np.zeros((n, meta_layers, k), dtype=np.int64)
        weights = np.zeros((n, meta_layers, k), dtype=np.float32)
        have_weights = True
        row = 0
        for layout, per_layer, whole in zip(self._steps, self._rows, self._wholes):
            t = sum(c for _, c in layout)
            if whole is not None:  # [L, T, k] -> each layer's [T, k] parts
                step_ids, step_w = np.asarray(whole[1]), None if whole[2] is None else np.asarray(whole[2])
                per_layer = {
                    layer: [(step_ids[i], None if step_w is None else step_w[i])] for i, layer in enumerate(whole[0])
                }
            for li, layer in enumerate(layer_ids):
                parts = per_layer.get(layer)
                if parts is None:
                    if t:
                        raise ValueError(f"layer {layer} not observed in a step of {t} tokens")
                    continue
                ids[row : row + t, li] = np.concatenate([np.asarray(p[0]) for p in parts])
                if any(p[1] is None for p in parts):
                    have_weights = False
                else:
                    weights[row : row + t, li] = np.concatenate([np.asarray(p[1]) for p in parts])
            row += t
        meta = TraceMeta(**{
            **asdict(self.meta),
            "num_layers": meta_layers,
            "layer_ids": tuple(layer_ids) or tuple(range(meta_layers)),
            "weights": "recorded" if have_weights else "absent",
            "created_unix_s": self.meta.created_unix_s or time.time(),
        })  # fmt: skip
        write_trace(self.path, meta, self._steps, ids, weights if have_weights else None)
        return self.path

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self.close()


def _to_numpy(x) -> np.ndarray:
    if hasattr(x, "detach"):
        return x.detach().to("cpu").numpy()
    return np.asarray(x)


def _npy_bytes(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a, allow_pickle=False)
    return buf.getvalue()


def write_trace(
    path: str | Path,
    meta: TraceMeta,
    steps: Sequence[Sequence[tuple[str, int]]],
    ids: np.ndarray,
    weights: np.ndarray | None,
) -> None:
    """Write the zip (header.json, ids.npy, weights.npy?, step_chunks.npy, chunk_request.npy, chunk_tokens.npy)."""
    if ids.size and (ids.min() < 0 or ids.max() >= meta.num_experts):
        raise ValueError(f"expert ids outside [0, {meta.num_experts})")
    requests: list[str] = []
    index: dict[str, int] = {}
    chunk_request, chunk_tokens = [], []
    for layout in steps:
        for r, n in layout:
            if r not in index:
                index[r] = len(requests)
                requests.append(r)
            chunk_request.append(index[r])
            chunk_tokens.append(n)
    header = {"format": FORMAT_NAME, "version": FORMAT_VERSION, **asdict(meta), "requests": requests}
    header["layer_ids"] = list(meta.layer_ids)
    id_dtype = np.uint8 if meta.num_experts <= 256 else np.int16
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED) as z:
        z.writestr("header.json", json.dumps(header, indent=1))
        z.writestr("ids.npy", _npy_bytes(ids.astype(id_dtype)))
        if weights is not None:
            z.writestr("weights.npy", _npy_bytes(weights.astype(np.float16)))
        z.writestr("step_chunks.npy", _npy_bytes(np.array([len(s) for s in steps], dtype=np.int32)))
        z.writestr("chunk_request.npy", _npy_bytes(np.array(chunk_request, dtype=np.int32)))
        z.writestr("chunk_tokens.npy", _npy_bytes(np.array(chunk_tokens, dtype=np.int32)))
    os.replace(tmp, path)


def read_trace(path: str | Path) -> Trace:
    with zipfile.ZipFile(path) as z:
        header = json.loads(z.read("header.json"))
        if header.get("format") != FORMAT_NAME:
            raise ValueError(f"{path}: not a {FORMAT_NAME} file")
        if header.get("version") != FORMAT_VERSION:
            raise ValueError(f"{path}: trace version {header.get('version')}, this reader knows {FORMAT_VERSION}")

        def load(name: str) -> np.ndarray:
            return np.load(io.BytesIO(z.read(name)), allow_pickle=False)

        ids = load("ids.npy").astype(np.int64)
        weights = load("weights.npy").astype(np.float32) if "weights.npy" in z.namelist() else None
        step_chunks, chunk_request, chunk_tokens = (
            load("step_chunks.npy"),
            load("chunk_request.npy"),
            load("chunk_tokens.npy"),
        )
    requests = header.pop("requests")
    header.pop("format")
    header.pop("version")
    header["layer_ids"] = tuple(header.get("layer_ids", ()))
    layouts, c = [], 0
    for n_chunks in step_chunks.tolist():
        layouts.append([(requests[int(chunk_request[i])], int(chunk_tokens[i])) for i in range(c, c + n_chunks)])
        c += n_chunks
    return build_trace(TraceMeta(**header), layouts, ids, weights)


def build_trace(
    meta: TraceMeta, layouts: Sequence[Sequence[tuple[str, int]]], ids: np.ndarray, weights: np.ndarray | None
) -> Trace:
    """An in-memory Trace from per-step layouts and [N, L, k] arrays in token order."""
    steps, starts, row = [], [0], 0
    for layout in layouts:
        chunks = []
        for request, n in layout:
            chunks.append(Chunk(request=request, row_start=row, num_tokens=n))
            row += n
        steps.append(tuple(chunks))
        starts.append(row)
    if row != ids.shape[0]:
        raise ValueError(f"layout covers {row} tokens, ids hold {ids.shape[0]}")
    if ids.ndim != 3 or ids.shape[1:] != (meta.num_layers, meta.top_k):
        raise ValueError(f"ids shape {ids.shape} != [N, {meta.num_layers}, {meta.top_k}]")
    return Trace(meta=meta, steps=tuple(steps), ids=ids, weights=weights, step_row_start=np.array(starts))


def save_trace(trace: Trace, path: str | Path) -> None:
    layouts = [[(c.request, c.num_tokens) for c in step] for step in trace.steps]
    write_trace(path, trace.meta, layouts, trace.ids, trace.weights)


def synthesize_trace(
    spec: str,
    num_layers: int,
    num_experts: int,
    top_k: int,
    requests: int = 1,
    tokens_per_request: int = 256,
    prompt_tokens: int = 0,
    seed: int = 0,
    model: str = "",
    params: RoutingParams | None = None,
) -> Trace:
    """A single-stream (batch 1) synthetic trace: requests one after another, each an optional
    prefill chunk of `prompt_tokens` then `tokens_per_request` decode steps. Labelled synthetic."""
    process = RoutingProcess(num_layers, num_experts, top_k, params or parse_spec(spec), seed)
    rng = np.random.default_rng([seed, 3])
    layouts: list[list[tuple[str, int]]] = []
    parts = []
    for r in range(requests):
        parts.append(synth_stream(process, prompt_tokens + tokens_per_request, request=r))  # request id r
        name = f"synth-{r}"
        if prompt_tokens:
            layouts.append([(name, prompt_tokens)])
        layouts.extend([[(name, 1)]] * tokens_per_request)
    ids = np.concatenate(parts) if parts else np.zeros((0, num_layers, top_k), dtype=np.int64)
    weights = random_weights(rng, ids.shape[0] * num_layers, top_k).reshape(ids.shape)
    meta = TraceMeta(
        num_layers=num_layers,
        num_experts=num_experts,
        top_k=top_k,
        source=routing_label(spec),
        model=model,
        layer_ids=tuple(range(num_layers)),
        created_unix_s=time.time(),
        notes="synthetic routing (paged_experts.routing.sources); not measured from a model",
    )
    return build_trace(meta, layouts, ids, weights)


def _sglang_field(response: dict[str, Any], name: str) -> Any:  # a JSON value, checked by its caller
    """A field of a native /generate response (meta_info), an OpenAI response (sglext, usage, or the
    first choice's sglext) or a flat dict."""
    choice = (response.get("choices") or [{}])[0]
    holders = (response.get("meta_info"), response.get("sglext"), response.get("usage"), response,
               choice.get("sglext") if isinstance(choice, dict) else None)  # fmt: skip
    for holder in holders:
        if isinstance(holder, dict) and holder.get(name) is not None:
            return holder[name]
    return None


def import_sglang_routed_experts(
    requests: list[dict],
    num_experts: int,
    num_layers: int,
    top_k: int,
    model: str = "",
    moe_layer_ids: Sequence[int] | None = None,
) -> Trace:
    """Build a trace from SGLang responses made with `return_routed_experts: true`.

    SGLang 0.5.23 (server flag `--enable-return-routed-experts`) returns per request the base64 of
    int32 `[seq_len - 1 - start_len, num_hidden_layers, top_k]` (token positions
    `[routed_experts_start_len, seqlen - 1)`: the prompt, then every generated token but the last)
    in `meta_info.routed_experts` (native /generate) or `sglext.routed_experts` (OpenAI routes).
    The prompt becomes one prefill chunk and each generated token one decode step; requests follow
    one another (a batch-1 trace; the simulator regroups it). No weights are returned, so the trace
    stores none (`weights: "absent"`). `moe_layer_ids` keeps only those layers (dense layers hold no routing).
    """
    layouts: list[list[tuple[str, int]]] = []
    parts = []
    keep = list(moe_layer_ids) if moe_layer_ids is not None else list(range(num_layers))
    for i, response in enumerate(requests):
        encoded = _sglang_field(response, "routed_experts")
        if not isinstance(encoded, str):
            raise ValueError(f"response {i}: no routed_experts (server needs --enable-return-routed-experts,"
                             " the request return_routed_experts: true)")  # fmt: skip
        flat = np.frombuffer(base64.b64decode(encoded), dtype=np.int32)
        if flat.size % (num_layers * top_k):
            raise ValueError(f"response {i}: {flat.size} ids is not a multiple of layers {num_layers} x top_k {top_k}")
        ids = flat.reshape(-1, num_layers, top_k)[:, keep].astype(np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= num_experts):
            raise ValueError(f"response {i}: expert ids outside [0, {num_experts})")
        prompt = int(_sglang_field(response, "prompt_tokens") or 0)
        start = int(response.get("routed_experts_start_len", 0) or 0)
        prefill = min(max(prompt - start, 0), ids.shape[0])
        rid = str(_sglang_field(response, "id") or f"sglang-{i}")
        if prefill:
            layouts.append([(rid, prefill)])
        layouts.extend([[(rid, 1)]] * (ids.shape[0] - prefill))
        parts.append(ids)
    ids = np.concatenate(parts) if parts else np.zeros((0, len(keep), top_k), dtype=np.int64)
    meta = TraceMeta(
        num_layers=len(keep),
        num_experts=num_experts,
        top_k=top_k,
        source="sglang",
        model=model,
        layer_ids=tuple(keep),
        weights="absent",
        created_unix_s=time.time(),
        notes="imported from SGLang routed_experts; SGLang returns no routing weights",
    )
    return build_trace(meta, layouts, ids, None)
