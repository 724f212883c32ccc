"""Engine adapters by kind: a plain dict registry (see base.EngineAdapter).

`ADAPTER_PATHS` names where each kind's adapter class lives. `ADAPTERS` is a read-only mapping
over it that imports an adapter module on first use, so a missing or broken adapter module (or
a heavy dependency of one engine) never breaks the other engines or `--help`.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping

from benchsuite.engines.base import EngineAdapter, EngineTraits
from benchsuite.errors import UserError

RUN_DIR_PLACEHOLDER = "{run_dir}"
"""Adapters may put this in argv or env values; the runner replaces it with the run directory."""

ADAPTER_PATHS: dict[str, tuple[str, str]] = {
    "builtin": ("benchsuite.engines.builtin.adapter", "BuiltinAdapter"),
    "llamacpp": ("benchsuite.engines.llamacpp.adapter", "LlamaCppAdapter"),
    "sglang": ("benchsuite.engines.sglang.adapter", "SGLangAdapter"),
}


class _LazyAdapters(Mapping[str, EngineAdapter]):
    """kind -> adapter instance, imported on first lookup and cached."""

    def __init__(self, paths: dict[str, tuple[str, str]]) -> None:
        self._paths = paths
        self._loaded: dict[str, EngineAdapter] = {}

    def __getitem__(self, kind: str) -> EngineAdapter:
        if kind in self._loaded:
            return self._loaded[kind]
        if kind not in self._paths:
            raise KeyError(kind)
        module_path, class_name = self._paths[kind]
        try:
            cls = getattr(importlib.import_module(module_path), class_name)
        except (ImportError, AttributeError) as exc:
            raise UserError(f"engine kind {kind!r} is not available here ({module_path}.{class_name}: {exc})") from exc
        adapter = cls()
        self._loaded[kind] = adapter
        return adapter

    def __iter__(self) -> Iterator[str]:
        return iter(self._paths)

    def __len__(self) -> int:
        return len(self._paths)


ADAPTERS: Mapping[str, EngineAdapter] = _LazyAdapters(ADAPTER_PATHS)


KINDS: tuple[str, ...] = tuple(ADAPTER_PATHS)  # every engine kind, in the report's order


def adapter_of(kind: str) -> EngineAdapter | None:
    """The adapter of a stored run's kind, or None where this install does not know it or cannot load
    it (a report reads runs made elsewhere)."""
    try:
        return ADAPTERS[kind]
    except (KeyError, UserError):
        return None


def traits_of(kind: str) -> EngineTraits:
    """What the report knows of a kind (base.EngineTraits); an unknown kind has the defaults."""
    adapter = adapter_of(kind)
    return adapter.traits if adapter is not None else EngineTraits()
