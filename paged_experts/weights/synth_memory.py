"""Synthetic models built in memory: seeded random weights straight into the host store and slots.

A 48-layer `qwen3-30b-a3b-shape` model holds 58 GB of bf16 experts; writing and re-reading that
as safetensors would need the whole disk of the test machine. Here the weights are generated on
the runtime's device by `paged_experts.weights.weightgen` (on a GPU: seconds for 58 GB, then one copy per
tensor into pinned host memory). They are the values `synth` writes for the same preset, layers
and seed, and those of the GGUF `benchsuite gguf synth` writes (its Q8_0 experts are these bf16
experts exactly): a function of (shape, layers, seed) alone, the same on every device.

Paths `MoeCausalLM.from_pretrained` accepts:
- `synth:qwen3-30b-a3b-shape?layers=48&seed=0` (no tokenizer files; the vocabulary is the size of
  the preset's tokenizer, the one a weightless directory of the preset carries);
- a weightless directory written by `write_weightless(...)`: config.json, the tokenizer files and
  `synthetic_weights.json`, no safetensors; the built-in server loads it like any checkpoint:
  `python -m paged_experts.weights.synth_memory --preset qwen3-30b-a3b-shape --layers 48 --out DIR` then
  `python -m paged_experts.server --model-path DIR ...`.

FP8 presets (`qwen3-30b-a3b-fp8-shape`, `tiny-fp8`) quantize the generated experts per 128 x 128 block
on the generator's device (fp8.quantize) into an FP8 host store with its scales, and the attention
projections the same way (kept FP8 on the device unless `RuntimeConfig.dequantize_attention`): the tensors
`synth` writes for the preset, as `loader.load` places them.

The host weights of the last model built are cached in this process, so runtimes of different
modes over the same seeded weights (a benchmark's cells) share one host store.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, fields, replace
from pathlib import Path
from urllib.parse import parse_qs

import torch

from paged_experts import fp8
from paged_experts.config import MoeModelConfig
from paged_experts.moe import make_layer
from paged_experts.residency.store import ExpertTensors
from paged_experts.runtime import RuntimeConfig
from paged_experts.weights import weightgen
from paged_experts.weights.loader import AttentionWeights, DenseWeights, LoadedModel, build_shared
from paged_experts.weights.synth import PRESETS, hf_config_for, preset_tokenizer, special_ids

MARKER = "synthetic_weights.json"
PREFIX = "synth:"


@dataclass(frozen=True)
class SynthSpec:
    preset: str
    layers: int | None
    seed: int


@dataclass
class HostWeights:
    """Every weight on the host; experts in pinned memory when the generator ran on CUDA."""

    key: tuple[object, ...]
    config: MoeModelConfig
    embed: torch.Tensor  # [V, H]
    final_norm: torch.Tensor  # [H]
    lm_head: torch.Tensor  # [V, H]
    attention: list[AttentionWeights]
    routers: list[torch.Tensor]  # [E, H] per layer
    experts: list[ExpertTensors]  # [E, ...] per layer


_CACHE: dict[tuple[object, ...], HostWeights] = {}


def clear_cache() -> None:
    _CACHE.clear()


def is_synthetic(path: str | Path) -> bool:
    return str(path).startswith(PREFIX) or (Path(path) / MARKER).is_file()


def parse_spec(path: str | Path) -> SynthSpec:
    text = str(path)
    if text.startswith(PREFIX):
        preset, _, query = text[len(PREFIX) :].partition("?")
        q = {k: v[-1] for k, v in parse_qs(query).items()}
        unknown = set(q) - {"layers", "seed"}
        if unknown:
            raise ValueError(f"{text}: unknown options {sorted(unknown)} (layers, seed)")
        spec = SynthSpec(preset, int(q["layers"]) if "layers" in q else None, int(q.get("seed", 0)))
    else:
        raw = json.loads((Path(path) / MARKER).read_text())
        spec = SynthSpec(raw["preset"], raw.get("layers"), int(raw.get("seed", 0)))
    if spec.preset not in PRESETS:
        raise ValueError(f"unknown synthetic preset {spec.preset!r}; known: {sorted(PRESETS)}")
    return spec


def config_for(spec: SynthSpec) -> MoeModelConfig:
    p = PRESETS[spec.preset]
    if spec.layers is not None:
        p = replace(p, num_layers=spec.layers)
    tok = preset_tokenizer(p.bpe_vocab_size)  # the vocabulary the weightless directory would have
    vocab = tok.get_vocab_size(with_added_tokens=True)
    bos_id, eos_id = special_ids(tok)
    return MoeModelConfig.from_hf_config(hf_config_for(p, vocab, bos_id, eos_id))


def load_synthetic(path: str | Path, runtime: RuntimeConfig) -> LoadedModel:
    spec = parse_spec(path)
    cfg = config_for(spec) if str(path).startswith(PREFIX) else MoeModelConfig.from_dir(path)
    return build_from_config(cfg, runtime, spec.seed, silent_ids(path))


def build(preset: str, runtime: RuntimeConfig, layers: int | None = None, seed: int = 0) -> LoadedModel:
    spec = SynthSpec(preset, layers, seed)
    return build_from_config(config_for(spec), runtime, seed, silent_ids(f"{PREFIX}{preset}"))


def silent_ids(path: str | Path) -> tuple[int, ...]:
    """The silent tokens (weightgen.silent_token_ids) of a weightless directory's tokenizer, or of
    the preset's tokenizer for a `synth:` path; none for a directory without a tokenizer."""
    from tokenizers import Tokenizer

    if str(path).startswith(PREFIX):
        tok = preset_tokenizer(PRESETS[parse_spec(path).preset].bpe_vocab_size)
    elif (Path(path) / "tokenizer.json").is_file():
        tok = Tokenizer.from_file(str(Path(path) / "tokenizer.json"))
    else:
        return ()
    return weightgen.silent_token_ids(tok)


