"""Which llama-server flag moves TTFT and decode at --n-cpu-moe N: one launch per flag set, by the server's timings.

For the lead's H200 call (<= 8 minutes): with an already-built CUDA llama-server and a GGUF, it starts
llama-server once per flag set below (each step changes one thing from the previous one), sends a
warm-up, `--short-repeats` short prompts and `--long-repeats` prompts of exactly `--long-tokens` tokens,
and takes TTFT (`timings.prompt_ms`) and decode tok/s (`timings.predicted_per_second`) from
llama-server's own `timings` (no client clock in the figures). Every wait is bounded; a flag set
that would not finish inside `--budget-s` is skipped and listed. Per flag set the server log and
its memory lines (CUDA0 model/KV/compute MiB, parsed by benchsuite.engines.llamacpp.logs; -lv 3
sets log none) are kept. First, where llama-fit-params sits beside the server, it prints llama.cpp's
projection for the old and the new flags (the compute buffer that -ub 2048 costs).

  python benchmarks/llamacpp_flags_h200.py --server ~/.cache/benchsuite/llama.cpp/<cuda-build>/bin/llama-server \\
      --model /path/qwen3-30b-a3b-shape-48l-q8_0.gguf --out /tmp/flags

Flag sets (the base: -m, --host, --port, -ngl 999, -c, --n-cpu-moe N, --no-cache-prompt --cache-ram 0):
  old        the adapter before tuning: -np 4 --kv-unified --metrics -fa off -lv 4 (mmap, -b 2048 -ub 512, default -t)
  lv3        old with -lv 3: the price of -lv 4
  fa         lv3 + -fa on
  ub2048     fa + -b 2048 -ub 2048
  nommap     ub2048 + --load-mode none (host experts pinned)
  threads    nommap + -t <physical cores this process may use>
  adapter    threads + -lv 4: the adapter's command line now
  np1        adapter without -np 4 --kv-unified --metrics (a bare llama-server's slots)
Writes <out>/flags.md (the table; with --rounds > 1 the median per set), flags.json, flags.csv (every
round) and <out>/<set>-r<round>.log. Exit 0 when every set ran. On a shared CPU (docs/llamacpp-tuning.md):
--rounds 3 --extra-args "-t 1" interleaves the sets and keeps the thread count fixed.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchsuite.engines.llamacpp.logs import parse_server_log  # noqa: E402
from benchsuite.engines.llamacpp.tuning import physical_cores  # noqa: E402

TEXT = (
    "Mixture of experts models route each token to a few of many feed-forward experts, so most of the "
    "weights sit idle for any one token. Serving them on a GPU that cannot hold every expert means "
    "keeping some experts in host memory and either computing them there or copying them over the link. "
)
SHORT_PROMPT = "Explain in one paragraph why the sky is blue."


def flag_sets(n_threads: int) -> dict[str, list[str]]:
    old = ["-np", "4", "--kv-unified", "--metrics", "-fa", "off", "-lv", "4"]
    lv3 = [*old[:-1], "3"]
    fa = [*lv3[:5], "on", *lv3[6:]]
    ub = [*fa, "-b", "2048", "-ub", "2048"]
    nommap = [*ub, "--load-mode", "none"]
    threads = [*nommap, "-t", str(n_threads)]
    adapter = [*threads[:7], "4", *threads[8:]]
    np1 = [a for a in adapter if a not in ("--kv-unified", "--metrics")]
    np1[np1.index("-np") + 1] = "1"
    return {
        "old": old,
        "lv3": lv3,
        "fa": fa,
        "ub2048": ub,
        "nommap": nommap,
        "threads": threads,
        "adapter": adapter,
        "np1": np1,
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        return json.loads(resp.read())


def wait_ready(proc: subprocess.Popen, base: str, timeout_s: float) -> float:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited with {proc.returncode} while loading")
        try:
            with urllib.request.urlopen(base + "/health", timeout=5) as resp:
                if resp.status == 200:
                    return time.perf_counter() - t0
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(1.0)
    raise TimeoutError(f"not ready after {timeout_s:.0f} s")


def stop(proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """SIGTERM (llama-server prints its memory breakdown on the way out), then SIGKILL the group."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process, all its threads (Linux /proc/<pid>/stat fields 14, 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def exact_prompt(base: str, n_tokens: int) -> list[int]:
    ids: list[int] = []
    text = TEXT
    while len(ids) < n_tokens:
        ids = post(base + "/tokenize", {"content": text}, 60)["tokens"]
        text += TEXT
    return ids[:n_tokens]


