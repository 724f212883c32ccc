"""`ServeOptions`: the one declaration of the built-in server's options (`python -m paged_experts.server`).

Each option is a field with its type, default, flag name and help text; the server's argparse parser
is generated from the fields in declaration order (the `--help` order), the benchsuite adapter writes
its command line through `ServeOptions.argv` (a flag the server does not know cannot be written), and
every rule that relates options lives in `problems` once, worded through a `Namer` so the server
speaks in flags and the matrix in its option names. No torch import: the adapter loads this module.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from paged_experts.residency.page_in import EXPERT_ROWS, PAGE_IN_CHOICES
from paged_experts.residency.planner import DEFAULT_PREFILL_KEEP, MAX_STAGING_ROWS, PREFILL_KEEP
from paged_experts.residency.policies import (
    DEFAULT_AGING_PERIOD_STEPS,
    DEFAULT_DUEL_WINDOW_STEPS,
    DEFAULT_EVICTION_POLICY,
    DEVICE_POLICIES,
    EVICTION_POLICIES,
    eviction_policy_error,
    policy_base,
)
from paged_experts.server.connections import BODY_TIMEOUT_S, HEADER_TIMEOUT_S

MODES: tuple[str, ...] = ("resident", "paged", "offload", "cpu-experts")
DEVICES: tuple[str, ...] = ("cpu", "cuda")
GRAPHABLE_MODES = ("resident", "paged")  # modes whose decode step the server can capture as a CUDA graph
KERNEL_BACKENDS: tuple[str, ...] = ("grouped", "triton")  # kernels.fused: grouped GEMM, or Triton decode kernels
MODE_OPTION = {"paged": "resident_experts", "offload": "offload_layers", "cpu-experts": "n_cpu_moe"}


@dataclass(frozen=True)
class Flag:
    """How one option is spelled on the command line. A boolean has an `on` flag and, where the
    server accepts it, an `off` flag (benchsuite writes one of them so the command names what is in
    force); `off_first` keeps the `--help` order where the off flag is the one users reach for."""

    name: str
    help: str | None = None
    aliases: tuple[str, ...] = ()
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    off: str | None = None
    off_help: str | None = None
    off_first: bool = False


def _opt(default: Any, flag: str, help: str | None = None, **spelling: Any) -> Any:  # noqa: A002 (argparse's word)
    return field(default=default, metadata={"flag": Flag(flag, help, **spelling)})


@dataclass(frozen=True)
class ServeOptions:
    """The server's options, in `--help` order; `problems` holds the rules between them."""

    model_path: str = field(metadata={"flag": Flag("--model-path", "HF checkpoint directory", aliases=("--model",))})
    host: str = _opt("127.0.0.1", "--host")
    port: int = _opt(30000, "--port")
    mode: str = _opt("resident", "--mode", "default: implied by the K / layer flag given, else resident", choices=MODES)
    resident_experts: int | None = _opt(
        None, "--paged-experts-num-resident", "K expert slots per layer (mode paged)", aliases=("--resident-experts",)
    )
    offload_layers: int | None = _opt(  # None: every MoE layer
        None, "--offload-layers", "offloaded MoE layers, counted from the first (mode offload; default all)"
    )
    n_cpu_moe: int | None = _opt(
        None, "--n-cpu-moe", "MoE layers whose experts run on the CPU, the first N (mode cpu-experts)"
    )
    device: str = _opt("cpu", "--device", choices=DEVICES)
    dtype: str | None = _opt(  # None: float32 on CPU, the checkpoint's dtype on CUDA
        None,
        "--dtype",
        "default: float32 on CPU, checkpoint dtype on CUDA",
        choices=("float32", "bfloat16", "float16"),
    )
    dequantize_attention: bool = _opt(
        False,
        "--dequantize-attention",
        "block-FP8 checkpoints: dequantize the attention projections to --dtype at load (default: kept FP8 "
        "on the device with their block scales, as SGLang keeps them: half the bytes)",
    )
    max_running_requests: int = _opt(16, "--max-running-requests")
    max_total_tokens: int = _opt(16384, "--max-total-tokens", "KV capacity in tokens")
    chunked_prefill_size: int = _opt(2048, "--chunked-prefill-size", "prompt tokens per engine step")
    served_model_name: str | None = _opt(None, "--served-model-name")
    routing_source: str | None = _opt(
        None, "--routing-source", "replace the router with a synthetic routing source (labelled synthetic)"
    )
    routing_seed: int = _opt(0, "--routing-seed")
    record_routing: str | None = _opt(None, "--record-routing", "write a routing trace to PATH", metavar="PATH")
    cuda_graph_max_bs: int = _opt(
        0,
        "--cuda-graph-max-bs",
        "capture decode steps of batch 1..N as CUDA graphs (CUDA; resident, or paged for N x top_k <= K; 0 = off)",
    )
    enable_torch_compile: bool = _opt(
        False,
        "--enable-torch-compile",
        "torch.compile the per-layer blocks of the captured decode step (needs --cuda-graph-max-bs)",
        off="--disable-torch-compile",
        off_help="the default: no torch.compile (written out by benchsuite so the command names what is in force)",
    )
    kernel_backend: str = _opt(  # handed to the runtime (RuntimeConfig.kernel_backend), which picks the kernels
        "grouped",
        "--kernel-backend",
        "grouped: torch's grouped GEMM for the fused expert pass; triton: routing, the expert pass "
        "and (in captured steps) attention of decode steps as Triton kernels (CUDA; steps of up to "
        "32 routed pairs, larger ones keep grouped)",
        choices=KERNEL_BACKENDS,
    )
    prefetch_next_layer: bool = _opt(
        False,
        "--prefetch-next-layer",
        "in captured paged decode steps, apply each layer's router to the previous layer's residual "
        "stream and page the predicted experts in on a second stream while that layer computes "
        "(mode paged, --device cuda, needs --cuda-graph-max-bs; refused with --routing-source, whose draws do "
        "not depend on that stream; counted as experts_prefetched_total)",
    )
    overlap_page_in: bool = _opt(
        False,
        "--overlap-page-in",
        "paged decode steps planned on the GPU: compute the hit experts while the misses copy on a second "
        "stream, then each group of misses as soon as its copy landed (mode paged, --device cuda; not with "
        "--prefetch-next-layer; see --overlap-groups)",
    )
    overlap_groups: int = _opt(
        1,
        "--overlap-groups",
        "with --overlap-page-in: the groups a step's misses are dealt into (miss i in group i mod N), each "
        "copied, then computed, on its own (1..64; 1: the hits, then all the misses)",
    )
    overlap_copies: str = _opt(
        "kernel",
        "--overlap-copies",
        "with --overlap-page-in: what copies the misses; kernel: the Triton copy kernel on a second stream; dma: "
        "the copy engine, issued by a host thread the captured step rings (needs a C compiler once; "
        "paged_experts/residency/dma_proxy.py); switch: the copy engines, started inside the captured step by "
        "SWITCH conditional nodes (CUDA 12.8 driver; eager steps copy by the kernel; "
        "paged_experts/residency/switch_lanes.py)",
        choices=("kernel", "dma", "switch"),
    )
    copy_programs: int | None = _opt(  # None: the copy kernel's full grid
        None,
        "--copy-programs",
        "paged decode steps planned on the GPU: run each page-in copy kernel on at most N programs that loop "
        "over its 16 KiB chunks, leaving the other SMs to the kernels beside it (mode paged, --device cuda; "
        "unset: one program per chunk)",
    )
    fused_page_in: bool = _opt(
        False,
        "--fused-page-in",
        "paged decode steps of one token planned on the GPU: the expert kernels read the misses' rows from "
        "pinned host memory and write them through to their slots while the hits compute, with no copy "
        "kernel before the compute (mode paged, --device cuda, --kernel-backend triton; not with "
        "--overlap-page-in)",
    )
    page_in: str = _opt(
        "auto",
        "--page-in",
        "how host-planned page-ins (prefill waves, steps above K experts, offloaded layers) copy expert rows "
        "to the GPU: direct = a DMA per tensor and run of rows; kernel = one Triton copy launch per group of "
        "rows (one host launch where direct issues dozens: for the host-bound paged prefill); batch = every "
        "tensor's runs of rows in one cuMemcpyBatchAsync driver call (CUDA driver 12.8+; memmoves on the CPU); "
        "staged = "
        "through a pinned staging buffer; auto = direct on CUDA, an index copy on the CPU "
        "(kernel and staged: --device cuda)",
        choices=PAGE_IN_CHOICES,
    )
    expert_rows: str = _opt(
        "auto",
        "--expert-rows",
        "modes paged and offload: how the host store and the device rows lay an expert out; split = a tensor "
        "each (an FP8 expert's page-in is three weight copies and its scale rows); packed = one byte row an "
        "expert, so a run of experts pages in as one DMA with --page-in direct or batch (the same bits; resident "
        "layers' device rows stay split); auto = packed for mode paged on CUDA, split elsewhere",
        choices=EXPERT_ROWS,
    )
    prefill_staging_rows: int = _opt(
        0,
        "--prefill-staging-rows",
        "mode paged: N device rows, shared by all layers, that take a prefill chunk's first page-ins of a "
        "layer while the layer before it computes (the link idles there otherwise: every slot holds an "
        "expert the chunk routes); costs N experts' bytes of device memory (0: none)",
    )
    prefill_residency: str | None = _opt(  # None: the residency default
        None,
        "--prefill-residency",
        f"mode paged: what a prefill chunk (a step routing to more than K experts) leaves in the "
        f"slots: recent = the experts of the chunk's last tokens, frequent = its most-routed ones, "
        f"lru = the last waves' misses (default {DEFAULT_PREFILL_KEEP}; see docs/prefill.md)",
        choices=PREFILL_KEEP,
    )
    eviction_policy: str | None = _opt(  # None: the residency default, LRU
        None,
        "--eviction-policy",
        f"mode paged: which resident expert a miss evicts: lru = the least recently used, lfu-aging = the "
        f"least used, ties to the least recent, with counts halving every {DEFAULT_AGING_PERIOD_STEPS} steps "
        f"(host and device planner), lfu-decay = the least used with counts decaying by half every 2 steps "
        f"(host planner only: refused with --device cuda; default {DEFAULT_EVICTION_POLICY}; see "
        f"docs/eviction-policy.md); lfu-aging:<P> halves them every P steps, lfu-aging:<P>:<W> also evicts the "
        f"experts used in the last W steps last; duel = lru or lfu-aging:{DEFAULT_AGING_PERIOD_STEPS}:"
        f"{DEFAULT_DUEL_WINDOW_STEPS} per layer, whichever misses less on a shadow cache of its own "
        f"(host and device planner; duel:<P>[:<W>] duels lfu-aging:<P>[:<W>])",
        metavar="{" + ",".join(EVICTION_POLICIES) + ",lfu-aging:<P>[:<W>],duel:<P>[:<W>]}",
    )
    expert_kernel: str = _opt(
        "fused",
        "--expert-kernel",
        "grouped matmuls over the slot table (fused) or the per-expert reference loop",
        choices=("fused", "loop"),
    )
    overlap_schedule: bool = _opt(
        True,
        "--enable-overlap-schedule",
        "the default (written out by benchsuite so the command names what is in force)",
        off="--disable-overlap-schedule",
        off_help="read every step's tokens before launching the next (default: a greedy decode step of a "
        "captured batch is launched first, its input tokens taken from the device; SGLang's flag)",
        off_first=True,
    )
    gc_freeze: bool = _opt(
        True,
        "--enable-gc-freeze",
        "the default (written out by benchsuite so the command names what is in force)",
        off="--disable-gc-freeze",
        off_help="leave the loaded server's objects to the garbage collector (default: once loaded and warmed, "
        "before it answers ready, they are frozen, gc.freeze, so a full collection walks only what requests "
        "allocated since; /metrics gc_frozen_objects)",
        off_first=True,
    )
    cpu_threads: int | None = _opt(  # None: threads.default_cpu_threads()
        None,
        "--cpu-threads",
        "torch's intra-op threads for CPU work (the CPU device, cpu-experts layers); default: the "
        "cores minus one, which the event loop and the engine thread need",
    )
    max_connections: int | None = _opt(  # None: connections.default_max_connections
        None,
        "--max-connections",
        "open connections at most; at the cap a new one replaces the oldest that holds no request "
        "(default: the open-file limit minus 512 descriptors the process and accept bursts need)",
    )
    header_timeout: float = _opt(
        HEADER_TIMEOUT_S,
        "--header-timeout",
        f"seconds from connect (or a request's first byte) to the end of its header (default {HEADER_TIMEOUT_S:g})",
    )
    body_timeout: float = _opt(
        BODY_TIMEOUT_S,
        "--body-timeout",
        f"seconds from the end of a header to the end of its body (default {BODY_TIMEOUT_S:g})",
    )
    log_level: str = _opt("info", "--log-level", choices=("debug", "info", "warning", "error"))

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model_path).name

    @property
    def routing_label(self) -> str:
        return "model" if self.routing_source is None else f"synthetic:{self.routing_source}"

    def argv(self, names: Sequence[str]) -> list[str]:
        """The flags of the options `names`, in that order; an unset (None) option writes nothing, a
        boolean its on or off flag (nothing where it has no off flag and is off)."""
        specs = _flags()
        out: list[str] = []
        for name in names:
            spec, value = specs[name], getattr(self, name)  # KeyError: not a server option
            if isinstance(value, bool):
                chosen = spec.name if value else spec.off
                out += [chosen] if chosen else []
            elif value is not None:
                out += [spec.name, str(value)]
        return out