def host_weights(
    cfg: MoeModelConfig,
    dtype: torch.dtype,
    seed: int,
    gen_device: torch.device,
    silent: tuple[int, ...] = (),
    packed: bool = False,
) -> HostWeights:
    """`weightgen`'s source tensors, generated on `gen_device` (the same values on every device);
    `silent`: the tokens whose output rows are zero; `packed`: every layer's experts in packed rows
    (RuntimeConfig.rows_layout; a resident layer's device rows are split all the same: `make_layer`)."""
    key = (cfg, dtype, seed, silent, gen_device.type, packed)  # the device too: CUDA's host store is pinned
    if key in _CACHE:
        return _CACHE[key]
    _CACHE.clear()  # one host store at a time: 58 GB each
    pin = gen_device.type == "cuda"
    src = weightgen.by_name(weightgen.hf_shape(cfg), silent)
    h, inter, e_n = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts

    def values(name: str) -> torch.Tensor:
        return weightgen.values_torch(seed, src[name], gen_device, dtype).to("cpu")

    # FP8 presets' projections are quantized from the fp32 values, as `synth` writes them; kept FP8 in the host
    # copy whenever the layout allows (build_from_config dequantizes them for a runtime that asks)
    fp8_attention = cfg.fp8_attention()

    def projection(name: str, short: str) -> dict[str, torch.Tensor]:
        if not cfg.fp8_weights:
            return {f"{short}_proj": values(name)}
        q, scale = fp8.quantize(weightgen.values_torch(seed, src[name], gen_device))  # [O, I] fp8, [O/128, I/128]
        if fp8_attention:
            return {f"{short}_proj": q.to("cpu"), f"{short}_scale": scale.to("cpu")}
        return {f"{short}_proj": fp8.dequantize(q, scale, dtype).to("cpu")}

    attention, routers, experts = [], [], []
    for layer in range(cfg.num_layers):
        pre = f"model.layers.{layer}"
        projections: dict[str, torch.Tensor] = {}
        for short in ("q", "k", "v", "o"):
            projections |= projection(f"{pre}.self_attn.{short}_proj.weight", short)
        attention.append(
            AttentionWeights(
                input_norm=values(f"{pre}.input_layernorm.weight"),
                q_norm=values(f"{pre}.self_attn.q_norm.weight"),
                k_norm=values(f"{pre}.self_attn.k_norm.weight"),
                post_norm=values(f"{pre}.post_attention_layernorm.weight"),
                **projections,
            )
        )
        routers.append(values(f"{pre}.mlp.gate.weight"))
        host = ExpertTensors.empty(
            e_n, h, inter, dtype, torch.device("cpu"), pin=pin, is_fp8=cfg.fp8_weights, packed=packed
        )
        for name in ("gate", "up", "down"):
            t = src[weightgen.expert_name(layer, name)]
            if not cfg.fp8_weights:
                host.get(name).copy_(weightgen.values_torch(seed, t, gen_device, dtype))  # [E, O, I]
                continue
            q, scale = fp8.quantize(weightgen.values_torch(seed, t, gen_device))  # [E, O, I] fp8, [E, O/128, I/128]
            fp8.raw(host.get(name)).copy_(fp8.raw(q))
            host.get(f"{name}_scale").copy_(scale)
        experts.append(host)
    weights = HostWeights(
        key=key,
        config=cfg,
        embed=values("model.embed_tokens.weight"),
        final_norm=values("model.norm.weight"),
        lm_head=values("lm_head.weight"),
        attention=attention,
        routers=routers,
        experts=experts,
    )
    _CACHE[key] = weights
    if gen_device.type == "cuda":
        release_generation_blocks()
    return weights