def completion(base: str, prompt: Any, n_predict: int, timeout_s: float) -> dict[str, float]:
    body = {
        "prompt": prompt, "n_predict": n_predict, "ignore_eos": True, "temperature": 0.0,
        "cache_prompt": False, "stream": False,
    }  # fmt: skip
    t0 = time.perf_counter()
    timings = post(base + "/completion", body, timeout_s)["timings"]
    return {
        "prompt_n": timings["prompt_n"],
        "ttft_s": timings["prompt_ms"] / 1e3,
        "predicted_n": timings["predicted_n"],
        "decode_tok_s": timings["predicted_per_second"],
        "wall_s": time.perf_counter() - t0,
    }


def run_set(name: str, argv: list[str], args: argparse.Namespace, out: Path, round_i: int) -> dict[str, Any]:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [
        str(args.server), "-m", str(args.model), "--host", "127.0.0.1", "--port", str(port), "-ngl", "999",
        "-c", str(args.ctx), "--n-cpu-moe", str(args.n_cpu_moe), "--no-cache-prompt", "--cache-ram", "0", *argv,
        *shlex.split(args.extra_args),
    ]  # fmt: skip
    log_path = out / f"{name}-r{round_i}.log"
    row: dict[str, Any] = {"set": name, "round": round_i, "flags": " ".join(argv)}
    print(f"[{name}] starting: {' '.join(cmd)}", flush=True)
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            row["load_s"] = round(wait_ready(proc, base, args.startup_timeout_s), 1)
            print(f"[{name}] ready in {row['load_s']} s", flush=True)
            long_prompt = exact_prompt(base, args.long_tokens)
            completion(base, SHORT_PROMPT, 8, args.request_timeout_s)  # warm-up: graphs, caches, first upload
            cpu_before_s = process_cpu_s(proc.pid)
            short = [
                completion(base, SHORT_PROMPT, args.output_tokens, args.request_timeout_s)
                for _ in range(args.short_repeats)
            ]
            # server CPU time over the short requests per generated token: steadier than wall time on a shared host
            row["short_cpu_ms_per_token"] = round(
                1e3 * (process_cpu_s(proc.pid) - cpu_before_s) / sum(r["predicted_n"] for r in short), 4
            )
            long = [
                completion(base, long_prompt, args.long_output_tokens, args.request_timeout_s)
                for _ in range(args.long_repeats)
            ]
            row |= summarize("short", short) | summarize("long", long)
            print(f"[{name}] {row}", flush=True)
        except (RuntimeError, TimeoutError, urllib.error.URLError, OSError, KeyError) as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"
            print(f"[{name}] FAILED: {row['error']}", flush=True)
        finally:
            stop(proc)
    memory = parse_server_log(log_path.read_text(errors="replace"))
    for kind, per_device in memory.get("buffers_mib", {}).items():
        for device, mib in per_device.items():
            if device.startswith("CUDA"):
                row[f"{device}_{kind}_mib"] = mib
    return row


def summarize(label: str, runs: list[dict[str, float]]) -> dict[str, Any]:
    return {
        f"{label}_prompt_n": runs[0]["prompt_n"],
        f"{label}_ttft_s": round(statistics.median(r["ttft_s"] for r in runs), 3),
        f"{label}_ttft_s_all": [round(r["ttft_s"], 3) for r in runs],
        f"{label}_decode_tok_s": round(statistics.median(r["decode_tok_s"] for r in runs), 2),
        f"{label}_decode_tok_s_all": [round(r["decode_tok_s"], 2) for r in runs],
    }


def fit_projections(args: argparse.Namespace, out: Path) -> list[dict[str, Any]]:
    """llama.cpp's own projection (MiB per device) for the old and the new flags at this N."""
    fit_bin = Path(args.server).parent / "llama-fit-params"
    if not fit_bin.is_file():
        print(f"no {fit_bin}: llama.cpp projections skipped", flush=True)
        return []
    rows = []
    for label, extra in [("old", ["-fa", "off"]), ("adapter", ["-fa", "on", "-b", "2048", "-ub", "2048"])]:
        cmd = [
            str(fit_bin), "-m", str(args.model), "-ngl", "999", "--n-cpu-moe", str(args.n_cpu_moe),
            "-c", str(args.ctx), "-np", "4", *extra, "--fit-print", "on",
        ]  # fmt: skip
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
            text = proc.stdout
        except subprocess.TimeoutExpired:
            text = "timed out after 120 s"
        (out / f"fit-{label}.txt").write_text(text)
        rows.append({"flags": label, "fit_print": [ln for ln in text.splitlines() if ln.strip()][-4:]})
        print(f"[fit {label}] {rows[-1]['fit_print']}", flush=True)
    return rows


