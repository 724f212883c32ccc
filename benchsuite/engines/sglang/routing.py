"""Routing capture glue: SGLang responses with routed experts -> a routing trace file.

With `return_routed_experts: true` the adapter starts SGLang with `--enable-return-routed-experts`
and adds `return_routed_experts: true` to every request. SGLang 0.5.23 then returns, per request,
the base64 of int32 `[seq_len - 1, num_hidden_layers, top_k]` (positions `[0, seqlen - 1)`: the
prompt, then every generated token but the last; managers/scheduler_components/
batch_result_processor.py:136-179, state_capturer/base.py:173-188, detokenizer_manager.py:432-448):
in `meta_info.routed_experts` on the native /generate route, in `sglext.routed_experts` on the OpenAI
routes (entrypoints/openai/protocol.py:470-477; when streaming, on its own chunk whose `choices` is
empty, serving_completions.py:428-476).

Owns a capture pass (`capture_routing`: greedy non-streamed requests that ask for routing, run
after a cell's measurement so the measured requests stay as they are), turning streamed chunks
into one response dict, the MoE layer ids of a config.json (SGLang
returns every hidden layer; dense layers carry no routing), and writing the trace through
`paged_experts.routing.trace.import_sglang_routed_experts`, which owns the decoding and the file format.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from benchsuite.errors import RunError
from paged_experts.routing.trace import Trace, import_sglang_routed_experts, save_trace


async def capture_routing(
    session: Any, base_url: str, model_name: str, prompts: Sequence[str | list[int]], max_tokens: int
) -> list[dict[str, Any]]:
    """Send each prompt once, greedy and not streamed, with `return_routed_experts: true`; return the
    responses in order. A server started without --enable-return-routed-experts answers without
    `sglext.routed_experts`, which `routing_trace` then refuses by name."""
    responses = []
    for prompt in prompts:
        body = {
            "model": model_name,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": False,
            "return_routed_experts": True,
        }
        async with session.post(f"{base_url}/v1/completions", json=body) as resp:
            if resp.status != 200:
                raise RunError(
                    f"routing capture: {base_url}/v1/completions answered HTTP {resp.status}: "
                    f"{(await resp.text())[:200]}"
                )
            responses.append(await resp.json())
    return responses


def merge_stream_chunks(chunks: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """The SSE chunk objects of one streamed /v1/completions request -> one response dict with
    `id`, `sglext` (routed_experts) and `usage` (prompt_tokens), as a non-streamed answer has them."""
    merged: dict[str, Any] = {}
    for chunk in chunks:
        if "id" in chunk and "id" not in merged:
            merged["id"] = chunk["id"]
        if isinstance(chunk.get("sglext"), dict):
            merged["sglext"] = {**merged.get("sglext", {}), **chunk["sglext"]}
        if isinstance(chunk.get("usage"), dict):
            merged["usage"] = chunk["usage"]
    return merged


def moe_layer_ids(config: dict[str, Any]) -> tuple[int, ...]:
    """Hidden layers that hold routed experts, from an HF config.json (text config for VLMs).

    Qwen2/3-MoE: every `decoder_sparse_step`-th layer not in `mlp_only_layers`; DeepSeek-style:
    layers from `first_k_dense_replace` on, every `moe_layer_freq`-th; otherwise every layer."""
    text = config.get("text_config")
    cfg: dict[str, Any] = text if isinstance(text, dict) else config
    num_layers = int(cfg["num_hidden_layers"])
    if "first_k_dense_replace" in cfg:
        first, freq = int(cfg["first_k_dense_replace"]), int(cfg.get("moe_layer_freq", 1) or 1)
        return tuple(i for i in range(num_layers) if i >= first and i % freq == 0)
    dense = set(cfg.get("mlp_only_layers") or [])
    step = int(cfg.get("decoder_sparse_step", 1) or 1)
    return tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)


def routing_trace(responses: Sequence[dict[str, Any]], config: dict[str, Any], model: str = "") -> Trace:
    """The trace of `responses` (one dict per request, in the order they ran) for a model config."""
    text = config.get("text_config")
    cfg: dict[str, Any] = text if isinstance(text, dict) else config
    num_experts = cfg.get("num_experts") or cfg.get("n_routed_experts") or cfg.get("num_local_experts")
    if not num_experts or "num_experts_per_tok" not in cfg:
        raise ValueError("config.json needs num_experts (or n_routed_experts) and num_experts_per_tok")
    return import_sglang_routed_experts(
        list(responses),
        num_experts=int(num_experts),
        # SGLang sizes the capture by num_hidden_layers and num_experts_per_tok
        # (state_capturer/routed_experts.py:72-73).
        num_layers=int(cfg["num_hidden_layers"]),
        top_k=int(cfg["num_experts_per_tok"]),
        model=model,
        moe_layer_ids=moe_layer_ids(config),
    )


def write_routing_trace(path: str | Path, responses: Sequence[dict[str, Any]], model_path: str | Path) -> Path:
    """Write the trace of `responses` for the checkpoint at `model_path` (its config.json)."""
    config = json.loads((Path(model_path).expanduser() / "config.json").read_text())
    trace = routing_trace(responses, config, model=str(model_path))
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_trace(trace, out)
    return out
