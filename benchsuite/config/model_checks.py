"""What a server's model option must satisfy before anything runs, checked in one place.

- Shape (when the matrix loads, wherever the shape is known without loading weights: the generated
  `tiny` and `synth:PRESET?layers=N` presets, or a local checkpoint's config.json): K (resident
  experts) between top_k and E, since one token's top_k experts must all be resident and there are
  only E to hold; --n-cpu-moe / offloaded layers no more than the model's layers.
- Existence (when a run starts, before its results directory is written): the model path exists.
  A dry run only lists these (a plan may name a model that is not on this machine).

Each problem is (option key, message); benchsuite.config.sweeps prefixes the YAML path.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from benchsuite.engines.base import EngineOptions
from paged_experts.shape import ModelShape

GENERATED = "tiny"  # the generated test model (paged_experts.weights.synth preset), made on first use
SYNTH_PREFIX = "synth:"  # in-memory presets of paged_experts.weights.synth_memory


@dataclass(frozen=True)
class KnownShape:
    shape: ModelShape
    source: str  # where the shape was read, for the message


def model_shape(options: EngineOptions) -> KnownShape | None:
    """The server's model's shape (paged_experts.shape) and where it was read, or None where it
    cannot be known without the weights."""
    model = str(options.model_source() or "")
    if model == GENERATED or model.startswith(SYNTH_PREFIX):
        return _preset_shape(model)
    path = Path(model).expanduser()
    config = path / "config.json" if path.is_dir() else None
    if config is None or not config.is_file():
        return None
    try:
        return KnownShape(ModelShape.from_dir(config), f"{config}")
    except (OSError, ValueError, TypeError, AttributeError):
        return None


def _preset_shape(model: str) -> KnownShape | None:
    from paged_experts.weights.synth import PRESETS  # imports torch: only for a generated or synth: model

    name, _, query = model.removeprefix(SYNTH_PREFIX).partition("?")
    preset = PRESETS.get(name)
    if preset is None:
        return None
    layers = preset.num_layers
    for part in query.split("&"):
        key, _, value = part.partition("=")
        if key == "layers" and value.isdigit():
            layers = int(value)
    return KnownShape(ModelShape(layers, layers, preset.num_experts, preset.top_k), f"the {name} preset")


def shape_problems(options: EngineOptions) -> list[tuple[str, str]]:
    """K against top_k and E, and layer counts against the model's layers, where the shape is known
    (the options say which of their values the shape bounds: EngineOptions.sized_values)."""
    sized = options.sized_values()
    layer_values = sized.layer_counts
    if not sized.experts_per_layer and not layer_values:
        return []
    known = model_shape(options)
    if known is None:
        return []
    shape = known.shape
    problems = []
    for key, k in sized.experts_per_layer.items():
        if k > shape.num_experts:
            more = f"more than the model's {shape.num_experts} experts per layer ({known.source})"
            problems.append((key, f"K={k} is {more}"))
        if k < shape.top_k:
            why = f"one token's experts must all be resident ({known.source})"
            problems.append((key, f"K={k} is fewer than top_k={shape.top_k}: {why}"))
    for key, value in layer_values.items():
        if shape.num_layers and value > shape.num_layers:  # 0: the config.json names no layer count
            problems.append((key, f"{value} is more than the model's {shape.num_layers} layers ({known.source})"))
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
