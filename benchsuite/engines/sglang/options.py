"""The `kind: sglang` options of matrix.yaml (SGLang 0.5.23): `SGLangOptions`, the flag choices it
accepts (copied from the 0.5.23 source, cited per tuple) and `${ENV}` expansion of its paths.
The adapter (.adapter) turns these into a command line; .constraints checks them against the model.
"""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from benchsuite.engines.base import EngineOptions, Placement, SizedValues, extra_args_check
from benchsuite.engines.sglang.owned import extra_args_problems

# sglang 0.5.23 arg_groups/choices.py:32-66 (QUANTIZATION_CHOICES).
QUANTIZATION_CHOICES = (
    "awq", "fp8", "mxfp8", "gptq", "gptq_marlin", "awq_marlin", "bitsandbytes", "gguf", "modelopt",
    "modelopt_fp8", "modelopt_fp4", "nvfp4_online", "modelopt_mixed", "petit_nvfp4", "w8a8_int8",
    "w8a8_fp8", "moe_wna16", "w4afp8", "mxfp4", "auto-round", "auto-round-int8", "compressed-tensors",
    "modelslim", "mxfp_w4a8", "quark", "quark_int4fp8_moe", "quark_mxfp4", "mlx_q4", "mlx_q8",
    "unquant", "humming",
)  # fmt: skip
# sglang 0.5.23 arg_groups/choices.py:3-28 (LOAD_FORMAT_CHOICES).
LOAD_FORMAT_CHOICES = (
    "auto", "pt", "safetensors", "instanttensor", "npcache", "dummy", "sharded_state", "presharded",
    "gguf", "expert_pack", "bitsandbytes", "mistral", "layered", "flash_rl", "remote",
    "remote_instance", "fastsafetensors", "private", "runai_streamer",
)  # fmt: skip
# sglang 0.5.23 arg_groups/choices.py:136-159 (MOE_RUNNER_BACKEND_CHOICES).
MOE_RUNNER_BACKEND_CHOICES = (
    "auto", "deep_gemm", "triton", "triton_kernel", "flashinfer_trtllm", "experimental_sgl_trtllm",
    "flashinfer_trtllm_routed", "flashinfer_cutlass", "flashinfer_mxfp4", "flashinfer_cutedsl",
    "flashinfer_megamoe", "cutlass", "aiter", "marlin", "humming", "experimental_sgl_marlin",
    "lora_cutedsl", "lora_triton", "lora_marlin", "hpc_ops", "megamoe", "intel_xpu",
)  # fmt: skip
KvCacheDtype = Literal["auto", "fp8_e5m2", "fp8_e4m3", "mxfp8", "bf16", "bfloat16", "nvfp4", "fp4_mx_block16"]
GraphBackend = Literal["full", "breakable", "disabled"]  # model_executor/cuda_graph_config.py:40-48


def _choice(value: str | None, choices: tuple[str, ...], what: str) -> str | None:
    if value is not None and value not in choices:
        raise ValueError(f"{what} {value!r} is not an sglang 0.5.23 choice ({', '.join(choices)})")
    return value


