"""Synthetic routing specs, torch-free: `RoutingParams`, the calibrated presets, `parse_spec` and
`routing_label` (what the report and the matrix validation read without loading the generator in
paged_experts.routing.sources).
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class RoutingParams:
    keep_prob: float = 0.0
    recency_mix: float = 0.0
    recency_alpha: float = 1.0
    zipf_s: float = 0.0
    working_set: float = 1.0  # fraction of E
    working_set_mass: float = 1.0
    working_set_knee: float = 0.0  # layers with strength below the knee spread their routing wider
    layer_strength_min: float = 1.0  # 1.0: every layer alike
    layer_strength_gamma: float = 1.0


# Calibrated with benchmarks/calibrate_routing.py against DESIGN.md section 8 (E=128, top_k=8,
# 16 layers, one stream of 2,000 decode tokens; the printed curves replay 48 layers x 3,225 tokens
# through paged_experts.residency.planner and its policies), for the counter-based draw of routing_draw.
QWEN3_30B_A3B = RoutingParams(
    keep_prob=0.322,
    recency_mix=0.918,
    recency_alpha=1.396,
    zipf_s=1.099,
    working_set=0.374,
    working_set_mass=0.972,
    working_set_knee=0.529,
    layer_strength_min=0.01,
    layer_strength_gamma=0.6,
)
PRESETS: dict[str, RoutingParams] = {"qwen3-30b-a3b": QWEN3_30B_A3B}


def parse_spec(spec: str) -> RoutingParams:
    """`uniform`, `zipf:<s>`, `reuse:<p>`, a preset name, or comma-joined parts
    (`reuse:0.4,zipf:1.2,recency:0.8,alpha:1.0,ws:0.5,wsmass:0.95`)."""
    spec = spec.strip().lower()
    if spec in PRESETS:
        return PRESETS[spec]
    params = RoutingParams()
    fields = {"zipf": "zipf_s", "reuse": "keep_prob", "recency": "recency_mix", "alpha": "recency_alpha",
              "ws": "working_set", "wsmass": "working_set_mass"}  # fmt: skip
    for part in spec.split(","):
        name, _, value = part.partition(":")
        if name == "uniform" and not value:
            continue
        if name not in fields or not value:
            raise ValueError(
                f"unknown routing spec {part!r}: use uniform, zipf:<s>, reuse:<p>, recency:<mix>,"
                f" alpha:<a> or a preset ({', '.join(PRESETS)})"
            )
        v = float(value)
        if name in ("reuse", "recency", "ws", "wsmass") and not 0.0 <= v <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {v}")
        if v < 0:
            raise ValueError(f"{name} must be >= 0, got {v}")
        params = replace(params, **{fields[name]: v})
    return params


def routing_label(spec: str) -> str:
    return f"synthetic:{spec.strip().lower()}"


def is_calibrated(label: str) -> bool:
    """Whether a routing label (`synthetic:<spec>`) names a preset calibrated to a trained model's
    measured routing, not a hand-set uniform, Zipf or reuse process."""
    return label.strip().lower().removeprefix("synthetic:") in PRESETS
