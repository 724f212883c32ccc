"""Command lines and output parsing of the llamacpp_h200 bench: pure functions, no processes.

Owns the llama-batched-bench and llama-fit-params argv, the cell records built from their output
and the reading of llama-fit-params' fitted arguments. The measuring loop and the JSON file live
in llamacpp_h200_bench.py; the metrics are defined in its docstring.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchsuite.engines.llamacpp.logs import parse_server_log

MIB = 2**20
_OT = re.compile(r'-ot\s+"([^"]*)"')
_NGL = re.compile(r"-ngl\s+(-?\d+)")
_LAYER = re.compile(r"blk\\?\.(\d+)\\?\.")
_WHOLE_LAYER_EXPERTS = "_(ch|)exps"  # how llama.cpp's fit pattern for a layer's experts ends
_RAW_KEEP = re.compile(
    r"buffer size|^\{\"n_kv_max|error|failed|llama_batched_bench:|out of memory"
    r"|Flash Attention|llama_perf_context_print",
    re.IGNORECASE,
)
RAW_MAX_CHARS = 6000


@dataclass(frozen=True)
class Config:
    """One llama-batched-bench launch; its cells (one per batch size) share the command."""

    n_cpu_moe: int
    label: str
    model_args: tuple[str, ...]  # -ngl ... and --n-cpu-moe N, or the fit's -ngl ... -ot ...


@dataclass(frozen=True)
class Shape:
    """What every launch measures: -c, -npp, -ntg, the batch sizes, -t and extra args."""

    ctx: int
    prompt_tokens: int
    gen_tokens: int
    batches: tuple[int, ...]
    threads: int
    extra: tuple[str, ...] = ()


@dataclass(frozen=True)
class Fitted:
    ngl: int | None
    overrides: tuple[str, ...]  # "pattern=BUFT" as llama-fit-params prints them
    host_layers: tuple[int, ...]  # layers with any tensor overridden to CPU
    # Of those, layers overridden by another pattern than the whole-layer expert one (llama.cpp's
    # partial overflow: some of the layer's FFN tensors stay on the GPU).
    partial_layers: tuple[int, ...]


def n_cpu_moe_config(n: int, ngl: int) -> Config:
    return Config(n, f"N={n}", ("-ngl", str(ngl), "--n-cpu-moe", str(n)))


def batched_argv(bin_dir: Path, gguf: Path, shape: Shape, cfg: Config) -> list[str]:
    # -npl 1,4,1,4: a warmup pass over the batch sizes, then the measured one.
    npl = ",".join(str(b) for _ in range(2) for b in shape.batches)
    return [
        str(bin_dir / "llama-batched-bench"), "-m", str(gguf), "-c", str(shape.ctx), "-kvu",
        "-npp", str(shape.prompt_tokens), "-ntg", str(shape.gen_tokens), "-npl", npl, *cfg.model_args,
        "-t", str(shape.threads), "--output-format", "jsonl", "-lv", "4", *shape.extra,
    ]  # fmt: skip


def fit_argv(bin_dir: Path, gguf: Path, shape: Shape, fit_target_mib: int) -> list[str]:
    """llama.cpp's fitting (no -ngl / -ot given, so it chooses them) for this context and -np.

    llama-fit-params takes no -kvu: it projects -c cells split over -np streams, the same KV bytes.
    """
    return [
        str(bin_dir / "llama-fit-params"), "-m", str(gguf), "-c", str(shape.ctx),
        "-np", str(max(shape.batches)), "--fit-target", str(fit_target_mib), "-lv", "4", *shape.extra,
    ]  # fmt: skip


def parse_fit_args(stdout: str, num_layers: int | None = None) -> Fitted:
    """`-c 1024 -ngl 49 -ot "blk\\.40\\.ffn_(gate|gate_up|down).*=CPU,..."` -> Fitted.

    llama-fit-params counts the output layer as block `n_layer` and may emit an override for that
    block, which matches no tensor: blocks >= `num_layers` are not host layers (the override itself
    is kept: the arguments run unchanged)."""
    ngl = int(m.group(1)) if (m := _NGL.search(stdout)) else None
    ot = _OT.search(stdout)
    overrides = tuple(x for x in (ot.group(1).split(",") if ot else []) if x)
    host, partial = set(), set()
    for o in overrides:
        pattern, _, buft = o.rpartition("=")
        layer = _LAYER.search(pattern)
        if layer and buft.upper().startswith("CPU") and (num_layers is None or int(layer.group(1)) < num_layers):
            host.add(int(layer.group(1)))
            if not pattern.endswith(_WHOLE_LAYER_EXPERTS):
                partial.add(int(layer.group(1)))
    return Fitted(ngl, overrides, tuple(sorted(host)), tuple(sorted(partial)))


def fit_config(fitted: Fitted, budget_gb: float, default_ngl: int, use_fit_ngl: bool) -> Config:
    """The fitted arguments unchanged; N = layers with expert tensors on the host."""
    ngl = fitted.ngl if use_fit_ngl and fitted.ngl is not None and fitted.ngl >= 0 else default_ngl
    ot = ("-ot", ",".join(fitted.overrides)) if fitted.overrides else ()
    n = len(fitted.host_layers)
    part = f", {len(fitted.partial_layers)} of them partly" if fitted.partial_layers else ""
    return Config(n, f"fit {budget_gb:g} GB (N={n}{part})", ("-ngl", str(ngl), *ot))


def parse_rows(text: str) -> list[dict[str, Any]]:
    """batched-bench's `--output-format jsonl` rows, in output order."""
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith('{"n_kv_max"'):
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


