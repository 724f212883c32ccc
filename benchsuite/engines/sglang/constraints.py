"""SGLang 0.5.23 Paged Experts constraints, checked before a launch instead of a failed launch.

Owns `CheckpointFacts` (what the checks need from the model's `config.json`) and `check_paged`,
which returns every violated constraint as one line citing the 0.5.23 source it came from.

The list follows the server's own check, `check_paged_experts_compat` in
`sglang/srt/layers/moe/paged_experts/method.py` (lines 301-355 of the 0.5.23 wheel), plus the
runner requirement of `paged_experts/runners.py:contract_for` (lines 155-170). SGLang raises these
only after the server process has started loading the model; checking them here turns a failed
launch into one clear line. `resident_experts > num_experts` is NOT rejected: 0.5.23 clamps K to E
(`method.py:269`, `min(paged_experts_num_resident, num_experts)`), so neither do we.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchsuite.engines.base import EngineConfigError
from benchsuite.engines.sglang.options import SGLangOptions
from paged_experts.shape import ModelShape

SGLANG_REFERENCE_VERSION = "0.5.23"
_SRC = "sglang 0.5.23 srt/"
_METHOD = _SRC + "layers/moe/paged_experts/method.py"
_FORMATS = _SRC + "layers/moe/paged_experts/formats.py"

# Quantization methods whose fused-MoE method has an ExpertFormat in 0.5.23 (formats.py:321-334).
# fp8 and gptq carry extra conditions, handled in `_quantization_problem`.
PAGED_QUANTIZATIONS: dict[str | None, str] = {
    None: "UnquantizedFormat (formats.py:148)",
    "unquant": "UnquantizedFormat (formats.py:148)",
    "fp8": "Fp8BlockFormat, block-scaled FP8 checkpoints only (formats.py:158-173)",
    "w8a8_fp8": "W8A8Fp8Format (formats.py:176)",
    "w8a8_int8": "W8A8Int8Format (formats.py:186)",
    "blockwise_int8": "BlockInt8Format (formats.py:201)",
    "gptq": "GptqFormat via GPTQ Marlin, checkpoint auto-conversion only (formats.py:211)",
    "gptq_marlin": "GptqFormat (formats.py:211)",
    "awq": "AwqFormat (formats.py:223)",
    "awq_marlin": "AwqFormat (formats.py:223)",
    "mxfp4": "Mxfp4Format (formats.py:233)",
    "modelopt_fp4": "ModelOptNvfp4Format (formats.py:243)",
    "compressed-tensors": "CompressedTensors{Fp8,WNA16,Nvfp4}Format, scheme checked by the server (formats.py:260-318)",
}

# contract_for accepts a triton runner or a Marlin one other than experimental_sgl_marlin;
# "auto" lets the quantization method pick (triton for unquantized/FP8, Marlin for GPTQ).
PAGED_MOE_RUNNERS = (None, "auto", "triton", "marlin")
_SHARED_EXPERT_KEYS = ("n_shared_experts", "num_shared_experts", "shared_expert_intermediate_size")


@dataclass(frozen=True)
class CheckpointFacts:
    """What the constraint checks read from a model's config.json (text config for VLMs)."""

    shape: ModelShape | None  # paged_experts.shape; None when config.json names no E or top_k
    has_shared_experts: bool
    quant_method: str | None  # quantization_config.quant_method, lower case
    weight_block_size: tuple[int, ...] | None  # block-quantized FP8 checkpoints


def read_model_facts(model_path: str) -> CheckpointFacts:
    """Facts from `<model_path>/config.json`; EngineConfigError when it cannot be read."""
    config_path = Path(model_path).expanduser() / "config.json"
    try:
        raw = json.loads(config_path.read_text())
    except FileNotFoundError:
        raise EngineConfigError(
            f"sglang paged mode: {config_path} not found; model_path must be a local checkpoint directory "
            "so K >= top_k can be checked before launch"
        ) from None
    except (OSError, json.JSONDecodeError) as exc:
        raise EngineConfigError(f"sglang: cannot read {config_path}: {exc}") from None
    return facts_from_config(raw)


