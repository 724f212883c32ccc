"""The contract between the runner and one kind of engine (builtin, llamacpp, sglang).

An adapter is pure: it turns a resolved server spec into an exact command line, says how to
check readiness, what to add to each request, and how to read the engine's own counters and
log. Processes, sockets and files are the runner's business (benchsuite.process, loadgen).
Adapters live in a plain dict registry (benchsuite.engines.ADAPTERS), keyed by `kind`.

Optional members the runner reads with getattr (an adapter without one simply lacks the feature):
- `prepare(spec) -> None`: before a launch (never in a dry run), build what the command line
  names (llama.cpp: export the GGUF of an HF checkpoint);
- `flush_cache_path: str | None`: POSTed before each cell (prefix cache flush);
- `routing_label(spec) -> str`: the cells' routing label (`synthetic:<spec>` for synthetic routing);
- `tokenizer_dir(spec) -> Path`: the model's tokenizer, for exact-length prompts;
- `cell_flags(spec, log_text, cell) -> list[str]`: one-line engine warnings for a finished cell
  (stored in the cell's `extras["flags"]`, shown by the report);
- `owned_env: dict[str, str]`: environment variables that would set what the adapter owns (llama.cpp's
  `LLAMA_ARG_CTX_SIZE` ...) -> what sets it instead; the matrix loader refuses them in `env:`;
- `resolved_options(spec) -> dict`: the options in force with defaults resolved (recorded in the
  manifest's server entry beside the exact argv);
- `async startup_facts(session, base_url) -> dict`: the engine's own start-up breakdown, read once
  it is ready (merged into the manifest's server entry beside the runner's `startup_s`);
- `async after_cells(ctx, server, requests) -> dict`: on the live server after its cells, before it
  stops (`requests`: the distinct LoadRequests its cells sent); the dict is merged into the
  manifest's server entry (e.g. SGLang's routing capture: `routing_trace`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol


class EngineConfigError(ValueError):
    """A server spec the engine cannot run; the message is one line that names the cause."""


def extra_args_check(problems_of: Callable[[list[str]], list[str]]) -> Callable[[list[str]], list[str]]:
    """A pydantic validator for an adapter's `extra_args` that refuses, in one line, what
    `problems_of` names (flags the adapter owns), so the matrix load names them."""

    def check(value: list[str]) -> list[str]:
        problems = problems_of(value)
        if problems:
            raise ValueError("; ".join(problems))
        return value

    return check


@dataclass(frozen=True)
class ServerSpec:
    """One server configuration: a matrix engine entry with every sweep value resolved.

    `options` holds the engine entry's options after sweep expansion (scalars only).
    `fairness` holds the matrix's shared settings (kv_capacity_tokens, prefix_caching, ...).
    `max_concurrency` is the highest concurrency any cell run on this server uses.
    """

    name: str  # engine entry name in the matrix
    kind: str
    options: dict[str, Any]
    fairness: dict[str, Any]
    max_concurrency: int
    server_id: str  # stable hash of the above
    env: dict[str, str] = field(default_factory=dict)  # the matrix's `env:` for this engine (matrix, then engine level)


@dataclass
class LaunchPlan:
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)  # added to the runner's environment
    health_path: str = "/health"
    startup_timeout_s: float = 600.0


class EngineAdapter(Protocol):
    kind: str
    # pydantic model of this engine's `options:` block in matrix.yaml (one scalar per field after
    # sweep expansion); extra="forbid" so a typo names its YAML path.
    options_model: type[Any]

    def validate(self, spec: ServerSpec) -> None:
        """Raise EngineConfigError before any launch when the spec cannot work."""

    def launch_plan(self, spec: ServerSpec, port: int) -> LaunchPlan:
        """The exact command line (and env) that starts this server on 127.0.0.1:port."""

    def mode(self, spec: ServerSpec) -> str:
        """Short mode label for reports (e.g. paged, offload, n-cpu-moe)."""

    def request_extras(self, spec: ServerSpec) -> dict[str, Any]:
        """Fields added to every completion request (e.g. llama.cpp's cache_prompt: false)."""

    def version(self, spec: ServerSpec) -> dict[str, Any]:
        """Engine version and build facts for the manifest (without starting the server)."""

    async def scrape(self, session: Any, base_url: str) -> dict[str, float] | None:
        """Engine counters (Prometheus text parsed into name -> value), or None if it has none."""

    def parse_log(self, log_text: str) -> dict[str, Any]:
        """Facts from the server log the report needs (memory lines, captured batch sizes, ...)."""
