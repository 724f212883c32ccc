"""Synthetic qwen3moe GGUFs: a `paged_experts.weights.synth` preset's shapes written straight to GGUF,
no checkpoint in between (the bf16 48-layer model would be 58 GB on disk), with the SAME weights
as the built-in engine's model of that preset, layers and seed.

Owns the parallel streamed writer. Tensor names, order, types and the metadata come from
`gguf_export` (`plan_tensors`, `write_metadata`, `add_tensor_infos`), so the layout is the one
`export_gguf` writes for a checkpoint of that shape. Config and tokenizer are
`synth_memory.write_weightless`'s: the tokenizer's own vocabulary (1,042 tokens), no padding.

Values are `paged_experts.weights.weightgen`'s source tensors (numpy side; the built-in engine computes
the same integers with torch): element j of a tensor is LUT[b_j] * 2**exponent with b_j a byte of
a counter hash, LUT the 256 int8 midpoint quantiles of N(0, 1). So:
- Q8_0 expert blocks are written directly: the 32 int8 quants ARE LUT[b_j], every block's fp16
  scale is 2**exponent, and the dequantized experts equal the built-in model's bf16 experts
  exactly (no quantization error: the values were chosen to be representable in both);
- BF16 / F16 / F32 matrices are the exact values (every one fits 8 significant bits); norms F32;
- beside Q8_0 experts the attention projections are Q8_0 by default, written the same way (exact), as
  `llama-quantize` types them in a Q8_0 file: 8-bit like the block-FP8 attention the built-in engine keeps
  (`attention_type` `bf16`: the layout before 2026-12-03, 0.85 GB more at Qwen3-30B-A3B's shape).
Chunk boundaries do not matter (a counter hash has no state): the bytes are a function of
(preset shape, layers, seed, types) whatever the worker count.

Beside the file (`write_with_facts`, what `benchsuite gguf synth` runs): `<file>.json`, its facts
(preset, seed, shape, types, bytes per expert, how it was made, and `source_weights`: the
fingerprint of the source tensors, `paged_experts.weights.weights_id`), which the llamacpp adapter records
in the run's manifest, and `<file>.hf/`, the preset's weightless HF directory
(`synth_memory.write_weightless`: config.json and the tokenizer the GGUF's vocabulary comes from),
which the adapter uses to cut exact-length prompts, the same token ids every engine is sent.

Streaming: the header is written first, the file is extended to its final size, then worker
processes (numpy's gather holds the GIL, so threads do not scale) each generate one chunk of
<= CHUNK_BYTES at a time and `pwrite` it at its offset: memory stays ~3 chunks per worker.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

from benchsuite.engines.llamacpp.gguf_export import (
    ARCH,
    PlannedTensor,
    add_tensor_infos,
    facts_path,
    plan_tensors,
    read_facts,
    tokenizer_fields,
    write_facts,
    write_metadata,
)

__all__ = ["facts_path", "read_facts", "write_synthetic_gguf", "write_with_facts"]
from benchsuite.errors import UserError
from paged_experts.weights import weightgen

CHUNK_BYTES = 16 * 2**20
SHAPE_KEYS = (
    "num_hidden_layers", "hidden_size", "moe_intermediate_size", "num_experts", "num_experts_per_tok",
    "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
)  # fmt: skip


LUT8 = np.asarray(weightgen.LUT, dtype=np.int8)
# Two quants per uint16 index (little-endian pairs): one gather per two bytes is ~2x faster
# than a gather per byte.
_u8 = LUT8.view(np.uint8).astype(np.uint16)
_v = np.arange(65536, dtype=np.uint32)
LUT16 = (_u8[_v & 0xFF] | (_u8[_v >> 8] << 8)).astype(np.uint16).view(np.int16)
LUT_STD = weightgen.LUT_STD


@dataclass(frozen=True)
class SynthGguf:
    path: Path
    bytes: int  # file size
    layers: int
    seed: int
    expert_type: str
    dense_type: str
    attention_type: str
    expert_bytes: int  # one expert's gate + up + down
    num_tensors: int
    write_s: float
    workers: int
    shape: dict[str, int]  # the HF config's sizes (SHAPE_KEYS)
    source_weights: dict[str, Any]  # weightgen.recipe_record: the source tensors' identity


@dataclass(frozen=True)
class _Task:
    qtype: int
    source: weightgen.SourceTensor
    seed: int
    start: int  # first element (flat, numpy order) of the source tensor
    n_blocks: int
    offset: int  # bytes into the file


def synthetic_model(
    preset: str, layers: int | None, seed: int
) -> tuple[dict[str, Any], dict[str, Any], tuple[int, ...]]:
    """(HF config, tokenizer fields, silent token ids) of the preset: the weightless directory's,
    vocabulary unpadded."""
    from paged_experts.weights.synth import PRESETS
    from paged_experts.weights.synth_memory import silent_ids, write_weightless

    if preset not in PRESETS:
        raise UserError(f"unknown preset {preset!r}; known: {sorted(PRESETS)}")
    with tempfile.TemporaryDirectory(prefix="gguf-synth-") as tmp:
        d = write_weightless(preset, Path(tmp), layers=layers, seed=seed)
        hf = json.loads((d / "config.json").read_text())
        return hf, tokenizer_fields(d, hf), silent_ids(d)


def synthetic_shapes(hf: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape for a qwen3_moe config (what a checkpoint's headers would say)."""
    h, inter, v = int(hf["hidden_size"]), int(hf["moe_intermediate_size"]), int(hf["vocab_size"])
    heads, kv, d = int(hf["num_attention_heads"]), int(hf["num_key_value_heads"]), int(hf["head_dim"])
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    for i in range(int(hf["num_hidden_layers"])):
        pre = f"model.layers.{i}"
        shapes |= {
            f"{pre}.input_layernorm.weight": (h,),
            f"{pre}.post_attention_layernorm.weight": (h,),
            f"{pre}.self_attn.q_proj.weight": (heads * d, h),
            f"{pre}.self_attn.k_proj.weight": (kv * d, h),
            f"{pre}.self_attn.v_proj.weight": (kv * d, h),
            f"{pre}.self_attn.o_proj.weight": (h, heads * d),
            f"{pre}.self_attn.q_norm.weight": (d,),
            f"{pre}.self_attn.k_norm.weight": (d,),
            f"{pre}.mlp.gate.weight": (int(hf["num_experts"]), h),
        }
        for e in range(int(hf["num_experts"])):
            ex = f"{pre}.mlp.experts.{e}"
            shapes |= {f"{ex}.gate_proj.weight": (inter, h), f"{ex}.up_proj.weight": (inter, h)}
            shapes[f"{ex}.down_proj.weight"] = (h, inter)
    shapes |= {"model.norm.weight": (h,), "lm_head.weight": (v, h)}
    return shapes


