"""Synthetic qwen3moe GGUFs: a `paged_experts.synth` preset's shapes written straight to GGUF with
seeded random values, no checkpoint in between (the bf16 48-layer model would be 58 GB on disk).

Owns the generated values and the parallel streamed writer. Tensor names, order, types and the
metadata come from `gguf_export` (`plan_tensors`, `write_metadata`, `add_tensor_infos`), so the
layout is the one `export_gguf` writes for a checkpoint of that shape. Config and tokenizer are
`synth_memory.write_weightless`'s, with the vocabulary padded to the preset's `bpe_vocab_size`
(the vocabulary of `synth:PRESET?layers=N`, which the H200 decode benchmarks run).

Values, with the standard deviation sigma `paged_experts.synth` gives each tensor (`value_std`:
1/sqrt(H) for q/k/v and expert gate/up, 1/sqrt(I) for expert down, 2/sqrt(H) for the router, ...):
- Q8_0 expert blocks are generated directly, not quantized: each block's 32 int8 quants are
  drawn uniformly from LUT, the 256 midpoint quantiles of N(0, 1) scaled to +-127, and every
  block's fp16 scale is d = sigma / std(LUT). The dequantized values q * d then follow N(0,
  sigma^2) to 8 bits (tails cut at 2.9 sigma) with standard deviation sigma. Decode speed does
  not depend on the values; routing does, through the hidden states, so their scale matters.
- other matrices: BF16 (round to nearest even from f32) or F32 samples of N(0, sigma^2); norms
  F32 1 + 0.1 N(0, 1).
Chunk c of tensor t comes from its own generator seeded with (seed, t, c) over fixed-size chunks:
the bytes are a function of (preset, layers, seed, types) whatever the worker count. They are
not the values of `synth` or `synth_memory` models (other generators; Q8_0, not bf16).

Beside the file (`write_with_facts`, what `benchsuite gguf synth` runs): `<file>.json`, its facts
(preset, seed, shape, types, bytes per expert, how it was made), which the llamacpp adapter records
in the run's manifest, and `<file>.hf/`, the preset's weightless HF directory
(`synth_memory.write_weightless`: config.json and the tokenizer the GGUF's vocabulary comes from),
which the adapter uses to cut exact-length prompts, the same token ids every engine is sent.

Streaming: the header is written first, the file is extended to its final size, then worker
processes (numpy's gather holds the GIL, so threads do not scale) each generate one chunk of
<= CHUNK_BYTES at a time and `pwrite` it at its offset: memory stays ~3 chunks per worker.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from statistics import NormalDist
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

from benchsuite.engines.llamacpp.gguf_export import (
    ARCH,
    PlannedTensor,
    add_tensor_infos,
    plan_tensors,
    tokenizer_fields,
    write_metadata,
)
from benchsuite.errors import UserError

CHUNK_BYTES = 16 * 2**20
FACTS_SCHEMA_VERSION = 1
SHAPE_KEYS = (
    "num_hidden_layers", "hidden_size", "moe_intermediate_size", "num_experts", "num_experts_per_tok",
    "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
)  # fmt: skip
_SEED_TAG = 0x9E3779B9  # keeps these streams apart from other users of the same seed


def _q8_lut() -> np.ndarray:
    """[256] int8: midpoint quantiles of N(0, 1), the top one scaled to 127."""
    nd = NormalDist()
    top = nd.inv_cdf(255.5 / 256)
    return np.array([round(127 * nd.inv_cdf((k + 0.5) / 256) / top) for k in range(256)], dtype=np.int8)


LUT8 = _q8_lut()
# Two quants per uint16 index (little-endian pairs): one gather per two bytes is ~2x faster
# than a gather per byte.
_u8 = LUT8.view(np.uint8).astype(np.uint16)
_v = np.arange(65536, dtype=np.uint32)
LUT16 = (_u8[_v & 0xFF] | (_u8[_v >> 8] << 8)).astype(np.uint16).view(np.int16)
LUT_STD = float(LUT8.astype(np.float64).std())


@dataclass(frozen=True)
class SynthGguf:
    path: Path
    bytes: int  # file size
    layers: int
    seed: int
    expert_type: str
    dense_type: str
    expert_bytes: int  # one expert's gate + up + down
    num_tensors: int
    write_s: float
    workers: int
    shape: dict[str, int]  # the HF config's sizes (SHAPE_KEYS)


@dataclass(frozen=True)
class _Task:
    qtype: int
    kind: str  # "normal" or "norm"
    std: float
    key: tuple[int, ...]  # generator seed
    n_blocks: int
    offset: int  # bytes into the file


def synthetic_model(preset: str, layers: int | None, seed: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """(HF config, tokenizer fields) of the preset, vocab padded to the preset's bpe_vocab_size."""
    from paged_experts.synth import PRESETS
    from paged_experts.synth_memory import write_weightless

    if preset not in PRESETS:
        raise UserError(f"unknown preset {preset!r}; known: {sorted(PRESETS)}")
    with tempfile.TemporaryDirectory(prefix="gguf-synth-") as tmp:
        d = write_weightless(preset, Path(tmp), layers=layers, seed=seed)
        hf = json.loads((d / "config.json").read_text())
        hf["vocab_size"] = max(int(hf["vocab_size"]), PRESETS[preset].bpe_vocab_size)
        return hf, tokenizer_fields(d, hf)


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


