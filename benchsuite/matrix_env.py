"""`${VAR}` and `${VAR:-default}` environment references in a matrix's string values.

Owns the expansion pass `load_matrix` runs on the parsed YAML before validation: every string value
(mapping keys are left as written) has its references replaced, so the validated matrix, the run id
hash and the manifest all hold the expanded values (different files are different runs). An unset
variable without a default is one problem naming its YAML path and what to set. `$${` writes a
literal `${`.
"""

from __future__ import annotations

import os
import re
from typing import Any

_REF = re.compile(r"\$\$\{|\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")
# What an unset variable should hold, by the key it fills (else the generic hint).
_HINTS = {
    "path": "set it to your ShareGPT JSON file",
    "model_path": "set it to the model checkpoint directory",
    "model": "set it to the model file or checkpoint directory",
}
_GENERIC_HINT = "export it before running, or give a default: ${{{name}:-value}}"

Loc = tuple[str | int, ...]


def expand_env_refs(raw: Any, environ: dict[str, str] | None = None) -> tuple[Any, list[tuple[Loc, str]]]:
    """(raw with every reference expanded, [(YAML location, problem), ...] for unset variables)."""
    env = os.environ if environ is None else environ
    problems: list[tuple[Loc, str]] = []
    return _walk(raw, (), env, problems), problems


def _walk(value: Any, loc: Loc, env: Any, problems: list[tuple[Loc, str]]) -> Any:
    if isinstance(value, dict):
        return {k: _walk(v, loc + (str(k),), env, problems) for k, v in value.items()}
    if isinstance(value, list):
        return [_walk(v, loc + (i,), env, problems) for i, v in enumerate(value)]
    if isinstance(value, str) and "${" in value:
        return _expand(value, loc, env, problems)
    return value


def _expand(text: str, loc: Loc, env: Any, problems: list[tuple[Loc, str]]) -> str:
    def sub(match: re.Match[str]) -> str:
        if match.group(0) == "$${":
            return "${"
        name, default = match.group(1), match.group(2)
        found = env.get(name)
        if found:
            return str(found)
        if default is not None:
            return default
        key = next((str(part) for part in reversed(loc) if isinstance(part, str)), "")
        hint = _HINTS.get(key) or _GENERIC_HINT.format(name=name)
        state = "is empty" if found == "" else "is not set"
        problems.append((loc, f"environment variable {name} {state} ({hint})"))
        return match.group(0)

    return _REF.sub(sub, text)
