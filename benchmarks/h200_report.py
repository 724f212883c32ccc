"""The H200 benchmark JSON files as one benchsuite results run plus its HTML report.

    python benchmarks/h200_report.py --decode decode_h200.json [--llamacpp llamacpp_h200.json] \
        [--serve-dir DIR_WITH_serve_*.json] [--linkbw linkbw.json] [--env env.txt] \
        --results results/h200-2026-11-29 --report reports/h200-2026-11-29 [--overwrite]

The run has the layout `benchsuite run` writes (manifest.json, cells/, cells.parquet/csv,
requests.parquet), so `benchsuite report RUN_DIR` reads it too; this script's report adds the
H200 tables (benchsuite.report.h200_tables) in front of the standard ones. Conversion rules are
in h200_cells.py. The input files are copied byte for byte under `<results>/inputs/` (sha256 in
the manifest), so every number can be recomputed from what the benchmarks wrote.
env.txt is benchmarks/h200_suite.sh's: `date -u`, an nvidia-smi CSV (name, memory, PCIe gen,
width), nproc, `free -g`, the python/torch/cuda line, package lines, `git log --oneline -1`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling h200_cells module

from h200_cells import Source, convert

from benchsuite.schema_v1 import manifest_from_v1
from benchsuite.store import RunStore

SCRIPT = "benchmarks/h200_report.py"


def parse_env(text: str) -> dict[str, Any]:
    """Facts of an h200_suite.sh env.txt; a line that is not there gives no key (never a guess)."""
    lines = [line.rstrip() for line in text.splitlines()]
    facts: dict[str, Any] = {}
    packages: dict[str, str] = {}
    for i, line in enumerate(lines):
        if line.startswith("name,") and "pcie" in line and i + 1 < len(lines):
            keys = [k.strip() for k in line.split(",")]
            values = [v.strip() for v in lines[i + 1].split(",")]
            row = dict(zip(keys, values))
            facts["gpu_name"] = row.get("name")
            facts["gpu_memory_total"] = next((v for k, v in row.items() if k.startswith("memory.total")), None)
            gen, width = row.get("pcie.link.gen.current"), row.get("pcie.link.width.current")
            if gen and width:
                facts["pcie_link"] = f"PCIe Gen{gen} x{width} (current link as nvidia-smi read it)"
        elif re.fullmatch(r"\d+", line.strip()) and "cpu_count" not in facts:
            facts["cpu_count"] = int(line.strip())
        elif line.startswith("Mem:"):
            facts["ram_total_gib"] = int(line.split()[1])
        elif line.startswith("python ") and " torch " in line:
            words = line.split()
            facts.update({words[j]: words[j + 1] for j in range(0, len(words) - 1, 2)})
        elif re.fullmatch(r"[a-z_]+ \S+", line.strip()) and i != len(lines) - 1:  # "<package> <version|MISSING>"
            name, value = line.split()
            packages[name] = value
    date = _env_date(lines[0]) if lines else None
    if date:
        facts["date_utc"] = date
    if packages:
        facts["packages"] = packages
    if lines and re.match(r"^[0-9a-f]{7,40} ", lines[-1]):
        facts["git_oneline"] = lines[-1]
    return facts


def _env_date(line: str) -> str | None:
    try:  # `date -u`: "Sun Nov 29 10:00:00 UTC 2026"
        return datetime.strptime(line.strip(), "%a %b %d %H:%M:%S %Z %Y").replace(tzinfo=timezone.utc).isoformat()
    except ValueError:
        return None


def machine_of(env: dict[str, Any], sources: list[Source], linkbw: dict[str, Any] | None) -> dict[str, Any]:
    """The machine facts every record carries: env.txt first, then what the benchmark JSONs report."""
    provs = [s.data.get("provenance") or {} for s in sources]
    gpu = env.get("gpu_name") or next((p.get("gpu") for p in provs if p.get("gpu")), None)
    cpus = env.get("cpu_count") or next((p.get("cpu_count") for p in provs if p.get("cpu_count")), None)
    machine: dict[str, Any] = {"gpu": gpu, "pcie_link": env.get("pcie_link"), "cpu_count": cpus, "date_utc": env.get("date_utc")}
    if linkbw is not None:
        machine["link_paging_gb_per_s"] = linkbw.get("paging_gb_per_s")
    return machine


def model_facts(sources: list[Source]) -> dict[str, Any]:
    """num_experts / top_k / layers of the decode model spec (synth:PRESET?layers=N), else of a serve server."""
    for s in sources:
        match = re.match(r"synth:([\w.-]+)\?layers=(\d+)", str(s.data.get("model", "")))
        if s.role == "decode" and match:
            facts: dict[str, Any] = {"spec": s.data["model"], "num_moe_layers": int(match.group(2))}
            try:
                from paged_experts.synth import PRESETS

                preset = PRESETS[match.group(1)]
                facts.update(num_experts=preset.num_experts, top_k=preset.top_k)
            except (ImportError, KeyError):
                pass
            facts["expert_bytes"] = (s.data.get("bytes") or {}).get("expert")
            return facts
    for s in sources:
        shape = (s.data.get("server_info") or {}).get("model")
        if s.role == "serve" and isinstance(shape, dict):
            return {"num_experts": shape.get("num_experts"), "top_k": shape.get("top_k"), "num_moe_layers": shape.get("num_layers")}
    return {}


def _read_source(role: str, path: Path) -> Source:
    raw = path.read_bytes()
    return Source(role, path.name, hashlib.sha256(raw).hexdigest(), json.loads(raw))


def manifest_for(run_id: str, sources: list[Source], env: dict[str, Any], env_raw: str | None,
                 linkbw: dict[str, Any] | None, servers: dict[str, dict[str, Any]], argv: list[str]) -> dict[str, Any]:
    decode = next((s.data for s in sources if s.role == "decode"), {})
    llama = next((s.data for s in sources if s.role == "llamacpp"), {})
    machine = machine_of(env, sources, linkbw)
    engines = {name: {"kind": kind} for name, kind in {(v["engine"], v["kind"]) for v in servers.values()}}
    inputs = {s.name: {"role": s.role, "sha256": s.sha256, "stored_as": f"inputs/{s.name}"} for s in sources}
    prov = decode.get("provenance") or llama.get("provenance") or {}
    return {
        "run_id": run_id,
        "created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "matrix_hash": hashlib.sha256("".join(sorted(s.sha256 for s in sources)).encode()).hexdigest(),
        "matrix_source": f"{SCRIPT} (converted from benchmark JSON files, not a matrix.yaml run)",
        "matrix": {"name": run_id, "engines": engines,
                   "fairness": {"note": "not a matrix run: each benchmark fixed its own settings; see each server's command"}},
        "machine": {"gpus": [{"name": machine["gpu"], "memory_total": env.get("gpu_memory_total"), "pcie_link": machine["pcie_link"]}],
                    "cpu_cores_logical": machine["cpu_count"], "ram_total_gib": env.get("ram_total_gib"),
                    "python": env.get("python") or prov.get("python"), "torch": env.get("torch") or prov.get("torch"),
                    "cuda": env.get("cuda"), "packages": env.get("packages") or {}, "env_date_utc": env.get("date_utc"),
                    "link_paging_gb_per_s": machine.get("link_paging_gb_per_s")},
        "git": {"commit": prov.get("git_commit"), "dirty": prov.get("git_dirty"), "env_git_oneline": env.get("git_oneline")},
        "model": model_facts(sources),
        "servers": servers,
        "h200": {
            "converter_command": ["python", SCRIPT, *argv], "inputs": inputs, "machine": machine, "env_txt": env_raw,
            # every run-level key the benchmarks wrote (keys added later included); cells are the records
            "decode": {k: v for k, v in decode.items() if k != "cells"},
            "llamacpp": {k: v for k, v in llama.items() if k != "cells"} if llama else None,
        },
    }


def derive_decode_bounds(data: dict[str, Any]) -> None:
    """Recomputes a decode file's derived fields (roofline, serial bound, HBM bound) from its measured
    ones with decode_h200's own function, so a file written before a derived field existed shows it
    (the file under inputs/ stays as measured)."""
    from decode_h200 import add_rooflines

    sizes = data.get("bytes") or {}
    if data.get("link") and "expert" in sizes and "dense_touched_per_step" in sizes:
        add_rooflines(data.get("cells") or [], data["link"], sizes["expert"], sizes["dense_touched_per_step"])


def build_run(args: argparse.Namespace, argv: list[str]) -> Path:
    """Write the results run; returns its directory."""
    serve_paths = sorted(args.serve_dir.glob("serve_*.json")) if args.serve_dir is not None else []
    roles = [("decode", args.decode), ("llamacpp", args.llamacpp), *(("serve", p) for p in serve_paths)]
    sources = [_read_source(role, path) for role, path in roles if path is not None]
    for source in sources:
        if source.role == "decode":
            derive_decode_bounds(source.data)
    env_raw = args.env.read_text() if args.env is not None else None
    env = parse_env(env_raw) if env_raw is not None else {}
    linkbw = json.loads(args.linkbw.read_text()) if args.linkbw is not None else None
    run_dir: Path = args.results
    run_id = args.run_id or run_dir.name
    converted = convert(sources, machine_of(env, sources, linkbw), run_id)
    if run_dir.exists() and any(run_dir.iterdir()):
        if not args.overwrite:
            raise SystemExit(f"{run_dir} is not empty; pass --overwrite to replace it (or another --results)")
        shutil.rmtree(run_dir)
    # manifest_for writes the untyped dict layout; the version-1 reader types it (h200 blocks under `extra`)
    manifest = manifest_from_v1(manifest_for(run_id, sources, env, env_raw, linkbw, converted.servers, argv))
    store = RunStore.open(run_dir, manifest)
    for cell in converted.cells:
        store.write_cell(cell, converted.requests[cell.cell_id])
    store.rebuild_tables()
    inputs = run_dir / "inputs"
    inputs.mkdir(exist_ok=True)
    for path in [*(p for _, p in roles), args.linkbw, args.env]:
        if path is not None:
            shutil.copyfile(path, inputs / path.name)
    return run_dir


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--decode", type=Path, required=True, help="decode_h200.json (benchmarks/decode_h200.py)")
    p.add_argument("--llamacpp", type=Path, default=None, help="llamacpp_h200.json")
    p.add_argument("--serve-dir", type=Path, default=None, help="directory holding serve_<config>.json (benchmarks/serve_decode.py)")
    p.add_argument("--linkbw", type=Path, default=None, help="linkbw.json (python -m benchsuite linkbw --json-out)")
    p.add_argument("--env", type=Path, default=None, help="env.txt written by benchmarks/h200_suite.sh")
    p.add_argument("--results", type=Path, required=True, help="results run directory to write")
    p.add_argument("--report", type=Path, required=True, help="report directory to write (index.html, tables.md, tables.csv)")
    p.add_argument("--run-id", default=None, help="default: the --results directory name")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --results directory")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    from benchsuite.report.h200_page import write_h200_report

    run_dir = build_run(args, argv)
    index = write_h200_report(run_dir, args.report)
    print(f"results: {run_dir}\nreport: {index}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