def value_std(hf_name: str, hf: dict[str, Any]) -> tuple[str, float]:
    """(kind, sigma) of an HF tensor, as paged_experts.synth draws it."""
    h, inter = int(hf["hidden_size"]), int(hf["moe_intermediate_size"])
    if hf_name.endswith("norm.weight"):
        return "norm", 0.1
    if hf_name == "model.embed_tokens.weight":
        return "normal", 1.0
    if hf_name == "lm_head.weight":
        from paged_experts.synth import LOGIT_STD

        return "normal", LOGIT_STD / math.sqrt(h)
    if hf_name.endswith("o_proj.weight"):
        return "normal", 0.5 / math.sqrt(int(hf["num_attention_heads"]) * int(hf["head_dim"]))
    if hf_name.endswith("mlp.gate.weight"):
        # Router logits with std ~2: distinct, stable top-k choices.
        return "normal", 2 / math.sqrt(h)
    if hf_name.endswith("down_proj.weight"):
        return "normal", 1 / math.sqrt(inter)
    return "normal", 1 / math.sqrt(h)  # q/k/v, expert gate/up


def chunk_bytes(task: _Task) -> np.ndarray:
    """The bytes of one chunk: `task.n_blocks` blocks of `task.qtype`."""
    rng = np.random.Generator(np.random.PCG64DXSM(np.random.SeedSequence(task.key)))
    qtype = Q(task.qtype)
    if qtype == Q.Q8_0:
        # A 34-byte block is 17 int16: the fp16 scale, then 16 pairs of int8 quants.
        out = np.empty((task.n_blocks, 17), dtype=np.int16)  # [blocks, 17]
        out[:, 0] = np.float16(task.std / LUT_STD).view(np.int16)
        raw = rng.bit_generator.random_raw(task.n_blocks * 4)  # [blocks * 4] uint64
        idx = raw.view(np.uint16)  # [blocks * 16]
        out[:, 1:] = LUT16[idx].reshape(task.n_blocks, 16)
        return out
    values = rng.standard_normal(task.n_blocks, dtype=np.float32)  # [n] (block size 1)
    values *= np.float32(task.std)
    if task.kind == "norm":
        values += np.float32(1.0)
    if qtype == Q.F32:
        return values
    if qtype == Q.F16:
        return values.astype(np.float16)
    if qtype == Q.BF16:
        bits = values.view(np.uint32)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # to nearest even
        return rounded.astype(np.uint16)
    raise ValueError(f"unsupported tensor type {qtype.name}")


_FD: int | None = None


def _open_fd(path: str) -> None:
    global _FD
    _FD = os.open(path, os.O_WRONLY)


def _fill(task: _Task) -> int:
    data = memoryview(chunk_bytes(task)).cast("B")
    assert _FD is not None
    done = 0
    while done < len(data):  # pwrite may write less than asked
        done += os.pwrite(_FD, data[done:], task.offset + done)
    return done


