"""The module import graph of both packages is acyclic, hidden imports included.

Every `import` statement counts wherever it sits: at the top, inside a function (a lazy import is
still a dependency), under `if TYPE_CHECKING:` (a type-only loop is still a loop a reader has to
untangle). `from a.b import c` is an edge to `a.b.c` when that is a module, else to `a.b`.
`importlib.import_module(...)` with a computed name (the engine registry) is not an edge.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("benchsuite", "paged_experts")
# Loops known and being untangled; an entry must go when its loop is gone (the test says so).
KNOWN_CYCLES: set[frozenset[str]] = set()


def module_files() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _resolve(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(module: str, path: Path, known: set[str]) -> Iterator[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield from _known_prefix(alias.name, known)
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(node, module, path.name == "__init__.py")
            for alias in node.names:
                if f"{target}.{alias.name}" in known:
                    yield f"{target}.{alias.name}"
                else:
                    yield from _known_prefix(target, known)


def _known_prefix(name: str, known: set[str]) -> Iterator[str]:
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in known:
            yield candidate
            return


def import_graph() -> dict[str, set[str]]:
    files = module_files()
    known = set(files)
    return {m: {t for t in imports_of(m, p, known) if t != m} for m, p in files.items()}


def cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(frozenset(component))
    return found


def test_the_cycle_finder_finds_a_hidden_loop(tmp_path: Path) -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [frozenset({"a", "b", "c"})]
    hidden = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import x.y\ndef f():\n    from x import z\n"
    (tmp_path / "m.py").write_text(hidden)
    assert set(imports_of("m", tmp_path / "m.py", {"x.y", "x.z", "x"})) == {"x.y", "x.z"}


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycles(package: str) -> None:
    found = {c for c in cycles(import_graph()) if any(m.split(".")[0] == package for m in c)}
    new = found - KNOWN_CYCLES
    assert not new, "import cycles (every import counts, lazy and TYPE_CHECKING ones too):\n" + "\n".join(
        " <-> ".join(sorted(c)) for c in new
    )
    gone = {c for c in KNOWN_CYCLES if any(m.split(".")[0] == package for m in c)} - found
    assert not gone, f"these cycles are gone; remove them from KNOWN_CYCLES: {gone}"


def test_the_pipeline_knows_engines_only_through_their_contract() -> None:
    """Outside the engine wings (and the CLI's engine-specific commands: install, gguf), benchsuite
    imports engines only through benchsuite.engines (the registry), benchsuite.engines.base (the
    contract) and benchsuite.engines.search_settings (what a search of an engine option may ask)."""
    allowed = {"benchsuite.engines", "benchsuite.engines.base", "benchsuite.engines.search_settings"}
    graph = import_graph()
    reaching = {
        (module, target)
        for module, targets in graph.items()
        if module.startswith("benchsuite.") and not module.startswith(("benchsuite.engines", "benchsuite.commands"))
        for target in targets
        if target.startswith("benchsuite.engines") and target not in allowed
    }
    assert not reaching, f"modules that reach into an engine's wing: {sorted(reaching)}"


@dataclass(frozen=True)
class Layers:
    """A package's layers, bottom to top: a module imports only from its own layer or one below it.
    A module's layer is its folder, or `root`'s entry for a module at the package's root."""

    package: str
    order: tuple[str, ...]
    root: dict[str, str]

    def of(self, module: str) -> str:
        if module in self.root:
            return self.root[module]
        folder = module.split(".")[1]
        assert folder in self.order, f"{module}: not in a layer of {self.package} (tests/test_import_graph.py)"
        return folder

    def upward(self, graph: dict[str, set[str]]) -> list[str]:
        """Every import that runs up the layers, one line each."""
        rank = {layer: i for i, layer in enumerate(self.order)}
        return sorted(
            f"{module} ({self.of(module)}) imports {target} ({self.of(target)})"
            for module, targets in graph.items()
            if module.split(".")[0] == self.package
            for target in targets
            if target.split(".")[0] == self.package and rank[self.of(target)] > rank[self.of(module)]
        )


# benchsuite's stages: the root's vocabulary (errors, records) under everything, the command line
# over everything.
BENCHSUITE = Layers(
    "benchsuite",
    ("vocabulary", "tools", "engines", "config", "load", "measure", "results", "checks", "run", "report", "commands",
     "cli"),
    {"benchsuite": "vocabulary", "benchsuite.errors": "vocabulary", "benchsuite.interrupt": "vocabulary",
     "benchsuite.records": "vocabulary", "benchsuite.cli": "cli", "benchsuite.__main__": "cli"},
)  # fmt: skip
# paged_experts' layers: the leaves every layer shares (shape, fp8, kv, step, thread_clock, upload), which experts sit
# where, the runtime's configuration, the kernels (with the reference expert compute, attention and
# the projection over dense or block-FP8 weights, which calls kernels/linear_fp8),
# routing, the MoE block, weights (the loader builds MoE blocks), the graphed decode, the model, the
# server.
PAGED_EXPERTS = Layers(
    "paged_experts",
    ("leaves", "residency", "config", "kernels", "runtime", "routing", "moe", "weights", "decode", "model", "server"),
    {"paged_experts": "leaves", "paged_experts.shape": "leaves", "paged_experts.fp8": "leaves",
     "paged_experts.kv": "leaves", "paged_experts.attention": "kernels", "paged_experts.step": "leaves",
     "paged_experts.thread_clock": "leaves", "paged_experts.upload": "leaves", "paged_experts.experts": "kernels",
     "paged_experts.projection": "kernels", "paged_experts.config": "config", "paged_experts.runtime": "runtime",
     "paged_experts.model": "model"},
)  # fmt: skip


@pytest.mark.parametrize("layers", [BENCHSUITE, PAGED_EXPERTS], ids=lambda layers: layers.package)
def test_imports_follow_the_layers(layers: Layers) -> None:
    upward = layers.upward(import_graph())
    assert not upward, f"imports that run up {layers.package}'s layers:\n" + "\n".join(upward)


def test_the_layer_check_finds_an_upward_import() -> None:
    graph = {"benchsuite.load.loadgen": {"benchsuite.run.runner", "benchsuite.records"}}
    assert BENCHSUITE.upward(graph) == ["benchsuite.load.loadgen (load) imports benchsuite.run.runner (run)"]
    with pytest.raises(AssertionError, match="not in a layer of benchsuite"):
        BENCHSUITE.of("benchsuite.flat_module")
