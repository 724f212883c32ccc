"""What a server's model option must satisfy before anything runs, checked in one place.

- Shape (when the matrix loads, wherever the shape is known without loading weights: the generated
  `tiny` and `synth:PRESET?layers=N` presets, or a local checkpoint's config.json): K (resident
  experts) between top_k and E, since one token's top_k experts must all be resident and there are
  only E to hold; --n-cpu-moe / offloaded layers no more than the model's layers.
- Existence (when a run starts, before its results directory is written): the model path exists.
  A dry run only lists these (a plan may name a model that is not on this machine).

Each problem is (option key, message); benchsuite.matrix_sweeps prefixes the YAML path.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from benchsuite.engines.base import EngineOptions

GENERATED = "tiny"  # the generated test model (paged_experts.synth preset), made on first use
SYNTH_PREFIX = "synth:"  # in-memory presets of paged_experts.synth_memory
_E_KEYS = ("num_experts", "n_routed_experts", "num_local_experts")
_TOP_K_KEYS = ("num_experts_per_tok", "top_k", "moe_topk")


@dataclass(frozen=True)
class ModelShape:
    num_experts: int
    top_k: int
    num_layers: int | None
    source: str  # where the shape was read, for the message


def model_shape(options: EngineOptions) -> ModelShape | None:
    """E, top_k and layers of the server's model, or None where they cannot be known without it."""
    model = str(options.model_source() or "")
    if model == GENERATED or model.startswith(SYNTH_PREFIX):
        return _preset_shape(model)
    path = Path(model).expanduser()
    config = path / "config.json" if path.is_dir() else None
    if config is None or not config.is_file():
        return None
    try:
        data = json.loads(config.read_text())
    except (OSError, ValueError):
        return None
    cfg = data.get("text_config", data) if isinstance(data, dict) else {}
    experts = next((cfg[k] for k in _E_KEYS if isinstance(cfg.get(k), int)), None)
    top_k = next((cfg[k] for k in _TOP_K_KEYS if isinstance(cfg.get(k), int)), None)
    layers = cfg.get("num_hidden_layers") if isinstance(cfg.get("num_hidden_layers"), int) else None
    if experts is None or top_k is None:
        return None
    return ModelShape(experts, top_k, layers, f"{config}")


def _preset_shape(model: str) -> ModelShape | None:
    from paged_experts.synth import PRESETS  # imports torch: only for a generated or synth: model

    name, _, query = model.removeprefix(SYNTH_PREFIX).partition("?")
    preset = PRESETS.get(name)
    if preset is None:
        return None
    layers = preset.num_layers
    for part in query.split("&"):
        key, _, value = part.partition("=")
        if key == "layers" and value.isdigit():
            layers = int(value)
    return ModelShape(preset.num_experts, preset.top_k, layers, f"the {name} preset")


def shape_problems(options: EngineOptions) -> list[tuple[str, str]]:
    """K against top_k and E, and layer counts against the model's layers, where the shape is known
    (the options say which of their values the shape bounds: EngineOptions.sized_values)."""
    sized = options.sized_values()
    layer_values = sized.layer_counts
    if not sized.experts_per_layer and not layer_values:
        return []
    shape = model_shape(options)
    if shape is None:
        return []
    problems = []
    for key, k in sized.experts_per_layer.items():
        if k > shape.num_experts:
            more = f"more than the model's {shape.num_experts} experts per layer ({shape.source})"
            problems.append((key, f"K={k} is {more}"))
        if k < shape.top_k:
            why = f"one token's experts must all be resident ({shape.source})"
            problems.append((key, f"K={k} is fewer than top_k={shape.top_k}: {why}"))
    for key, value in layer_values.items():
        if shape.num_layers is not None and value > shape.num_layers:
            problems.append((key, f"{value} is more than the model's {shape.num_layers} layers ({shape.source})"))
    return problems


def missing_model(options: EngineOptions) -> tuple[str, str] | None:
    """(option key, message) when the model path does not exist on this machine; None when it does,
    or when the value is not a path (the generated model, a synth: preset, a hub id the engine
    downloads itself)."""
    key, value = options.checkpoint_option, options.model_source()
    if not isinstance(value, str) or value == GENERATED or value.startswith(SYNTH_PREFIX):
        return None
    if options.checkpoint_may_be_hub_id and not value.startswith(("/", ".", "~")):
        return None  # a hub id such as Qwen/Qwen3-30B-A3B
    path = Path(value).expanduser()
    if path.exists():
        return None
    return key, f"no such model: {path} ({options.checkpoint_kinds})"