def facts_from_config(raw: dict[str, Any]) -> CheckpointFacts:
    text = raw.get("text_config")
    cfg: dict[str, Any] = text if isinstance(text, dict) else raw
    quant = raw.get("quantization_config") or cfg.get("quantization_config") or {}
    block = quant.get("weight_block_size")
    try:
        shape: ModelShape | None = ModelShape.from_hf_config(raw)
    except (ValueError, TypeError):
        shape = None
    return CheckpointFacts(
        shape=shape,
        has_shared_experts=any((_first_int(cfg, (key,)) or 0) > 0 for key in _SHARED_EXPERT_KEYS),
        quant_method=str(quant["quant_method"]).lower() if quant.get("quant_method") else None,
        weight_block_size=tuple(int(b) for b in block) if isinstance(block, list) else None,
    )


def _first_int(cfg: dict[str, Any], keys: Sequence[str]) -> int | None:
    for key in keys:
        value = cfg.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def effective_cuda_graph_backends(opts: SGLangOptions) -> tuple[str, str]:
    """(decode, prefill) backends the server will use. Defaults on CUDA: decode full, prefill
    breakable (sglang 0.5.23 srt/model_executor/cuda_graph_config.py:119-123 and 149-154)."""
    if opts.disable_cuda_graph:
        return "disabled", "disabled"
    return opts.cuda_graph_backend_decode or "full", opts.cuda_graph_backend_prefill or "breakable"


# One check per documented constraint: (name, source, check(opts, facts) -> problem or None).
Check = Callable[["SGLangOptions", CheckpointFacts], "str | None"]


def _single_gpu(opts: SGLangOptions, facts: CheckpointFacts) -> str | None:
    big = [
        f"{name}={getattr(opts, name)}"
        for name in ("tp_size", "ep_size", "pp_size", "dp_size")
        if getattr(opts, name) > 1
    ]
    return f"{', '.join(big)}: paged experts is single GPU only (tp/ep/pp/dp sizes must be 1)" if big else None


def _no_eplb(opts: SGLangOptions, facts: CheckpointFacts) -> str | None:
    return (
        "extra_args --enable-eplb is not supported with paged experts" if "--enable-eplb" in opts.extra_args else None
    )


def _no_speculative(opts: SGLangOptions, facts: CheckpointFacts) -> str | None:
    if opts.speculative_algorithm:
        algorithm = opts.speculative_algorithm
        return f"speculative_algorithm {algorithm}: speculative decoding is not supported with paged experts"
    return None


def _prefill_graph(opts: SGLangOptions, facts: CheckpointFacts) -> str | None:
    prefill = effective_cuda_graph_backends(opts)[1]
    if prefill not in ("breakable", "disabled"):
        return f"cuda_graph_backend_prefill {prefill}: prefill CUDA graphs must be breakable or disabled"
    return None


def _decode_graph(opts: SGLangOptions, facts: CheckpointFacts) -> str | None:
    decode = effective_cuda_graph_backends(opts)[0]
    if decode not in ("full", "disabled"):
        return f"cuda_graph_backend_decode {decode}: decode CUDA graphs must be full or disabled"
    return None


def _real_weights(opts: SGLangOptions, facts: CheckpointFacts) -> str | None:
    if opts.load_format == "dummy":
        return "load_format dummy: not supported, the host expert store needs real weights"
    return None


def _k_at_least_top_k(opts: SGLangOptions, facts: CheckpointFacts) -> str | None:
    if facts.shape is None:
        return "config.json has no num_experts_per_tok: cannot check resident_experts >= top_k"
    k, top_k = opts.resident_experts, facts.shape.top_k
    if k is not None and k < top_k:
        return f"resident_experts {k} < top_k {top_k}: K must be at least the router's top-k"
    return None


def _quantization(opts: SGLangOptions, facts: CheckpointFacts) -> str | None:
    return _quantization_problem(opts.quantization, facts)


