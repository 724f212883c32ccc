"""Synthetic models built in memory: seeded random weights straight into the host store and slots.

A 48-layer `qwen3-30b-a3b-shape` model holds 58 GB of bf16 experts; writing and re-reading that
as safetensors would need the whole disk of the test machine. Here the weights are generated on
the runtime's device with a seeded generator (a CUDA generator on a GPU: seconds for 58 GB, then
one copy per tensor into pinned host memory) with the shapes and standard deviations `synth`
writes. The values are NOT byte-identical to `synth`'s files (that stream is one CPU generator in
file order); they are a deterministic function of (preset, layers, seed, generator device).

Paths `MoeCausalLM.from_pretrained` accepts:
- `synth:qwen3-30b-a3b-shape?layers=48&seed=0` (no tokenizer: vocab = the preset's BPE bound);
- a weightless directory written by `write_weightless(...)`: config.json, the tokenizer files and
  `synthetic_weights.json`, no safetensors; the built-in server loads it like any checkpoint:
  `python -m paged_experts.synth_memory --preset qwen3-30b-a3b-shape --layers 48 --out DIR` then
  `python -m paged_experts.server --model-path DIR ...`.

FP8 presets (`qwen3-30b-a3b-fp8-shape`, `tiny-fp8`) quantize the generated experts per 128 x 128 block
on the generator's device (fp8.quantize) into an FP8 host store with its scales; attention stays dense.

The host weights of the last model built are cached in this process, so runtimes of different
modes over the same seeded weights (a benchmark's cells) share one host store.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass, fields, replace
from pathlib import Path
from urllib.parse import parse_qs

import torch

from paged_experts import fp8
from paged_experts.config import MoeModelConfig
from paged_experts.loader import AttentionWeights, DenseWeights, LoadedModel, build_shared
from paged_experts.moe import make_layer
from paged_experts.runtime import RuntimeConfig
from paged_experts.store import ExpertTensors
from paged_experts.synth import LOGIT_STD, PRESETS, hf_config_for

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
    vocab = p.bpe_vocab_size
    return MoeModelConfig.from_hf_config(hf_config_for(p, vocab, vocab - 3, vocab - 1))


def load_synthetic(path: str | Path, runtime: RuntimeConfig) -> LoadedModel:
    spec = parse_spec(path)
    cfg = config_for(spec) if str(path).startswith(PREFIX) else MoeModelConfig.from_dir(path)
    return build_from_config(cfg, runtime, spec.seed)


def build(preset: str, runtime: RuntimeConfig, layers: int | None = None, seed: int = 0) -> LoadedModel:
    return build_from_config(config_for(SynthSpec(preset, layers, seed)), runtime, seed)


def host_weights(cfg: MoeModelConfig, dtype: torch.dtype, seed: int, gen_device: torch.device) -> HostWeights:
    """Seeded weights of every tensor; one generator per (layer, tensor) so layers build independently."""
    key = (cfg, dtype, seed, gen_device.type)
    if key in _CACHE:
        return _CACHE[key]
    _CACHE.clear()  # one host store at a time: 58 GB each
    pin = gen_device.type == "cuda"
    h, inter, d, e_n = cfg.hidden_size, cfg.moe_intermediate_size, cfg.head_dim, cfg.num_experts

    def normal(tag: int, shape: tuple[int, ...], std: float, out: torch.Tensor | None = None) -> torch.Tensor:
        gen = torch.Generator(device=gen_device).manual_seed(seed * 1_000_003 + tag)
        t = (torch.randn(shape, generator=gen, device=gen_device, dtype=torch.float32) * std).to(dtype)
        if out is None:
            return t.to("cpu")
        out.copy_(t)
        return out

    def norm_weight(tag: int, n: int) -> torch.Tensor:
        gen = torch.Generator(device=gen_device).manual_seed(seed * 1_000_003 + tag)
        return (1.0 + 0.1 * torch.randn(n, generator=gen, device=gen_device)).to(dtype).to("cpu")

    attention, routers, experts = [], [], []
    for layer in range(cfg.num_layers):
        t = 100 * (layer + 1)
        attention.append(
            AttentionWeights(
                input_norm=norm_weight(t + 0, h),
                q_proj=normal(t + 1, (cfg.num_heads * d, h), 1 / math.sqrt(h)),
                k_proj=normal(t + 2, (cfg.num_kv_heads * d, h), 1 / math.sqrt(h)),
                v_proj=normal(t + 3, (cfg.num_kv_heads * d, h), 1 / math.sqrt(h)),
                o_proj=normal(t + 4, (h, cfg.num_heads * d), 0.5 / math.sqrt(cfg.num_heads * d)),
                q_norm=norm_weight(t + 5, d),
                k_norm=norm_weight(t + 6, d),
                post_norm=norm_weight(t + 7, h),
            )
        )
        routers.append(normal(t + 8, (e_n, h), 2 / math.sqrt(h)))
        host = ExpertTensors.empty(e_n, h, inter, dtype, torch.device("cpu"), pin=pin, is_fp8=cfg.fp8_weights)
        projections = (
            (9, "gate", (e_n, inter, h), h),
            (10, "up", (e_n, inter, h), h),
            (11, "down", (e_n, h, inter), inter),
        )
        for tag, name, shape, std in projections:
            if not cfg.fp8_weights:
                normal(t + tag, shape, 1 / math.sqrt(std), out=host.get(name))
                continue
            gen = torch.Generator(device=gen_device).manual_seed(seed * 1_000_003 + t + tag)
            values = torch.randn(shape, generator=gen, device=gen_device, dtype=torch.float32) / math.sqrt(std)
            q, scale = fp8.quantize(values)  # [E, O, I] fp8, [E, O/128, I/128] fp32
            del values
            fp8.raw(host.get(name)).copy_(fp8.raw(q))
            host.get(f"{name}_scale").copy_(scale)
        experts.append(host)
    v = cfg.vocab_size
    weights = HostWeights(
        key=key,
        config=cfg,
        embed=normal(1, (v, h), 1.0),
        final_norm=norm_weight(2, h),
        lm_head=normal(3, (v, h), LOGIT_STD / math.sqrt(h)),
        attention=attention,
        routers=routers,
        experts=experts,
    )
    _CACHE[key] = weights
    return weights


def build_from_config(cfg: MoeModelConfig, runtime: RuntimeConfig, seed: int) -> LoadedModel:
    """Places cached (or freshly generated) host weights for `runtime`, as `loader.load` does."""
    runtime.validate_for(cfg)
    device, dtype = runtime.torch_device, runtime.torch_dtype
    hw = host_weights(cfg, dtype, seed, device)

    def dev(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, copy=True)

    dense = DenseWeights(embed=dev(hw.embed), final_norm=dev(hw.final_norm), lm_head=dev(hw.lm_head))
    shared, placements = build_shared(cfg, runtime)
    attention, moe = [], []
    for i in range(cfg.num_layers):
        a = hw.attention[i]
        attention.append(AttentionWeights(**{f.name: dev(getattr(a, f.name)) for f in fields(a) if f.init}))
        moe.append(make_layer(i, placements[i], dev(hw.routers[i]), hw.experts[i], shared, cfg, runtime))
    return LoadedModel(config=cfg, dense=dense, attention=tuple(attention), moe=tuple(moe), counters=shared.counters)


def write_weightless(preset: str, out_dir: str | Path, layers: int | None = None, seed: int = 0) -> Path:
    """config.json + tokenizer + `synthetic_weights.json`; the weights are built when loaded."""
    from paged_experts.synth import _tokenizer_config, train_tokenizer

    p = PRESETS[preset]
    if layers is not None:
        p = replace(p, num_layers=layers)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(p.bpe_vocab_size)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    bos_id, eos_id = tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(_tokenizer_config(tok), indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(hf_config_for(p, vocab, bos_id, eos_id), indent=2) + "\n")
    generation = {"bos_token_id": bos_id, "eos_token_id": [eos_id, bos_id], "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    (out / MARKER).write_text(json.dumps({"preset": preset, "layers": layers, "seed": seed}) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m paged_experts.synth_memory", description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="qwen3-30b-a3b-shape")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    print(write_weightless(args.preset, args.out, layers=args.layers, seed=args.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