class SGLangOptions(EngineOptions):
    """`engines.<name>.options` for `kind: sglang` (one scalar per field after sweep expansion)."""

    model_path: str  # local checkpoint directory (HF repo ids work for offload/unpaged); `~` expanded
    mode: Literal["paged", "offload", "unpaged"] = "paged"
    resident_experts: int | None = Field(None, ge=1)  # K, mode paged (required there, method.py:334)
    cpu_offload_gb: int | None = Field(None, ge=1)  # mode offload; an int in 0.5.23 (fields/exec_.py:1068)
    mem_fraction_static: float | None = Field(None, gt=0, lt=1)
    quantization: str | None = None
    kv_cache_dtype: KvCacheDtype | None = None
    tp_size: int = Field(1, ge=1)
    ep_size: int = Field(1, ge=1)
    pp_size: int = Field(1, ge=1)
    dp_size: int = Field(1, ge=1)
    speculative_algorithm: str | None = None  # e.g. EAGLE, NGRAM (fields/spec.py:31)
    speculative_draft_model_path: str | None = None
    disable_cuda_graph: bool = False  # both phases disabled
    cuda_graph_backend_decode: GraphBackend | None = None  # server default: full
    cuda_graph_backend_prefill: GraphBackend | None = None  # server default on CUDA: breakable
    cuda_graph_max_bs: int | None = Field(None, ge=1)  # -> --cuda-graph-max-bs-decode
    load_format: str | None = None
    moe_runner_backend: str | None = None
    disable_shared_experts_fusion: bool = False
    deterministic: bool = False  # --enable-deterministic-inference (accuracy runs)
    return_routed_experts: bool = False  # routing capture: server flag + per-request field
    python: str | None = None  # interpreter with sglang installed; None = this interpreter
    extra_args: list[str] = Field(default_factory=list)  # never a flag the adapter owns (owned.OWNED_FLAGS)
    startup_timeout_s: float = Field(1800.0, gt=0, le=7 * 86400)  # a 30B checkpoint plus graph capture takes minutes

    _not_owned = field_validator("extra_args")(extra_args_check(extra_args_problems))

    # `${VAR}` references were expanded when the matrix loaded (benchsuite.config.env_refs); a `${`
    # left here is a literal one (`$${`) or a dry run's placeholder for an unset variable.
    @field_validator("model_path", "speculative_draft_model_path", "python", mode="before")
    @classmethod
    def _expand(cls, value: Any) -> Any:
        return os.path.expanduser(value) if isinstance(value, str) else value

    @field_validator("quantization")
    @classmethod
    def _quantization(cls, value: str | None) -> str | None:
        return _choice(value, QUANTIZATION_CHOICES, "quantization")

    @field_validator("load_format")
    @classmethod
    def _load_format(cls, value: str | None) -> str | None:
        return _choice(value, LOAD_FORMAT_CHOICES, "load_format")

    @field_validator("moe_runner_backend")
    @classmethod
    def _moe_runner(cls, value: str | None) -> str | None:
        return _choice(value, MOE_RUNNER_BACKEND_CHOICES, "moe_runner_backend")

    @model_validator(mode="after")
    def _mode_options(self) -> SGLangOptions:
        if self.mode == "paged" and self.resident_experts is None:
            raise ValueError("mode paged needs resident_experts (K, --paged-experts-num-resident)")
        if self.mode == "offload" and self.cpu_offload_gb is None:
            raise ValueError("mode offload needs cpu_offload_gb (--cpu-offload-gb, whole GB)")
        if self.mode != "paged" and self.resident_experts is not None:
            raise ValueError(f"resident_experts applies only to mode paged, not {self.mode}")
        if self.mode != "offload" and self.cpu_offload_gb is not None:
            raise ValueError(f"cpu_offload_gb applies only to mode offload, not {self.mode}")
        if self.disable_cuda_graph and (self.cuda_graph_backend_decode or self.cuda_graph_backend_prefill):
            raise ValueError("disable_cuda_graph conflicts with cuda_graph_backend_decode/prefill; use one")
        if self.speculative_draft_model_path and not self.speculative_algorithm:
            raise ValueError("speculative_draft_model_path needs speculative_algorithm")
        return self

    checkpoint_option = "model_path"
    checkpoint_may_be_hub_id = True  # a hub id such as Qwen/Qwen3-30B-A3B: SGLang downloads it

    def model_source(self) -> str:
        return self.model_path

    def sized_values(self) -> SizedValues:
        return SizedValues({"resident_experts": self.resident_experts} if self.resident_experts is not None else {})

    def placement(self) -> Placement:
        return Placement(self.mode, resident_experts=self.resident_experts)  # SGLang routes with the model's router
