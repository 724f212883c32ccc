"""Published reference figures shipped as data (benchsuite/data/reference/<name>.yaml), as typed rows.

Owns reading those files into frozen rows and the two published ratio columns (paged vs offload,
paged vs llama.cpp best). Figures are transcribed facts, never measurements of ours.

One column needs reading with care: in pr42557.yaml the decode rows' `cpu_offload_gb` holds the
decode rate in tokens per second of the SGLang `--cpu-offload-gb` run (the "vs offload" baseline),
not an amount of memory; the published write-ups do not give the GB value used. Rows expose it as
`offload_tok_s`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from benchsuite.errors import UserError

REFERENCE_NAMES = ("pr42557",)


@dataclass(frozen=True)
class Machine:
    key: str  # e.g. desktop_16gb
    gpu: str
    vram_gb: float
    pcie: str
    ram_gb: float
    os: str


@dataclass(frozen=True)
class DecodeRow:
    """Decode output tokens per second: per stream at concurrency 1, aggregate at concurrency 4."""

    machine: str
    quant: str  # gptq_int4 | fp8_block
    resident_experts: int  # K
    concurrency: int
    paged_tok_s: float
    paged_high_tok_s: float | None  # upper end where a range was published
    llamacpp_best_tok_s: float | None
    offload_tok_s: float | None

    @property
    def paged_vs_offload(self) -> float | None:
        return None if not self.offload_tok_s else self.paged_tok_s / self.offload_tok_s

    @property
    def paged_vs_llamacpp(self) -> float | None:
        return None if not self.llamacpp_best_tok_s else self.paged_tok_s / self.llamacpp_best_tok_s


@dataclass(frozen=True)
class TtftRow:
    """TTFT p50 in milliseconds for short prompts and for 2,048-token prompts."""

    machine: str
    quant: str
    engine: str  # paged | llamacpp_best
    short_ms: float
    long_2048_ms: float


@dataclass(frozen=True)
class PublishedRules:
    """The workload rules every published cell followed (DESIGN.md section 2)."""

    prompts: str  # ShareGPT
    output_tokens: int
    kv_capacity_tokens: int
    prefix_caching: bool
    min_repeats: int  # each headline cell measured at least this often
    concurrency: tuple[int, ...]


@dataclass(frozen=True)
class Reference:
    name: str
    model: str
    machines: tuple[Machine, ...]
    decode: tuple[DecodeRow, ...]
    ttft: tuple[TtftRow, ...]
    rules: PublishedRules
    expert_bytes: dict[str, float]  # one expert of one layer, by quantization
    workload: dict[str, Any]  # the published rules as transcribed (text annotations included)
    raw: dict[str, Any]  # the whole file, for facts without a typed row (accuracy, llama.cpp cache)

    def decode_rows(self, machine: str | None = None, quant: str | None = None) -> tuple[DecodeRow, ...]:
        return tuple(r for r in self.decode if machine in (None, r.machine) and quant in (None, r.quant))


def load_reference(name: str) -> Reference:
    """The reference shipped under `name`; UserError naming the known ones otherwise."""
    if name not in REFERENCE_NAMES:
        raise UserError(f"reference {name!r} is not shipped (known: {', '.join(REFERENCE_NAMES)})")
    text = resources.files("benchsuite").joinpath("data", "reference", f"{name}.yaml").read_text()
    return parse_reference(name, yaml.safe_load(text))


def read_reference_file(name: str, path: str | Path) -> Reference:
    """A reference from a file outside the package (a hand-made one in tests, a user's own)."""
    return parse_reference(name, yaml.safe_load(Path(path).read_text()))


def parse_reference(name: str, data: dict[str, Any]) -> Reference:
    machines = tuple(
        Machine(key, str(m["gpu"]), float(m["vram_gb"]), str(m["pcie"]), float(m["ram_gb"]), str(m["os"]))
        for key, m in (data.get("machines") or {}).items()
    )
    decode = []
    for section, concurrency in (("single_stream_decode", 1), ("four_requests_decode", 4)):
        for row in data.get(section) or []:
            decode.append(
                DecodeRow(
                    machine=str(row["machine"]),
                    quant=str(row["quant"]),
                    resident_experts=int(row["K"]),
                    concurrency=concurrency,
                    paged_tok_s=float(row["paged"]),
                    paged_high_tok_s=_opt(row.get("paged_high")),
                    llamacpp_best_tok_s=_opt(row.get("llamacpp_best")),
                    offload_tok_s=_opt(row.get("cpu_offload_gb")),
                )
            )
    ttft = []
    for row in data.get("ttft_p50_ms") or []:
        for engine in ("paged", "llamacpp_best"):
            if row.get(engine) is not None:
                short_ms, long_ms = row[engine]
                ttft.append(TtftRow(str(row["machine"]), str(row["quant"]), engine, float(short_ms), float(long_ms)))
    workload = dict(data.get("workload") or {})
    rules = PublishedRules(
        prompts=str(workload.get("prompts", "")),
        output_tokens=_leading_int(workload["output_tokens"]),
        kv_capacity_tokens=_leading_int(workload["kv_capacity_tokens"]),
        prefix_caching=not str(workload["prefix_caching"]).lower().startswith("off"),
        min_repeats=_repeats(str(workload["repeats"])),
        concurrency=tuple(sorted({row.concurrency for row in decode})),
    )
    return Reference(
        name=name,
        model=str(data.get("model", "")),
        machines=machines,
        decode=tuple(decode),
        ttft=tuple(ttft),
        rules=rules,
        expert_bytes={str(k): float(v) for k, v in (data.get("expert_bytes") or {}).items()},
        workload=workload,
        raw=data,
    )


def _repeats(text: str) -> int:
    """ "each headline cell measured at least twice" -> 2."""
    words = {"once": 1, "twice": 2, "three times": 3}
    for word, count in words.items():
        if word in text:
            return count
    return _leading_int(re.sub(r"^\D+", "", text))


def _leading_int(value: Any) -> int:
    """10240 or "10240 (all engines)" -> 10240 (the file annotates some values in words)."""
    match = re.match(r"\s*(\d[\d,]*)", str(value))
    if match is None:
        raise ValueError(f"no number in published value {value!r}")
    return int(match.group(1).replace(",", ""))


def _opt(value: Any) -> float | None:
    return None if value is None else float(value)