def gpu_buffer_bytes(text: str) -> int | None:
    """Sum of the CUDA* buffers llama.cpp logs at load (model, KV, compute, output); None if none."""
    buffers = parse_server_log(text).get("buffers_mib", {})
    mib = [v for per_dev in buffers.values() for dev, v in per_dev.items() if dev.upper().startswith("CUDA")]
    return round(sum(mib) * MIB) if mib else None


def cells_from_output(cfg: Config, shape: Shape, argv: list[str], text: str, rc: int | None) -> list[dict[str, Any]]:
    """One cell per batch size from the process output; a missing row is an error, never a 0."""
    rows = parse_rows(text)
    kept = [line for line in text.splitlines() if _RAW_KEEP.search(line) and "llama_model_loader: -" not in line]
    raw = "\n".join(kept)[-RAW_MAX_CHARS:]
    gpu = gpu_buffer_bytes(text)
    cells = []
    for batch in shape.batches:
        cell: dict[str, Any] = {
            "n_cpu_moe": cfg.n_cpu_moe, "label": cfg.label, "batch": batch, "tok_per_s": None,
            "gpu_mem_bytes": gpu, "prompt_tokens": shape.prompt_tokens, "gen_tokens": shape.gen_tokens,
            "command": argv, "raw": raw,
        }  # fmt: skip
        mine = [r for r in rows if int(r.get("pl", -1)) == batch]
        if mine:
            measured = mine[-1]  # the earlier row of this batch size was the warmup
            cell |= {"tok_per_s": float(measured["speed_tg"]), "decode_s": float(measured["t_tg"])}
            if len(mine) > 1:
                cell["warmup_tok_per_s"] = float(mine[0]["speed_tg"])
        else:
            tail = "\n".join(text.splitlines()[-25:])
            cell["error"] = f"no result row for batch {batch} (exit status {rc})\n{tail}"
        cells.append(cell)
    return cells


def skipped_cells(cfg: Config, shape: Shape, argv: list[str], why: str) -> list[dict[str, Any]]:
    cells = cells_from_output(cfg, shape, argv, "", None)
    for c in cells:
        c["error"] = f"skipped: {why}"
    return cells
