"""The H200 benchmark JSON files as benchsuite records: one CellResult per measured or failed cell,
the RequestRecords the serve benchmark kept, and one manifest server entry per engine command.

Inputs (their schemas belong to the scripts that write them):
- `decode_h200.json` (benchmarks/decode_h200.py): the in-process decode loop, one cell per
  (mode, variant, routing, batch);
- `llamacpp_h200.json`: llama.cpp at fixed `--n-cpu-moe N` and at the N it fitted to a budget;
- `serve_<name>.json` (benchmarks/serve_decode.py): the built-in server over HTTP, one per config.

Why the metrics map as they do: the report's headline is per-request decode tok/s at concurrency 1
and aggregate output tok/s above it (benchsuite.report.tables.headline_metric), so
- output_tok_s = the benchmark's aggregate rate (decode loop: B x steps / decode seconds);
- decode_tok_s_p50 = one sequence's rate: aggregate / B in the lock-step decode loop (each of the B
  sequences gains exactly one token per step), the serve median over requests, and llama.cpp's
  reported rate at batch 1 only (its per-stream rate at batch 4 is not in its JSON).
Every key a benchmark wrote for a cell stays in extras["bench"] (keys added later included) and
every record carries extras["provenance"]. A cell with an `error` is `failed` with that reason; a
mode that failed to build (no routing or batch recorded) becomes one failed cell per routing and
batch its command asked for, so an expected cell never silently disappears.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from benchsuite.records import CellResult, RequestRecord

DECODE_SERVER_ID = "decode_h200"
DECODE_WORKLOAD = "decode"  # llama.cpp cells share it: both are decode after a short prompt
SHORT_PROMPT_CLASS = "short"
SERVE_WORKLOAD = "serve_decode"
# decode_h200.py's argparse defaults, for commands that leave these flags out
_DECODE_DEFAULT_FLAGS = {"--routings": "model,qwen3-30b-a3b", "--batches": "1,4", "--prompt": "32"}


@dataclass(frozen=True)
class Source:
    """One input file: its role in the run, file name, sha256 and parsed JSON."""

    role: str  # decode | llamacpp | serve
    name: str
    sha256: str
    data: dict[str, Any]


@dataclass
class Converted:
    cells: list[CellResult] = field(default_factory=list)
    requests: dict[str, list[RequestRecord]] = field(default_factory=dict)  # cell_id -> records
    servers: dict[str, dict[str, Any]] = field(default_factory=dict)  # manifest.servers entries

    def add(self, cell: CellResult, records: list[RequestRecord] | None = None) -> None:
        self.cells.append(cell)
        self.requests[cell.cell_id] = records or []


def routing_of(source: str) -> str:
    """benchsuite's routing field: 'model', or 'synthetic:<preset>' so the report labels it everywhere."""
    return "model" if source in ("model", "", None) else f"synthetic:{str(source).removeprefix('synthetic:')}"


def routing_text(routing: str, engine: str) -> str:
    if routing.startswith("synthetic:"):
        return (f"SYNTHETIC routing: paged_experts.routing preset '{routing.split(':', 1)[1]}', calibrated to the published "
                "Qwen3-30B-A3B locality; not a real router")
    if engine == "llama.cpp":
        return "the GGUF's own router (the synthetic model's seeded random weights: near-uniform routing)"
    return "the model's own router (seeded random weights: near-uniform routing, pessimistic for paging)"


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", str(text)).strip("-").lower() or "x"


def flag_value(argv: list[str], flag: str, default: str | None = None) -> str | None:
    """The last value given to `flag` in argv (`--flag v` or `--flag=v`), else default."""
    found = default
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            found = argv[i + 1]
        elif arg.startswith(flag + "="):
            found = arg.split("=", 1)[1]
    return found


def variant_label(cell: dict[str, Any]) -> str | None:
    """What tells two cells of one mode apart, as decode_h200.py names it ('graphs+overlap', 'host', 'loop');
    files written before `variant` existed say it through kernel / graphs, mapped to the same names."""
    options = {o for o in str(cell.get("variant") or "").split("+") if o and o != "default"}
    if cell.get("kernel") not in (None, "", "fused"):
        options.add(str(cell["kernel"]))
    if cell.get("graphs"):
        options.add("graphs")
    return "+".join(sorted(options)) or None


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _unique_id(base: str, taken: dict[str, int]) -> tuple[str, int]:
    """(cell id, repeat): a second cell of the same configuration is its repeat 1, id suffixed -r1."""
    repeat = taken.get(base, 0)
    taken[base] = repeat + 1
    return (base if repeat == 0 else f"{base}-r{repeat}"), repeat