def _flags() -> dict[str, Flag]:
    return {f.name: f.metadata["flag"] for f in fields(ServeOptions)}


def flag_of(name: str) -> str:
    """The command-line flag of option `name`."""
    return _flags()[name].name


# ---- the rules between options (and the bounds of single ones), worded by a Namer ----


@dataclass(frozen=True)
class Namer:
    """How a rule names an option (`--device` or `device`), a setting of one (`--device cuda` or
    `device: cuda`) and a value (`--enable-torch-compile`, or the matrix's `true`)."""

    option: Callable[[str], str]
    setting: Callable[[str, str], str]
    value: Callable[[str, Any], str]


def _flag_value(name: str, value: Any) -> str:
    spec = _flags()[name]
    if isinstance(value, bool):
        return str(spec.name if value else spec.off)
    return f"{spec.name} {value!r}" if isinstance(value, str) else f"{spec.name} {value}"


FLAGS = Namer(option=flag_of, setting=lambda name, v: f"{flag_of(name)} {v}", value=_flag_value)


@dataclass(frozen=True)
class Problem:
    option: str  # the option the rule blames: the one to change
    message: str


def problems(values: Mapping[str, Any], say: Namer = FLAGS) -> Iterator[Problem]:
    """Every broken rule among `values` (ServeOptions field names; a missing or None value is the
    server's default, never a problem). The matrix hands in the options it knows so far."""

    def get(name: str) -> Any:
        return values.get(name)

    for name in ("max_running_requests", "max_total_tokens", "chunked_prefill_size", "cpu_threads", "max_connections"):
        if get(name) is not None and get(name) < 1:
            yield Problem(name, f"{say.option(name)} must be >= 1")
    for name in ("header_timeout", "body_timeout"):
        if get(name) is not None and not 0 < get(name) < math.inf:
            yield Problem(name, f"{say.option(name)} must be a positive number of seconds")
    if get("cuda_graph_max_bs") is not None and get("cuda_graph_max_bs") < 0:
        yield Problem("cuda_graph_max_bs", f"{say.option('cuda_graph_max_bs')} must be >= 0")
    if get("port") is not None and not 0 <= get("port") < 65536:
        yield Problem("port", f"{say.option('port')} must be in [0, 65535]")
    device, mode = get("device") or "cpu", get("mode") or "resident"
    # CUDA-only performance options (their defaults, 0 / off / grouped, run anywhere)
    for name in ("cuda_graph_max_bs", "enable_torch_compile", "kernel_backend"):
        value = get(name)
        if value in (None, 0, False, "grouped"):
            continue
        if device != "cuda":
            yield Problem(name, f"{say.value(name, value)} needs {say.setting('device', 'cuda')} (got {device})")
        elif name != "kernel_backend" and mode not in GRAPHABLE_MODES:
            yield Problem(
                name,
                f"{say.value(name, value)} needs mode resident or paged (mode {mode} runs its decode steps eagerly)",
            )
        elif name == "enable_torch_compile" and get("cuda_graph_max_bs") == 0:
            yield Problem(
                name,
                f"{say.value(name, value)} compiles the captured decode step: it needs CUDA graphs "
                f"({say.option('cuda_graph_max_bs')} > 0)",
            )
    if get("prefetch_next_layer"):
        value = say.value("prefetch_next_layer", True)
        if mode != "paged" or device != "cuda":
            yield Problem(
                "prefetch_next_layer",
                f"{value} needs mode paged and device cuda (it runs inside the captured decode step)",
            )
        elif get("cuda_graph_max_bs") == 0:
            yield Problem(
                "prefetch_next_layer",
                f"{value} runs inside the captured decode step: it needs {say.option('cuda_graph_max_bs')} > 0",
            )
        elif policy_base(str(get("eviction_policy") or "lru")) != "lru":
            yield Problem(
                "prefetch_next_layer",
                f"{value} plans each prediction as a step of its own, which "
                f"{say.value('eviction_policy', get('eviction_policy'))} would count as uses: use lru with it",
            )
        elif get("routing_source") not in (None, "model"):  # a matrix names the model's own router "model"
            # the prediction applies the next layer's router to the hidden state; a synthetic source's draws do
            # not depend on it: 0.0-0.1 of the prefetched experts used (benchmarks/results/cpu/prefetch_routing_8l.json)
            yield Problem(
                "prefetch_next_layer",
                f"{value} predicts the next layer's experts with the model's own router, which "
                f"{say.option('routing_source')} replaces with draws that do not depend on the hidden state: the "
                "predictions would only load the link",
            )
    if get("overlap_page_in"):
        value = say.value("overlap_page_in", True)
        if mode != "paged" or device != "cuda":
            yield Problem("overlap_page_in", f"{value} needs mode paged and device cuda (steps planned on the GPU)")
        elif get("prefetch_next_layer"):
            yield Problem(
                "overlap_page_in",
                f"{value} and {say.option('prefetch_next_layer')} both use the page-in stream: choose one",
            )
    groups = get("overlap_groups")
    if groups is not None and not 1 <= groups <= 64:
        yield Problem("overlap_groups", f"{say.option('overlap_groups')} must be in [1, 64]")
    elif groups not in (None, 1) and not get("overlap_page_in"):
        yield Problem(
            "overlap_groups",
            f"{say.value('overlap_groups', groups)} applies with {say.option('overlap_page_in')} only",
        )
    copies = get("overlap_copies")
    if copies in ("dma", "switch") and not get("overlap_page_in"):
        yield Problem(
            "overlap_copies",
            f"{say.value('overlap_copies', copies)} applies with {say.option('overlap_page_in')} only",
        )
    elif copies == "dma" and get("copy_programs") is not None:
        yield Problem(
            "overlap_copies",
            f"{say.value('overlap_copies', copies)} runs no copy kernel for {say.option('copy_programs')} to cap",
        )
    if get("fused_page_in"):
        value = say.value("fused_page_in", True)
        if mode != "paged" or device != "cuda":
            yield Problem("fused_page_in", f"{value} needs mode paged and device cuda (steps planned on the GPU)")
        # unset (None) passes: a matrix leaves kernel_backend to the adapter, which resolves it to triton on
        # CUDA; the server always has a value (its default, grouped, is refused here)
        elif get("kernel_backend") not in (None, "triton"):
            yield Problem(
                "fused_page_in", f"{value} needs {say.option('kernel_backend')} triton (its kernels read the host rows)"
            )
        elif get("overlap_page_in"):
            yield Problem(
                "fused_page_in",
                f"{value} and {say.option('overlap_page_in')} are two ways to page the misses in: choose one",
            )
    staging = get("prefill_staging_rows")
    if staging is not None and not 0 <= staging <= MAX_STAGING_ROWS:
        yield Problem(
            "prefill_staging_rows", f"{say.option('prefill_staging_rows')} must be in [0, {MAX_STAGING_ROWS}]"
        )
    elif staging and mode != "paged":
        value = say.value("prefill_staging_rows", staging)
        yield Problem("prefill_staging_rows", f"{value} applies to mode paged, not {mode}")
    rows = get("expert_rows")
    if rows == "packed" and mode not in ("paged", "offload"):
        value = say.value("expert_rows", rows)
        yield Problem("expert_rows", f"{value} applies to modes paged and offload (host rows copied), not {mode}")
    page_in = get("page_in")
    if page_in in ("kernel", "staged") and device != "cuda":
        value = say.value("page_in", page_in)
        yield Problem(
            "page_in", f"{value} needs {say.setting('device', 'cuda')}: it copies through the GPU (got {device})"
        )
    programs = get("copy_programs")
    if programs is not None and not 1 <= programs <= 65535:
        yield Problem("copy_programs", f"{say.option('copy_programs')} must be in [1, 65535]")
    elif programs is not None and (mode != "paged" or device != "cuda"):
        value = say.value("copy_programs", programs)
        yield Problem("copy_programs", f"{value} needs mode paged and device cuda (steps planned on the GPU)")
    for name, accepted in (("prefill_residency", PREFILL_KEEP), ("eviction_policy", EVICTION_POLICIES)):
        value = get(name)
        if value is None:
            continue
        if name == "eviction_policy":
            problem = eviction_policy_error(value) if isinstance(value, str) else f"is not one of {', '.join(accepted)}"
        else:
            problem = None if value in accepted else f"is not one of {', '.join(accepted)}"
        if problem is not None:
            yield Problem(name, f"{say.value(name, value)} {problem}")
        elif mode != "paged":
            yield Problem(name, f"{say.value(name, value)} applies to mode paged, not {mode}")
        elif name == "eviction_policy" and policy_base(value) not in DEVICE_POLICIES and device == "cuda":
            yield Problem(
                name,
                f"{say.value(name, value)} runs on the host planner only; "
                f"device cuda plans paged steps on the GPU with {' or '.join(DEVICE_POLICIES)}",
            )