def _no_fused_sum_all_reduce(opts: SGLangOptions, facts: CheckpointFacts) -> str | None:
    if "--enable-fused-moe-sum-all-reduce" in opts.extra_args:
        return (
            "extra_args --enable-fused-moe-sum-all-reduce is not supported: paged experts sums the top-k outputs itself"
        )
    return None


def _shared_expert_fusion(opts: SGLangOptions, facts: CheckpointFacts) -> str | None:
    if facts.has_shared_experts and not opts.disable_shared_experts_fusion:
        return (
            "the model has shared experts: fused shared experts are not supported, "
            "set disable_shared_experts_fusion: true"
        )
    return None


def _moe_runner(opts: SGLangOptions, facts: CheckpointFacts) -> str | None:
    if opts.moe_runner_backend not in PAGED_MOE_RUNNERS:
        runner = opts.moe_runner_backend
        return f"moe_runner_backend {runner}: paged experts needs the triton or marlin MoE runner (or auto)"
    return None


PAGED_CHECKS: tuple[tuple[str, str, Check], ...] = (
    ("single GPU", f"{_METHOD}:306-309", _single_gpu),
    ("no EPLB", f"{_METHOD}:310-311", _no_eplb),
    ("no speculative decoding", f"{_METHOD}:312-313", _no_speculative),
    ("prefill CUDA graph breakable or disabled", f"{_METHOD}:316-322", _prefill_graph),
    ("decode CUDA graph full or disabled", f"{_METHOD}:323-327", _decode_graph),
    ("no dummy load format", f"{_METHOD}:328-331", _real_weights),
    ("K >= top_k", f"{_METHOD}:332-339,358-362", _k_at_least_top_k),
    ("supported quantization format", f"{_METHOD}:340-344 and {_FORMATS}:148-334", _quantization),
    ("no fused MoE sum all-reduce", f"{_METHOD}:345-349", _no_fused_sum_all_reduce),
    ("shared-expert fusion disabled", f"{_METHOD}:350-353", _shared_expert_fusion),
    ("triton or Marlin MoE runner", f"{_SRC}layers/moe/paged_experts/runners.py:155-170", _moe_runner),
)


def paged_problems(opts: SGLangOptions, facts: CheckpointFacts) -> list[str]:
    """Every violated paged-experts constraint, each with its 0.5.23 source."""
    problems = []
    for _name, source, check in PAGED_CHECKS:
        problem = check(opts, facts)
        if problem is not None:
            problems.append(f"{problem} [{source}]")
    return problems


def check_paged(opts: SGLangOptions, facts: CheckpointFacts) -> None:
    """Raise one EngineConfigError (one line, every problem) when paged experts cannot start."""
    problems = paged_problems(opts, facts)
    if problems:
        raise EngineConfigError("sglang paged experts: " + "; ".join(problems))


def _quantization_problem(requested: str | None, facts: CheckpointFacts) -> str | None:
    """The ExpertFormat lookup of formats.py:337-342, predicted from the option and config.json."""
    effective = requested or facts.quant_method
    if effective not in PAGED_QUANTIZATIONS:
        supported = ", ".join(str(q) for q in PAGED_QUANTIZATIONS if q is not None)
        return f"quantization {effective}: experts not supported by paged experts (supported: unquantized, {supported})"
    if effective == "fp8" and not (facts.quant_method == "fp8" and facts.weight_block_size):
        # Fp8BlockFormat needs weight_block_size and an FP8-serialized checkpoint (formats.py:164-173).
        return "quantization fp8: only block-quantized FP8 checkpoints (weight_block_size in config.json) are paged"
    if requested == "gptq":
        # An explicit `--quantization gptq` keeps GPTQConfig, whose MoE method is GPTQMoEMethod
        # (quantization/gptq/gptq.py:213-215, 431-437) with no ExpertFormat; left unset, a GPTQ
        # checkpoint converts to GPTQ Marlin (gptq.py:414-429) -> GPTQMarlinMoEMethod (gptq.py:446-447).
        return "quantization gptq forces the non-Marlin GPTQ MoE method; leave quantization unset or use gptq_marlin"
    return None