def _provenance(source: Source, machine: dict[str, Any], engine: str, version: dict[str, Any], command: list[str],
                git: dict[str, Any], routing: str, **more: Any) -> dict[str, Any]:
    return {
        "engine": engine, "engine_version": version, "command": command, "benchmark": source.data.get("benchmark"),
        "input_file": source.name, "input_sha256": source.sha256, "machine": machine, "git": git,
        "date_utc": more.pop("date_utc", None) or machine.get("date_utc"), "routing_source": routing_text(routing, engine), **more,
    }


# ---- decode_h200.json ---------------------------------------------------------------------------


def _decode_expanded(data: dict[str, Any]) -> list[dict[str, Any]]:
    """The cells, with each build failure (no routing / batch) repeated for every routing and batch asked for."""
    argv = [str(a) for a in data.get("command") or []]
    routings = str(flag_value(argv, "--routings", _DECODE_DEFAULT_FLAGS["--routings"])).split(",")
    batches = [int(b) for b in str(flag_value(argv, "--batches", _DECODE_DEFAULT_FLAGS["--batches"])).split(",") if b]
    out = []
    for cell in data.get("cells") or []:
        if "routing" in cell and "batch" in cell:
            out.append(cell)
            continue
        out.extend({**cell, "routing": r, "batch": b, "expanded_from_mode_failure": True} for r in routings for b in batches)
    return out