COLUMNS = (
    "load_s",
    "short_ttft_s",
    "short_decode_tok_s",
    "short_cpu_ms_per_token",
    "long_prompt_n",
    "long_ttft_s",
    "long_decode_tok_s",
)
"""Each round's figures, in table order (a round's row and the rounds' medians alike)."""


def medians(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per set: the median over its rounds of each per-round median (sets in first-seen order)."""
    out = []
    for name in dict.fromkeys(r["set"] for r in rows):
        ok = [r for r in rows if r["set"] == name and "error" not in r]
        row: dict[str, Any] = {
            "set": name,
            "round": f"median of {len(ok)}",
            "flags": rows[[r["set"] for r in rows].index(name)]["flags"],
        }
        for key in COLUMNS:
            values = [r[key] for r in ok if key in r]
            if values:
                row[key] = round(statistics.median(values), 3)
        if not ok:
            row["error"] = "no round ran"
        out.append(row)
    return out


def write_table(rows: list[dict[str, Any]], out: Path) -> None:
    if any(r.get("round", 0) for r in rows):  # several rounds: the table is their medians, every round in the csv
        rows, all_rows = medians(rows), rows
    else:
        all_rows = rows
    cols = ["set", "round", *COLUMNS]
    cols += sorted({k for r in rows for k in r if k.startswith("CUDA")}) + ["error", "flags"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r.get(c, "")) for c in cols) + " |" for r in rows]
    (out / "flags.md").write_text("\n".join(lines) + "\n")
    with (out / "flags.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(all_rows)
    print("\n".join(lines), flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--server", type=Path, required=True, help="CUDA llama-server binary")
    p.add_argument("--model", type=Path, required=True, help="the GGUF (48-layer qwen3-30b-a3b shape, Q8_0)")
    p.add_argument("--out", type=Path, required=True, help="output directory")
    p.add_argument("--n-cpu-moe", type=int, default=30)
    p.add_argument("--ctx", type=int, default=8192, help="-c: KV cells (the headline's kv_capacity_tokens)")
    p.add_argument("--long-tokens", type=int, default=2048)
    p.add_argument("--output-tokens", type=int, default=96, help="tokens per short request (the decode figure)")
    p.add_argument("--long-output-tokens", type=int, default=32)
    p.add_argument("--short-repeats", type=int, default=3)
    p.add_argument("--long-repeats", type=int, default=2)
    p.add_argument("--only", default="", help="comma-separated flag sets (default: all, in order)")
    p.add_argument("--budget-s", type=float, default=440.0, help="start no flag set after this much time")
    p.add_argument("--startup-timeout-s", type=float, default=150.0)
    p.add_argument("--request-timeout-s", type=float, default=90.0)
    p.add_argument("--rounds", type=int, default=1, help="run the sets this many times, interleaved (noisy hosts)")
    p.add_argument("--extra-args", default="", help="appended to every set's flags, so they win (e.g. '-t 1')")
    args = p.parse_args(argv)
    for path in (args.server, args.model):
        if not path.is_file():
            print(f"error: {path} does not exist", file=sys.stderr)
            return 2
    args.out.mkdir(parents=True, exist_ok=True)
    sets = flag_sets(physical_cores())
    chosen = [s for s in args.only.split(",") if s] or list(sets)
    unknown = [s for s in chosen if s not in sets]
    if unknown:
        print(f"error: unknown flag sets {unknown}; known: {list(sets)}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    fits = fit_projections(args, args.out)
    rows: list[dict[str, Any]] = []
    longest = 0.0
    for round_i, name in [(r, n) for r in range(args.rounds) for n in chosen]:
        elapsed = time.perf_counter() - t0
        if elapsed + longest > args.budget_s:
            rows.append(
                {
                    "set": name,
                    "round": round_i,
                    "flags": " ".join(sets[name]),
                    "error": f"skipped: budget ({elapsed:.0f} s)",
                }
            )
            print(f"[{name}] skipped: {elapsed:.0f} s used, the longest set took {longest:.0f} s", flush=True)
            continue
        start = time.perf_counter()
        rows.append(run_set(name, sets[name], args, args.out, round_i))
        longest = max(longest, time.perf_counter() - start)
        write_table(rows, args.out)  # after every set: a killed call still leaves the sets it finished
    (args.out / "flags.json").write_text(
        json.dumps({"rows": rows, "fit_params": fits, "args": vars(args)}, default=str, indent=1)
    )
    write_table(rows, args.out)
    print(f"done in {time.perf_counter() - t0:.0f} s; table in {args.out / 'flags.md'}", flush=True)
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