def _tasks(planned: list[PlannedTensor], hf: dict[str, Any], data_start: int, alignment: int, seed: int) -> list[_Task]:
    """Every chunk of every tensor with its file offset (tensors aligned as GGUFWriter lays them out)."""
    tasks, offset = [], data_start
    for t_index, p in enumerate(planned):
        block_values, type_bytes = gguf.GGML_QUANT_SIZES[p.qtype]
        n_blocks = int(np.prod(p.shape)) // block_values
        per_chunk = max(1, CHUNK_BYTES // type_bytes)
        kind, std = value_std(p.sources[0], hf)
        for c, first in enumerate(range(0, n_blocks, per_chunk)):
            n = min(per_chunk, n_blocks - first)
            key = (_SEED_TAG, seed, t_index, c)
            tasks.append(_Task(int(p.qtype), kind, std, key, n, offset + first * type_bytes))
        offset += gguf.GGUFWriter.ggml_pad(p.nbytes, alignment)
    return tasks


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
) -> SynthGguf:
    """Write `out` (atomically: a temporary file in the same directory, renamed at the end)."""
    started = time.perf_counter()
    out = Path(out).expanduser()
    hf, fields = synthetic_model(preset, layers, seed)
    planned = plan_tensors(hf, synthetic_shapes(hf), dense_type, expert_type=expert_type)
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
        tasks = _tasks(planned, hf, data_start, writer.data_alignment, seed)
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
        dense_type=dense_type, expert_bytes=expert_bytes(planned, int(hf["num_experts"])), num_tensors=len(planned),
        write_s=time.perf_counter() - started, workers=n_workers, shape={k: int(hf[k]) for k in SHAPE_KEYS},
    )  # fmt: skip


def facts_path(gguf_path: Path) -> Path:
    return gguf_path.with_name(gguf_path.name + ".json")


def companion_dir(gguf_path: Path) -> Path:
    return gguf_path.with_name(gguf_path.name + ".hf")


def write_with_facts(
    out: str | Path, preset: str, layers: int | None, seed: int, workers: int | None, log: Any = sys.stderr
) -> dict[str, Any]:
    """The GGUF, its weightless HF directory and its facts file (written last: its presence says
    the other two are complete); returns the facts."""
    from benchsuite.machine import git_facts
    from paged_experts.synth_memory import write_weightless

    s = write_synthetic_gguf(out, preset=preset, layers=layers, seed=seed, workers=workers, log=log)
    hf_dir = write_weightless(preset, companion_dir(s.path), layers=s.layers, seed=seed)
    facts = {
        "schema_version": FACTS_SCHEMA_VERSION, "made_by": "benchsuite gguf synth", "path": str(s.path.resolve()),
        "bytes": s.bytes, "preset": preset, "layers": s.layers, "seed": seed, "shape": s.shape,
        "expert_type": s.expert_type.upper(), "dense_type": s.dense_type, "expert_bytes": s.expert_bytes,
        "num_tensors": s.num_tensors, "hf_dir": str(hf_dir.resolve()), "write_s": round(s.write_s, 2),
        "workers": s.workers, "git": git_facts(),
    }  # fmt: skip
    tmp = facts_path(s.path).with_name(f".{facts_path(s.path).name}.tmp")
    tmp.write_text(json.dumps(facts, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, facts_path(s.path))
    return facts


def read_facts(gguf_path: Path) -> dict[str, Any] | None:
    """The facts `write_with_facts` left beside a GGUF; None for any other GGUF (or an unreadable file)."""
    try:
        facts = json.loads(facts_path(gguf_path).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return facts if isinstance(facts, dict) and facts.get("schema_version") == FACTS_SCHEMA_VERSION else None


def _run_tasks(tasks: list[_Task], path: Path, workers: int, total: int, log: Any) -> None:
    started, done, next_report = time.perf_counter(), 0, 0.1
    if workers == 1:
        _open_fd(str(path))
        try:
            for t in tasks:
                done += _fill(t)
        finally:
            os.close(_FD)  # type: ignore[arg-type]
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