def release_generation_blocks() -> None:
    """Returns the generator's cached device blocks to the driver before anything is placed. Its temporaries (fp32
    [E, O, I] values and their block quantization: 512-768 MiB each for a 48-layer qwen3-30b-a3b shape) are free once
    the host store is filled, but torch keeps their blocks; the placed tensors would land in them, and the partly used
    segments they leave are reserved memory the first graph capture's empty_cache cannot return: device memory a
    server loading a real checkpoint (no generation on the device) never holds, counted in its measured peak."""
    torch.cuda.empty_cache()


def build_from_config(cfg: MoeModelConfig, runtime: RuntimeConfig, seed: int, silent: tuple[int, ...]) -> LoadedModel:
    """Places cached (or freshly generated) host weights for `runtime`, as `loader.load` does."""
    runtime.validate_for(cfg)
    device, dtype = runtime.torch_device, runtime.torch_dtype
    hw = host_weights(cfg, dtype, seed, device, silent, runtime.rows_layout == "packed")

    def dev(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, copy=True)

    dense = DenseWeights(embed=dev(hw.embed), final_norm=dev(hw.final_norm), lm_head=dev(hw.lm_head))
    shared, placements = build_shared(cfg, runtime)
    keep_fp8 = cfg.fp8_attention(runtime.dequantize_attention)
    attention, moe = [], []
    for i in range(cfg.num_layers):
        a = hw.attention[i]
        held: dict[str, torch.Tensor] = {f.name: getattr(a, f.name) for f in fields(a) if f.init}
        held = {name: t for name, t in held.items() if t is not None}  # a dense layer's scales are None
        if a.fp8 and not keep_fp8:  # dequantized at placement, as loader.load does a checkpoint's
            for short in ("q", "k", "v", "o"):
                held[f"{short}_proj"] = fp8.dequantize(held[f"{short}_proj"], held.pop(f"{short}_scale"), dtype)
        attention.append(AttentionWeights(**{name: dev(t) for name, t in held.items()}))
        moe.append(make_layer(i, placements[i], dev(hw.routers[i]), hw.experts[i], shared, cfg, runtime))
    return LoadedModel(config=cfg, dense=dense, attention=tuple(attention), moe=tuple(moe), counters=shared.counters)


def write_weightless(preset: str, out_dir: str | Path, layers: int | None = None, seed: int = 0) -> Path:
    """config.json + tokenizer + `synthetic_weights.json`; the weights are built when loaded."""
    from paged_experts.weights.synth import _tokenizer_config

    p = PRESETS[preset]
    if layers is not None:
        p = replace(p, num_layers=layers)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = preset_tokenizer(p.bpe_vocab_size)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    bos_id, eos_id = special_ids(tok)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(_tokenizer_config(tok), indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(hf_config_for(p, vocab, bos_id, eos_id), indent=2) + "\n")
    generation = {"bos_token_id": bos_id, "eos_token_id": [eos_id, bos_id], "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    (out / MARKER).write_text(json.dumps({"preset": preset, "layers": layers, "seed": seed}) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m paged_experts.weights.synth_memory", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--preset", choices=sorted(PRESETS), default="qwen3-30b-a3b-shape")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    print(write_weightless(args.preset, args.out, layers=args.layers, seed=args.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