def chunk_bytes(task: _Task) -> np.ndarray:
    """The bytes of one chunk: `task.n_blocks` blocks of `task.qtype` from element `task.start`."""
    qtype = Q(task.qtype)
    block_values = gguf.GGML_QUANT_SIZES[qtype][0]
    idx = weightgen.indices_np(task.seed, task.source.name, task.start, task.n_blocks * block_values)
    if qtype == Q.Q8_0:
        # A 34-byte block is 17 int16: the fp16 scale, then 16 pairs of int8 quants.
        out = np.empty((task.n_blocks, 17), dtype=np.int16)  # [blocks, 17]
        # each block's scale: the tensor's power of two times its expert's (a block never spans two)
        block_factors = weightgen.group_factors(task.seed, task.source, task.start, task.n_blocks * 32, step=32)
        scales = np.float32(2.0**task.source.exponent) * block_factors  # [blocks], powers of two
        out[:, 0] = scales.astype(np.float16).view(np.int16)
        out[:, 1:] = LUT16[idx.view("<u2")].reshape(task.n_blocks, 16)
        # zero rows (the silent tokens' lm_head rows) as zero quants: rows are whole blocks (Q8_0
        # needs a row length that is a multiple of 32)
        for lo, hi in weightgen.zero_spans(task.source, task.start, task.n_blocks * 32):
            out[lo // 32 : hi // 32, 1:] = 0
        return out
    if task.source.group_numel or task.source.zero_rows:  # per-expert scales, zero rows: the values, then bits
        values = weightgen.values_np(task.seed, task.source, task.start, task.n_blocks)
        return _typed(values, qtype)
    return _typed_lut(task.source, qtype)[idx]


def _typed_lut(t: weightgen.SourceTensor, qtype: Q) -> np.ndarray:
    """[256] values of `t`'s LUT indices as `qtype` stores them (exact: every value fits bf16)."""
    return _typed(weightgen.lut_values(t), qtype)  # [256]


def _typed(values: np.ndarray, qtype: Q) -> np.ndarray:
    """float32 values (exact in bf16) as `qtype` stores them."""
    if qtype == Q.F32:
        return values
    if qtype == Q.F16:
        return values.astype(np.float16)
    if qtype == Q.BF16:
        return (values.view(np.uint32) >> 16).astype(np.uint16)  # exact, so truncation is the rounding
    raise ValueError(f"unsupported tensor type {qtype.name}")


_FD: int | None = None


def _open_fd(path: str) -> None:
    global _FD
    _FD = os.open(path, os.O_WRONLY)


def _fill(task: _Task) -> int:
    data = chunk_bytes(task).data.cast("B")  # the array's buffer as bytes (C-contiguous)
    assert _FD is not None
    done = 0
    while done < len(data):  # pwrite may write less than asked
        done += os.pwrite(_FD, data[done:], task.offset + done)
    return done


def _tasks(
    planned: list[PlannedTensor], sources: dict[str, weightgen.SourceTensor], data_start: int, alignment: int, seed: int
) -> list[_Task]:
    """Every chunk of every tensor with its file offset (tensors aligned as GGUFWriter lays them out)."""
    tasks, offset = [], data_start
    for p in planned:
        block_values, type_bytes = gguf.GGML_QUANT_SIZES[p.qtype]
        n_blocks = int(np.prod(p.shape)) // block_values
        per_chunk = max(1, CHUNK_BYTES // type_bytes) // 4 * 4  # whole hash counters per chunk
        src = sources[source_name(p)]
        for first in range(0, n_blocks, per_chunk):
            n = min(per_chunk, n_blocks - first)
            tasks.append(_Task(int(p.qtype), src, seed, first * block_values, n, offset + first * type_bytes))
        offset += gguf.GGUFWriter.ggml_pad(p.nbytes, alignment)
    return tasks


def source_name(p: PlannedTensor) -> str:
    """The weightgen tensor a planned GGUF tensor holds: its HF source, or the stacked experts."""
    if len(p.sources) == 1:
        return p.sources[0]
    layer, proj = p.sources[0].split(".")[2], p.sources[0].split(".")[-2]  # model.layers.{i}...{proj}_proj.weight
    return weightgen.expert_name(int(layer), proj.removesuffix("_proj"))


def expert_bytes(planned: list[PlannedTensor], num_experts: int) -> int:
    """Bytes of one expert's gate + up + down (layer 0's stacked tensors / E)."""
    layer0 = [p for p in planned if p.gguf_name.startswith("blk.0.ffn_") and "_exps." in p.gguf_name]
    return sum(p.nbytes for p in layer0) // num_experts


def write_synthetic_gguf(
    out: str | Path,
    preset: str = "qwen3-30b-a3b-shape",
    layers: int | None = None,
    seed: int = 0,
    expert_type: str = "q8_0",
    dense_type: str = "bf16",
    workers: int | None = None,
    log: Any = sys.stderr,
    attention_type: str | None = None,
) -> SynthGguf:
    """Write `out` (atomically: a temporary file in the same directory, renamed at the end). attention_type: the
    q/k/v/o projections' type; None: Q8_0 beside Q8_0 experts (as llama-quantize types a Q8_0 file), else
    `dense_type` (an all-f32 file stays all f32)."""
    started = time.perf_counter()
    if attention_type is None:
        attention_type = "q8_0" if expert_type == "q8_0" else dense_type
    out = Path(out).expanduser()
    hf, fields, silent = synthetic_model(preset, layers, seed)
    planned = plan_tensors(hf, synthetic_shapes(hf), dense_type, expert_type=expert_type, attention_type=attention_type)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    writer = gguf.GGUFWriter(tmp, ARCH)
    try:
        name = f"synth-{preset}-{hf['num_hidden_layers']}l-seed{seed}-{expert_type}"
        write_metadata(writer, name, hf, expert_type, fields)
        add_tensor_infos(writer, planned)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        assert writer.fout is not None
        data_start = gguf.GGUFWriter.ggml_pad(writer.fout[0].tell(), writer.data_alignment)
        writer.close()
        tasks = _tasks(planned, weightgen.by_name(hf, silent), data_start, writer.data_alignment, seed)
        total = data_start + sum(gguf.GGUFWriter.ggml_pad(p.nbytes, writer.data_alignment) for p in planned)
        free = shutil.disk_usage(out.parent).free
        if free < total:
            raise UserError(f"{out.parent}: {total / 1e9:.1f} GB needed for the GGUF, {free / 1e9:.1f} GB free")
        os.truncate(tmp, total)  # padding between tensors stays zero
        n_workers = max(1, min(workers or len(os.sched_getaffinity(0)), len(tasks)))
        _run_tasks(tasks, tmp, n_workers, total, log)
        os.replace(tmp, out)
    finally:
        writer.close()
        if tmp.exists():
            tmp.unlink()
    return SynthGguf(
        path=out, bytes=out.stat().st_size, layers=int(hf["num_hidden_layers"]), seed=seed, expert_type=expert_type,
        dense_type=dense_type, attention_type=attention_type,
        expert_bytes=expert_bytes(planned, int(hf["num_experts"])), num_tensors=len(planned),
        write_s=time.perf_counter() - started, workers=n_workers, shape={k: int(hf[k]) for k in SHAPE_KEYS},
        source_weights=weightgen.recipe_record(hf, seed, silent),
    )  # fmt: skip


def companion_dir(gguf_path: Path) -> Path:
    return gguf_path.with_name(gguf_path.name + ".hf")


def write_with_facts(
    out: str | Path,
    preset: str,
    layers: int | None,
    seed: int,
    workers: int | None,
    log: Any = sys.stderr,
    attention_type: str | None = None,
) -> dict[str, Any]:
    """The GGUF, its weightless HF directory and its facts file (written last: its presence says
    the other two are complete); returns the facts."""
    from benchsuite.tools.machine import git_facts
    from paged_experts.weights.synth_memory import write_weightless

    s = write_synthetic_gguf(
        out, preset=preset, layers=layers, seed=seed, workers=workers, log=log, attention_type=attention_type
    )
    hf_dir = write_weightless(preset, companion_dir(s.path), layers=s.layers, seed=seed)
    facts = {
        "made_by": "benchsuite gguf synth", "path": str(s.path.resolve()),
        "bytes": s.bytes, "preset": preset, "layers": s.layers, "seed": seed, "shape": s.shape,
        "expert_type": s.expert_type.upper(), "dense_type": s.dense_type,
        "attention_type": s.attention_type.upper(), "expert_bytes": s.expert_bytes,
        "num_tensors": s.num_tensors, "hf_dir": str(hf_dir.resolve()), "write_s": round(s.write_s, 2),
        "workers": s.workers, "git": git_facts().model_dump(mode="json"), "source_weights": s.source_weights,
        "random_weights": True,
    }  # fmt: skip
    write_facts(s.path, facts)
    return read_facts(s.path) or facts


def _run_tasks(tasks: list[_Task], path: Path, workers: int, total: int, log: Any) -> None:
    started, done, next_report = time.perf_counter(), 0, 0.1
    if workers == 1:
        _open_fd(str(path))
        try:
            for t in tasks:
                done += _fill(t)
        finally:
            if _FD is not None:  # set by _open_fd above
                os.close(_FD)
        return
    # spawn, not fork: a forked worker of a multi-threaded parent (torch's and aiohttp's threads in a
    # test process, the benchmark's own) can inherit a lock some other thread held and hang in it
    # (seen once in the test suite: a worker asleep on a futex, the pool waiting on it forever).
    # Workers import this module (numpy and gguf, no torch) and open their own fd.
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(workers, initializer=_open_fd, initargs=(str(path),)) as pool:
        for n in pool.imap_unordered(_fill, tasks, chunksize=1):
            done += n
            if done >= next_report * total:
                s = time.perf_counter() - started
                rate = f"{done / s / 1e9:.2f} GB/s"
                print(f"gguf: {done / 1e9:.2f}/{total / 1e9:.2f} GB in {s:.1f} s ({rate})", file=log, flush=True)
                while next_report * total <= done:
                    next_report += 0.1