def mode_problems(
    values: Mapping[str, Any], say: Namer = FLAGS, needs_option: Sequence[str] = ("paged", "cpu-experts")
) -> Iterator[Problem]:
    """The mode's own option (K, offloaded or CPU layers): the one it needs, and no other mode's.
    The server offloads every layer when offload_layers is unset; a matrix names the count."""
    mode = values.get("mode") or "resident"
    needed = MODE_OPTION.get(mode)
    if needed is not None and mode in needs_option and values.get(needed) is None:
        yield Problem("mode", f"mode {mode} needs {say.option(needed)}")
    for other_mode, option in MODE_OPTION.items():
        if other_mode != mode and values.get(option) is not None:
            yield Problem(option, f"{say.option(option)} applies only to mode {other_mode}, not {mode}")
    for option in ("resident_experts", "offload_layers", "n_cpu_moe"):
        value = values.get(option)
        least = 1 if option == "resident_experts" else 0
        if value is not None and not isinstance(value, bool) and isinstance(value, int) and value < least:
            yield Problem(option, f"{say.option(option)} must be >= {least} (got {value})")


# ---- the server's parser, generated from the fields ----


def build_parser(description: str | None = None) -> argparse.ArgumentParser:
    """The server's argparse parser: one argument per option, in declaration order. Defaults stay
    out of the namespace (argparse.SUPPRESS) so the dataclass's defaults are the only ones."""
    p = argparse.ArgumentParser(prog="python -m paged_experts.server", description=description)
    types = {"int": int, "int | None": int, "float": float}
    for f in fields(ServeOptions):
        spec: Flag = f.metadata["flag"]
        if f.type == "bool":
            on: dict[str, Any] = {"dest": f.name, "action": "store_true", "help": spec.help}
            off: dict[str, Any] = {"dest": f.name, "action": "store_false", "help": spec.off_help}
            pairs = [(spec.off, off), (spec.name, on)] if spec.off_first else [(spec.name, on), (spec.off, off)]
            for flag, flag_kwargs in pairs:
                if flag is not None:
                    p.add_argument(flag, default=argparse.SUPPRESS, **flag_kwargs)
            continue
        kwargs: dict[str, Any] = {"dest": f.name, "help": spec.help, "choices": spec.choices, "metavar": spec.metavar}
        kwargs["type"] = types.get(str(f.type), str)
        if f.name == "model_path":
            kwargs["required"] = True
        p.add_argument(spec.name, *spec.aliases, default=argparse.SUPPRESS, **kwargs)
    return p


def parse_args(argv: Sequence[str], description: str | None = None) -> ServeOptions:
    """Parses and checks the server's command line; a broken rule exits 2 naming the flag."""
    parser = build_parser(description)
    given = vars(parser.parse_args(list(argv)))
    if "mode" not in given:  # implied by the one K / layer flag given, else resident
        implied = [mode for mode, option in MODE_OPTION.items() if given.get(option) is not None]
        given["mode"] = implied[0] if len(implied) == 1 else "resident"
    options = ServeOptions(**given)
    for problem in [*problems(vars_of(options)), *mode_problems(vars_of(options))]:
        parser.error(problem.message)
    if options.routing_source is not None:
        from paged_experts.routing.specs import parse_spec

        try:
            parse_spec(options.routing_source)
        except ValueError as exc:
            parser.error(f"--routing-source: {exc}")
    return options


def vars_of(options: ServeOptions) -> dict[str, Any]:
    return {f.name: getattr(options, f.name) for f in fields(options)}
