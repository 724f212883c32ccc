"""The identity of a model's SOURCE weights: what two engines must share to be "the same model".

`source_weights(model)` -> {"id", "kind", "covers", ...}, JSON-ready, for what the built-in engine
loads and what a GGUF was made from (its facts file keeps its source's record):
- generated models (a weightless directory, a `synth:` preset, a checkpoint `synth` wrote, which
  carries `source_weights.json`): kind `recipe`, the id of `weightgen.recipe` (generator version,
  shape, layers, seed, vocabulary, silent tokens). The FP8 preset of a shape has its dense preset's
  source: the formats differ, the source does not;
- any other checkpoint directory: kind `content`, a SHA-256 over config.json, tokenizer.json, and
  per safetensors file its size, its header (every tensor's name, dtype, shape and offsets) and
  SAMPLES chunks of SAMPLE_BYTES spread evenly over the file: ~1 MiB read per file, so a 60 GB
  checkpoint is fingerprinted in well under a second. It sees a different model, a re-export or a
  truncated file; it can miss a change confined to bytes no sample reads, and says so (`covers`).
A GGUF file is fingerprinted by whoever reads its facts (benchsuite's llamacpp adapter).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

SAMPLES = 16
SAMPLE_BYTES = 64 * 1024
CONTENT_COVERS = (
    f"config.json, tokenizer.json, and per safetensors file its size, header and {SAMPLES} sampled chunks "
    f"of {SAMPLE_BYTES // 1024} KiB (not every byte)"
)


def source_weights(model: str | Path) -> dict[str, Any]:
    """The source-weights record of a model path the built-in engine accepts (see the docstring)."""
    from paged_experts.weights import synth_memory, weightgen

    text = str(model)
    if synth_memory.is_synthetic(text):
        spec = synth_memory.parse_spec(text)
        cfg = synth_memory.config_for(spec) if text.startswith(synth_memory.PREFIX) else _config_from(Path(text))
        hf = weightgen.hf_shape(cfg)
        return weightgen.recipe_record(hf, spec.seed, synth_memory.silent_ids(text))
    path = Path(text).expanduser()
    recorded = path / weightgen.RECIPE_FILE
    if recorded.is_file():
        return json.loads(recorded.read_text())
    return content_record(path)


def _config_from(path: Path) -> Any:
    from paged_experts.config import MoeModelConfig

    return MoeModelConfig.from_dir(path)


def content_record(model_dir: Path) -> dict[str, Any]:
    """Kind `content`: the sampled hash of a checkpoint directory (CONTENT_COVERS)."""
    h = hashlib.sha256(b"checkpoint-content-v1")
    for name in ("config.json", "tokenizer.json"):
        p = model_dir / name
        h.update(name.encode() + b"\0" + (p.read_bytes() if p.is_file() else b"absent") + b"\0")
    files = sorted(model_dir.glob("*.safetensors"))
    for p in files:
        h.update(_file_digest(p))
    return {"id": "content-" + h.hexdigest()[:16], "kind": "content", "covers": CONTENT_COVERS, "files": len(files)}


def _file_digest(path: Path) -> bytes:
    size = path.stat().st_size
    h = hashlib.sha256(f"{path.name}\0{size}\0".encode())
    with path.open("rb") as f:
        head = f.read(8)
        header_len = int.from_bytes(head, "little") if len(head) == 8 else 0
        h.update(head + f.read(min(header_len, size)))  # the safetensors JSON header: names, dtypes, shapes, offsets
        for k in range(SAMPLES):
            f.seek(max(0, (size - SAMPLE_BYTES) * k // max(1, SAMPLES - 1)))
            h.update(f.read(SAMPLE_BYTES))
    return h.digest()