def decode_params(cell: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(benchsuite mode, params) of a decode cell: 'paged:32' -> ('paged', {resident_experts: 32})."""
    name, _, n = str(cell.get("mode", "")).partition(":")
    params: dict[str, Any] = {}
    if name == "paged" and n.isdigit():
        params["resident_experts"] = int(n)
    elif name == "cpu-experts" and n.isdigit():
        params["cpu_expert_layers"] = int(n)
    variant = variant_label(cell)
    if variant:
        params["variant"] = variant
    return name, params


def convert_decode(source: Source, machine: dict[str, Any], out: Converted, taken: dict[str, int]) -> None:
    data = source.data
    prov = data.get("provenance") or {}
    command = [str(a) for a in data.get("command") or []]
    git = {"commit": prov.get("git_commit"), "dirty": prov.get("git_dirty")}
    version = {"engine": "paged_experts (built-in)", "git_commit": prov.get("git_commit"), "torch": prov.get("torch"),
               "python": prov.get("python"), "grouped_backend": data.get("grouped_backend")}
    out.servers[DECODE_SERVER_ID] = {
        "server_id": DECODE_SERVER_ID, "engine": "paged_experts", "kind": "builtin", "argv": command, "version": version,
        "options": {"model": data.get("model"), "device": flag_value(command, "--device", "cuda")},
        "note": "one in-process benchmark process (no HTTP server) ran every decode cell",
    }
    prompt_tokens = flag_value(command, "--prompt", _DECODE_DEFAULT_FLAGS["--prompt"])
    for cell in _decode_expanded(data):
        mode, params = decode_params(cell)
        routing, batch = routing_of(str(cell["routing"])), int(cell["batch"])
        base = slug(f"dec-{cell.get('mode')}-{params.get('variant') or ''}-{cell['routing']}-b{batch}")
        cell_id, repeat = _unique_id(base, taken)
        tok_s = _num(cell.get("tok_per_s"))
        failed = bool(cell.get("error")) or tok_s is None
        hit = _num(cell.get("hit_rate"))
        steps = cell.get("steps")
        extras = {
            "source": "decode_h200", "bench": cell, "prompt_tokens": prompt_tokens,
            "provenance": _provenance(source, machine, "paged_experts", version, command, git, routing,
                                      model=data.get("model"), gpu_reported=prov.get("gpu")),
        }
        out.add(CellResult(
            cell_id=cell_id, run_id="", engine="paged_experts", engine_kind="builtin", mode=mode, server_id=DECODE_SERVER_ID,
            params=params, workload=DECODE_WORKLOAD, prompt_class=SHORT_PROMPT_CLASS, concurrency=batch, repeat=repeat,
            status="failed" if failed else "ok", reason=(str(cell.get("error") or "no tok_per_s recorded") if failed else None),
            routing=routing, num_requests=batch,
            resident_experts=params.get("resident_experts"), n_cpu_moe=params.get("cpu_expert_layers"),
            decode_tok_s_p50=None if failed else tok_s / batch, output_tok_s=None if failed else tok_s,
            window_s=_num(cell.get("decode_s")),
            output_tokens_total=int(steps) * batch if isinstance(steps, int) and not failed else None,
            miss_rate=None if failed or hit is None else 1.0 - hit,
            bytes_paged_per_token=None if failed else _num(cell.get("bytes_paged_per_token")),
            waves_per_step=None if failed else _num(cell.get("waves_per_layer_step")),
            union_mean=None if failed else _num(cell.get("union_per_layer_step")),
            extras=extras,
        ))


# ---- llamacpp_h200.json -------------------------------------------------------------------------


def is_fitted(cell: dict[str, Any]) -> bool:
    return str(cell.get("label", "")).lower().startswith("fit")


def convert_llamacpp(source: Source, machine: dict[str, Any], out: Converted, taken: dict[str, int]) -> None:
    data = source.data
    prov = data.get("provenance") or {}
    fit = data.get("fit") or {}
    git = {"commit": prov.get("git_commit"), "dirty": prov.get("git_dirty")}
    version = {"engine": "llama.cpp", "llama_cpp_python": prov.get("llama_cpp_python_version"),
               "llama_version_text": prov.get("llama_version_text"), "build_flags": prov.get("build_flags")}
    for cell in data.get("cells") or []:
        n = cell.get("n_cpu_moe")
        batch = int(cell["batch"])  # the schema always names it; a guess would file the cell under the wrong batch
        fitted = is_fitted(cell)
        params: dict[str, Any] = {"n_cpu_moe": n}
        if fitted:
            params["fit_budget_gb"] = fit.get("budget_gb")  # apart from a fixed-N cell at the same N
        command = [str(a) for a in cell.get("command") or data.get("command") or []]
        server_id = slug(f"llamacpp-{'fit-' if fitted else ''}n{n}")
        out.servers.setdefault(server_id, {
            "server_id": server_id, "engine": "llama.cpp", "kind": "llamacpp", "argv": command, "version": version,
            "options": {"n_cpu_moe": n, "model": (data.get("gguf") or {}).get("path")},
        })
        cell_id, repeat = _unique_id(slug(f"llama-{'fit-' if fitted else ''}n{n}-b{batch}"), taken)
        tok_s = _num(cell.get("tok_per_s"))
        failed = bool(cell.get("error")) or tok_s is None
        extras: dict[str, Any] = {
            "source": "llamacpp_h200", "bench": {k: v for k, v in cell.items() if k != "raw"}, "raw": cell.get("raw"),
            "gguf_expert_type": (data.get("gguf") or {}).get("expert_type"),
            "provenance": _provenance(source, machine, "llama.cpp", version, command, git, "model",
                                      build_s=prov.get("build_s"), gguf=data.get("gguf"), gpu_reported=prov.get("gpu")),
        }
        if fitted:  # the search table's fields: llama.cpp's own projection chose this N for the budget
            extras.update(fits=True, chosen=True, search_n=n, fit_command=fit.get("command"), budget_gb=fit.get("budget_gb"))
        out.add(CellResult(
            cell_id=cell_id, run_id="", engine="llama.cpp", engine_kind="llamacpp", mode="n-cpu-moe", server_id=server_id,
            params=params, workload=DECODE_WORKLOAD, prompt_class=SHORT_PROMPT_CLASS, concurrency=batch, repeat=repeat,
            status="failed" if failed else "ok", reason=(str(cell.get("error") or "no tok_per_s recorded") if failed else None),
            routing="model", num_requests=batch, n_cpu_moe=n if isinstance(n, int) else None,
            decode_tok_s_p50=tok_s if not failed and batch == 1 else None, output_tok_s=None if failed else tok_s,
            prompt_tokens_mean=_num(cell.get("prompt_tokens")), extras=extras,
        ))


# ---- serve_<name>.json --------------------------------------------------------------------------


def serve_name(file_name: str) -> str:
    return re.sub(r"^serve_|\.json$", "", file_name)


def convert_serve(source: Source, machine: dict[str, Any], out: Converted, taken: dict[str, int]) -> None:
    data = source.data
    info = data.get("server_info") or {}
    opts = info.get("server") or {}
    name = serve_name(source.name)
    server_id = slug(f"serve-{name}")
    git = dict(data.get("git") or {})
    version = {"engine": "paged_experts.server.app (built-in)", **(info.get("versions") or {}), "git_commit": git.get("commit")}
    argv = [str(a) for a in data.get("server_argv") or []]
    command = [str(a) for a in data.get("command") or []]
    out.servers[server_id] = {"server_id": server_id, "engine": "paged_experts.server.app", "kind": "builtin", "argv": argv,
                              "version": version, "options": opts, "benchmark_command": command}
    mode = str(opts.get("mode") or (info.get("runtime") or {}).get("mode") or "unknown")
    params = {k: opts[k] for k in ("resident_experts", "offload_layers", "n_cpu_moe") if opts.get(k) is not None}
    routing = routing_of("model" if not info.get("routing_synthetic") else str(data.get("routing")))
    settings = data.get("settings") or {}
    prompt_class = str(settings.get("prompt_tokens", "unknown"))
    started = data.get("started_unix_s")
    for result in data.get("results") or []:
        c = int(result["concurrency"])
        cell_id, repeat = _unique_id(slug(f"serve-{name}-c{c}"), taken)
        hit = _num(result.get("hit_rate"))
        delta = result.get("counters_delta") or {}
        requests = result.get("requests") or []
        records = [RequestRecord(
            cell_id=cell_id, request_index=i, warmup=False, cold=False, prompt_id=f"{cell_id}-{i}", prompt_class=prompt_class,
            max_tokens=int(settings.get("max_tokens") or 0), t_sent_s=0.0, t_first_token_s=_num(r.get("ttft_s")),
            t_done_s=_num(r.get("e2e_s")), output_tokens=r.get("completion_tokens"), ok=True,
            # serve_decode keeps no chunk times: only ttft, first->last text chunk span and e2e (times from the request's send)
            engine_timings={"decode_s": r.get("decode_s"), "note": "serve_decode.py RequestTiming; t_sent_s = 0"},
        ) for i, r in enumerate(requests)]
        tok_s = _num(result.get("decode_tok_s_aggregate_median"))
        extras = {
            "source": "serve_decode", "config_name": name, "bench": {k: v for k, v in result.items() if k != "requests"},
            "provenance": _provenance(source, machine, "paged_experts.server.app", version, command, git, routing,
                                      server_argv=argv, date_utc=_utc(started)),
        }
        out.add(CellResult(
            cell_id=cell_id, run_id="", engine="paged_experts.server.app", engine_kind="builtin", mode=mode, server_id=server_id,
            params=params, workload=SERVE_WORKLOAD, prompt_class=prompt_class, concurrency=c, repeat=repeat,
            status="ok" if tok_s is not None else "failed", reason=None if tok_s is not None else "no decode rate recorded",
            routing=routing, num_requests=len(records), num_errors=0, error_rate=0.0,
            resident_experts=opts.get("resident_experts"), n_cpu_moe=opts.get("n_cpu_moe"), options=dict(opts),
            decode_tok_s_p50=_num(result.get("decode_tok_s_per_stream_median")),
            output_tok_s=_num(result.get("output_tok_s_wall_median")), ttft_p50_s=_num(result.get("ttft_s_median")),
            output_tokens_total=sum(int(r.get("completion_tokens") or 0) for r in requests),
            expert_hits=_int(delta.get("expert_hits_total")), expert_misses=_int(delta.get("expert_misses_total")),
            expert_activations=_int(delta.get("expert_activations_total")), bytes_paged=_int(delta.get("bytes_paged_total")),
            miss_rate=None if hit is None else 1.0 - hit, waves_per_step=_num(result.get("waves_per_moe_step")),
            union_mean=_num(result.get("union_per_moe_step")), extras=extras,
        ), records)


def _int(value: Any) -> int | None:
    number = _num(value)
    return None if number is None else int(number)


def _utc(unix_s: Any) -> str | None:
    from datetime import datetime, timezone

    number = _num(unix_s)
    return None if number is None else datetime.fromtimestamp(number, timezone.utc).isoformat(timespec="seconds")


CONVERTERS = {"decode": convert_decode, "llamacpp": convert_llamacpp, "serve": convert_serve}


def convert(sources: list[Source], machine: dict[str, Any], run_id: str) -> Converted:
    """Every input's cells, with run_id set; cell ids are unique across inputs."""
    out = Converted()
    taken: dict[str, int] = {}
    for source in sources:
        CONVERTERS[source.role](source, machine, out, taken)
    for cell in out.cells:
        cell.run_id = run_id
    return out
