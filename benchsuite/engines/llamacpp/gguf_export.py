"""GGUF export of a paged_experts (HF Qwen3-MoE) checkpoint, so llama.cpp runs the same model.

Owns the HF -> GGUF tensor-name mapping for architecture `qwen3moe`, the per-tensor type rules,
the metadata keys llama.cpp reads for that architecture, the tokenizer as a gpt2-style byte-level
BPE (pre-tokenizer "qwen2"), and a per-user cache of exports (`cached_export`).

Tensor rules (numpy order, i.e. the reverse of ggml's `ne`):
- per-expert HF weights `model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight` are stacked
  into `blk.{i}.ffn_{gate,up,down}_exps.weight`: gate/up `[E, I, H]`, down `[E, H, I]`;
- 1-D tensors (norms) and the router `ffn_gate_inp` stay F32 whatever the type (upcasts are exact);
- `f32`, `f16`, `bf16`: the cast of the stored values (byte-identical when the checkpoint is stored
  in that dtype); `q8_0`: gguf's reference quantizer, F16 for rows not a multiple of 32 values;
- block-FP8 checkpoints (paged_experts/fp8.py): every FP8 weight is dequantized with its
  `weight_scale_inv` first (the scales themselves are not tensors of the GGUF), so `--type q8_0`
  is the FP8 model's values at matched bytes (Q8_0: 34 bytes per 32 weights; FP8: 1 byte per
  weight plus a float32 per 128 x 128 block).

The writer streams: tensor infos are planned from the safetensors headers, then each tensor is
loaded, converted and written in turn, so a checkpoint larger than RAM exports too.
`plan_tensors`, `write_metadata` and `add_tensor_infos` are shared with `gguf_synth`, which writes
the same layout from generated values instead of a checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

from benchsuite.errors import UserError

if TYPE_CHECKING:
    import torch

ExportType = Literal["f32", "f16", "bf16", "q8_0"]
EXPORT_TYPES: tuple[str, ...] = get_args(ExportType)
ARCH = "qwen3moe"
EXPORT_FORMAT_VERSION = 1  # part of the cache key: bump when the bytes written change
FACTS_SCHEMA_VERSION = 2  # the facts file beside a GGUF; 2: `source_weights` (weightgen values, unpadded vocabulary)

_MAIN_QTYPE = {"f32": Q.F32, "f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0}
_NUMPY_DTYPE = {Q.F32: np.float32, Q.F16: np.float16, Q.BF16: np.uint16, Q.Q8_0: np.uint8}
_FILE_TYPE = {
    "f32": gguf.LlamaFileType.ALL_F32,
    "f16": gguf.LlamaFileType.MOSTLY_F16,
    "bf16": gguf.LlamaFileType.MOSTLY_BF16,
    "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
}
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
}
_ATTENTION_PROJ = tuple(f"self_attn.{p}_proj.weight" for p in "qkvo")
_EXPERT_PROJ = {
    "gate_proj": "ffn_gate_exps",
    "up_proj": "ffn_up_exps",
    "down_proj": "ffn_down_exps",
}
_ALWAYS_F32_SUFFIXES = ("ffn_gate_inp.weight",)
_TOKEN_NORMAL, _TOKEN_CONTROL, _TOKEN_USER_DEFINED, _TOKEN_UNUSED = 1, 3, 4, 5


@dataclass(frozen=True)
class PlannedTensor:
    gguf_name: str
    shape: tuple[int, ...]  # numpy order, elements (the stacked shape for experts)
    qtype: Q
    sources: tuple[str, ...]  # HF names; several are stacked along a new first axis

    @property
    def nbytes(self) -> int:
        block_size, type_size = gguf.GGML_QUANT_SIZES[self.qtype]
        return int(np.prod(self.shape)) // block_size * type_size


@dataclass(frozen=True)
class ExportSummary:
    path: Path
    export_type: str
    num_tensors: int
    tensor_bytes: int


class _Checkpoint:
    """Lazy view of a (possibly sharded) safetensors checkpoint: names, shapes, dtypes, tensors."""

    def __init__(self, model_dir: Path) -> None:
        from safetensors import safe_open

        index = model_dir / "model.safetensors.index.json"
        if index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        else:
            files = [p.name for p in sorted(model_dir.glob("*.safetensors"))]
        if not files:
            raise UserError(f"{model_dir}: no safetensors weights")
        self._handles = [safe_open(str(model_dir / f), framework="pt") for f in files]
        self.where: dict[str, Any] = {}
        for handle in self._handles:
            for name in handle.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                self.where[name] = handle

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.where[name].get_slice(name).get_shape())

    def tensor(self, name: str) -> torch.Tensor:
        return self.where[name].get_tensor(name)


def _qtype_for(gguf_name: str, shape: tuple[int, ...], export_type: str) -> Q:
    if len(shape) == 1 or gguf_name.endswith(_ALWAYS_F32_SUFFIXES):
        return Q.F32
    qtype = _MAIN_QTYPE[export_type]
    if qtype == Q.Q8_0 and shape[-1] % gguf.GGML_QUANT_SIZES[Q.Q8_0][0] != 0:
        return Q.F16
    return qtype


def plan_tensors(
    hf: Mapping[str, Any],
    shapes: Mapping[str, tuple[int, ...]],
    export_type: str,
    expert_type: str | None = None,
    attention_type: str | None = None,
) -> list[PlannedTensor]:
    """Every GGUF tensor in file order, from the HF config and the checkpoint's tensor shapes.

    `expert_type` (default: `export_type`) types the stacked expert tensors alone, e.g. Q8_0
    experts next to BF16 embeddings; `attention_type` (default: `export_type`) the q, k, v and o projections.
    """
    layers, experts = int(hf["num_hidden_layers"]), int(hf["num_experts"])
    planned: list[PlannedTensor] = []

    def add(gguf_name: str, sources: tuple[str, ...], tensor_type: str = export_type) -> None:
        missing = [s for s in sources if s not in shapes]
        if missing:
            raise UserError(f"checkpoint lacks {missing[0]} (needed for {gguf_name})")
        first = shapes[sources[0]]
        if any(shapes[s] != first for s in sources):
            raise UserError(f"{gguf_name}: stacked tensors differ in shape")
        shape = (len(sources), *first) if len(sources) > 1 else first
        planned.append(PlannedTensor(gguf_name, shape, _qtype_for(gguf_name, shape, tensor_type), sources))

    add("token_embd.weight", ("model.embed_tokens.weight",))
    for i in range(layers):
        for hf_suffix, gguf_suffix in _LAYER_NAMES.items():
            kind = (attention_type or export_type) if hf_suffix in _ATTENTION_PROJ else export_type
            add(f"blk.{i}.{gguf_suffix}", (f"model.layers.{i}.{hf_suffix}",), kind)
        for proj, gguf_base in _EXPERT_PROJ.items():
            sources = tuple(f"model.layers.{i}.mlp.experts.{e}.{proj}.weight" for e in range(experts))
            # [E, I, H] gate/up, [E, H, I] down
            add(f"blk.{i}.{gguf_base}.weight", sources, expert_type or export_type)
    add("output_norm.weight", ("model.norm.weight",))
    if "lm_head.weight" in shapes and not hf.get("tie_word_embeddings", False):
        add("output.weight", ("lm_head.weight",))
    return planned


def convert_tensor(values: torch.Tensor, qtype: Q) -> np.ndarray:
    """Torch values -> the array whose bytes GGUF stores for `qtype`."""
    import torch

    if qtype == Q.F32:
        return values.to(torch.float32).contiguous().numpy()
    if qtype == Q.F16:
        return values.to(torch.float16).contiguous().numpy()
    if qtype == Q.BF16:
        return values.to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint16)
    if qtype == Q.Q8_0:
        return gguf.quants.quantize(values.to(torch.float32).contiguous().numpy(), Q.Q8_0)
    raise ValueError(f"unsupported tensor type {qtype.name}")


def _load(ckpt: _Checkpoint, planned: PlannedTensor) -> torch.Tensor:
    import torch

    if len(planned.sources) == 1:
        return _values(ckpt, planned.sources[0])
    return torch.stack([_values(ckpt, s) for s in planned.sources], dim=0)


def _values(ckpt: _Checkpoint, name: str) -> torch.Tensor:
    """A weight's values; block-FP8 weights (with a `weight_scale_inv`) dequantized to fp32 first,
    so `--type q8_0` of an FP8 checkpoint serves the same values at matched bytes."""
    import torch

    from paged_experts import fp8

    scale_name = name.removesuffix("weight") + fp8.SCALE_SUFFIX
    if scale_name not in ckpt.where:
        return ckpt.tensor(name)
    return fp8.dequantize(ckpt.tensor(name), ckpt.tensor(scale_name), torch.float32)


def tokenizer_fields(model_dir: Path, hf: Mapping[str, Any]) -> dict[str, Any]:
    """Tokens, token types and merges of a byte-level BPE tokenizer.json, padded (`[PADi]`, type
    UNUSED) to vocab_size only where a checkpoint's embedding has more rows than its tokenizer has
    tokens (Qwen's 151,936 rows for 151,669 tokens); generated models have none."""
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise UserError(f"{model_dir}: no tokenizer.json")
    tok = json.loads(path.read_text(encoding="utf-8"))
    model = tok.get("model") or {}
    if model.get("type") != "BPE":
        raise UserError(f"{path}: only BPE tokenizers export to GGUF here, got {model.get('type')!r}")
    by_id: dict[int, str] = {int(i): t for t, i in model["vocab"].items()}
    types: dict[int, int] = {i: _TOKEN_NORMAL for i in by_id}
    for added in tok.get("added_tokens") or []:
        by_id[int(added["id"])] = added["content"]
        types[int(added["id"])] = _TOKEN_CONTROL if added.get("special") else _TOKEN_USER_DEFINED
    vocab_size = max(int(hf["vocab_size"]), max(by_id) + 1)
    tokens, token_types = [], []
    for i in range(vocab_size):
        tokens.append(by_id.get(i, f"[PAD{i}]"))
        token_types.append(types.get(i, _TOKEN_UNUSED))
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    config_path = model_dir / "tokenizer_config.json"
    tok_config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    pad = tok_config.get("pad_token")
    token_to_id = {t: i for i, t in enumerate(tokens)}
    return {
        "tokens": tokens,
        "token_types": token_types,
        "merges": merges,
        "pad_id": token_to_id.get(pad) if isinstance(pad, str) else None,
        "chat_template": tok_config.get("chat_template"),
    }


def write_metadata(
    writer: gguf.GGUFWriter,
    name: str,
    hf: Mapping[str, Any],
    export_type: str,
    fields: Mapping[str, Any],
) -> None:
    """The qwen3moe keys llama.cpp reads, from the HF config; `fields` from `tokenizer_fields`."""
    head_dim = int(hf.get("head_dim") or int(hf["hidden_size"]) // int(hf["num_attention_heads"]))
    writer.add_name(name)
    writer.add_file_type(_FILE_TYPE[export_type])
    if export_type == "q8_0":
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_context_length(int(hf.get("max_position_embeddings", 40960)))
    writer.add_embedding_length(int(hf["hidden_size"]))
    writer.add_block_count(int(hf["num_hidden_layers"]))
    writer.add_feed_forward_length(int(hf.get("intermediate_size", hf["moe_intermediate_size"])))
    writer.add_head_count(int(hf["num_attention_heads"]))
    writer.add_head_count_kv(int(hf.get("num_key_value_heads", hf["num_attention_heads"])))
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(hf.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(float(hf.get("rms_norm_eps", 1e-6)))
    writer.add_expert_count(int(hf["num_experts"]))
    writer.add_expert_used_count(int(hf["num_experts_per_tok"]))
    writer.add_expert_feed_forward_length(int(hf["moe_intermediate_size"]))

    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(fields["tokens"])
    writer.add_token_types(fields["token_types"])
    writer.add_token_merges(fields["merges"])
    eos = hf.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) else eos
    if hf.get("bos_token_id") is not None:
        writer.add_bos_token_id(int(hf["bos_token_id"]))
    if eos is not None:
        writer.add_eos_token_id(int(eos))
    if fields["pad_id"] is not None:
        writer.add_pad_token_id(int(fields["pad_id"]))
    writer.add_add_bos_token(False)  # Qwen prompts start without a BOS token
    if fields["chat_template"]:
        writer.add_chat_template(fields["chat_template"])


def _check_supported(hf: Mapping[str, Any], model_dir: Path) -> None:
    if hf.get("model_type") != "qwen3_moe":
        raise UserError(f"{model_dir}: GGUF export supports model_type qwen3_moe, got {hf.get('model_type')!r}")
    if not hf.get("norm_topk_prob", False):
        # llama.cpp's qwen3moe graph always renormalizes the top-k weights.
        raise UserError(f"{model_dir}: norm_topk_prob=false cannot be expressed in a qwen3moe GGUF")
    if int(hf.get("decoder_sparse_step", 1)) != 1 or hf.get("mlp_only_layers"):
        raise UserError(f"{model_dir}: dense MLP layers are not supported by this export")


def export_gguf(model_dir: str | Path, out: str | Path, export_type: str = "f32") -> ExportSummary:
    """Write `out` (atomically: a temporary file renamed at the end)."""
    if export_type not in EXPORT_TYPES:
        raise UserError(f"--type must be one of {', '.join(EXPORT_TYPES)}, got {export_type!r}")
    model_dir, out = Path(model_dir).expanduser(), Path(out).expanduser()
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise UserError(f"{model_dir}: no config.json")
    hf = json.loads(config_path.read_text())
    _check_supported(hf, model_dir)
    ckpt = _Checkpoint(model_dir)
    planned = plan_tensors(hf, {name: ckpt.shape(name) for name in ckpt.where}, export_type)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    writer = gguf.GGUFWriter(tmp, ARCH)
    try:
        write_metadata(writer, model_dir.name, hf, export_type, tokenizer_fields(model_dir, hf))
        add_tensor_infos(writer, planned)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for p in planned:
            writer.write_tensor_data(convert_tensor(_load(ckpt, p), p.qtype))
        writer.close()
        os.replace(tmp, out)
    finally:
        writer.close()
        if tmp.exists():
            tmp.unlink()
    _write_export_facts(model_dir, out, export_type)
    return ExportSummary(out, export_type, len(planned), sum(p.nbytes for p in planned))


def facts_path(gguf_path: Path) -> Path:
    """`<file>.json` beside a GGUF: its facts (`gguf_synth.write_with_facts`, `export_gguf`)."""
    return gguf_path.with_name(gguf_path.name + ".json")


def read_facts(gguf_path: Path) -> dict[str, Any] | None:
    """The facts benchsuite left beside a GGUF; None for any other GGUF, or facts of an older schema
    (their GGUF predates the source-weights record), or an unreadable file."""
    try:
        facts = json.loads(facts_path(gguf_path).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return facts if isinstance(facts, dict) and facts.get("schema_version") == FACTS_SCHEMA_VERSION else None


def write_facts(gguf_path: Path, facts: dict[str, Any]) -> None:
    """Atomically, after the GGUF itself: the facts file's presence says the GGUF is complete."""
    path = facts_path(gguf_path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps({"schema_version": FACTS_SCHEMA_VERSION, **facts}, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)


def _write_export_facts(model_dir: Path, out: Path, export_type: str) -> None:
    """The export's facts: its source checkpoint (tokenizer directory) and that checkpoint's
    source-weights record (paged_experts.weights.weights_id), which the llamacpp adapter records."""
    from paged_experts.weights.weights_id import source_weights

    source = source_weights(model_dir)
    facts = {
        "made_by": "benchsuite gguf export", "path": str(out.resolve()), "bytes": out.stat().st_size,
        "export_type": export_type, "hf_dir": str(model_dir.resolve()), "source_weights": source,
        "random_weights": source.get("kind") == "recipe",
    }  # fmt: skip
    write_facts(out, facts)


def add_tensor_infos(writer: gguf.GGUFWriter, planned: list[PlannedTensor]) -> None:
    """Declare every planned tensor (name, shape, type, bytes) before the header is written."""
    for p in planned:
        byte_shape = gguf.quants.quant_shape_to_byte_shape(p.shape, p.qtype) if p.qtype == Q.Q8_0 else p.shape
        writer.add_tensor_info(
            p.gguf_name,
            byte_shape,
            np.dtype(_NUMPY_DTYPE[p.qtype]),
            p.nbytes,
            raw_dtype=p.qtype,
        )


def checkpoint_fingerprint(model_dir: Path) -> str:
    """Identity of a checkpoint for the export cache: config, tokenizer and weight file sizes/mtimes."""
    h = hashlib.sha256(f"v{EXPORT_FORMAT_VERSION}".encode())
    for path in sorted(model_dir.iterdir()):
        if path.suffix in (".json", ".safetensors"):
            st = path.stat()
            h.update(f"{path.name}:{st.st_size}:{st.st_mtime_ns}".encode())
            if path.suffix == ".json":
                h.update(path.read_bytes())
    return h.hexdigest()[:16]


def cached_export(model_dir: str | Path, export_type: str = "f32", cache_dir: Path | None = None) -> Path:
    """The GGUF of `model_dir` in the per-user cache, exported on first use."""
    target = export_target(model_dir, export_type, cache_dir)
    if not target.is_file():
        export_gguf(Path(model_dir).expanduser().resolve(), target, export_type)
    return target


def export_target(model_dir: str | Path, export_type: str = "f32", cache_dir: Path | None = None) -> Path:
    """Where `cached_export` puts (or finds) the GGUF of `model_dir`, without exporting it."""
    from benchsuite.engines.llamacpp.build import cache_root

    model_dir = Path(model_dir).expanduser().resolve()
    root = cache_dir or cache_root() / "gguf"
    return root / f"{model_dir.name}-{checkpoint_fingerprint(model_dir)}-{export_type}.gguf"


def iter_tensor_bytes(path: Path) -> Iterator[tuple[str, str, tuple[int, ...], int]]:
    """(name, type name, numpy-order shape, bytes) of every tensor in a GGUF file."""
    reader = gguf.GGUFReader(path)
    for t in reader.tensors:
        yield (
            t.name,
            t.tensor_type.name,
            tuple(int(x) for x in reversed(t.shape)),
            int(t.n_bytes),
        )


def expert_facts(path: Path) -> dict[str, Any]:
    """How a GGUF stores one expert, from its tensor table (layer 0's stacked expert tensors):
    {expert_format: the ggml type of ffn_gate_exps, expert_bytes: gate + up + down bytes of one expert}."""
    exps = {
        name: (kind, shape, nbytes)
        for name, kind, shape, nbytes in iter_tensor_bytes(path)
        if name.startswith("blk.0.ffn_")
    }
    found = [exps.get(f"blk.0.{base}.weight") for base in _EXPERT_PROJ.values()]
    parts = [p for p in found if p is not None]
    if len(parts) < len(found):
        return {}
    return {"expert_format": parts[0][0].lower(), "expert_bytes": sum(p[2] // p[1][0] for p in parts)}


def tensor_formats(path: Path) -> str:
    """How a GGUF stores its weights, from its tensor table: `GGUF experts Q8_0, attention Q8_0, ...`."""
    kinds = {name: kind for name, kind, _, _ in iter_tensor_bytes(path)}
    parts = [("experts", "blk.0.ffn_gate_exps.weight"), ("attention", "blk.0.attn_q.weight"),
             ("embeddings", "token_embd.weight"), ("output", "output.weight")]  # fmt: skip
    return "GGUF " + ", ".join(f"{label} {kinds[name]}" for label, name in parts if name in kinds)
