"""`${VAR}` and `${VAR:-default}` environment references in a matrix's string values.

Owns the expansion pass `load_matrix` runs on the parsed YAML before validation: every string value
has its references replaced, so the validated matrix, the run id hash and the manifest all hold the
expanded values (different files are different runs). The grammar, all of it:
- `${NAME}`: the variable's value; unset or empty is a problem naming the YAML path and what to set;
- `${NAME:-default}`: the default when the variable is unset or empty; the default may itself hold
  references (`${A:-${B:-x}}`), expanded only when it is used, nested at most MAX_NESTING deep;
- `$${` writes a literal `${`; a `$` not followed by `{` is itself.
Every other `${...}` (`${}`, `${1BAD}`, `${A:?x}`, `${A-x}`, an unclosed `${A`) is a problem naming
its place, so no literal `${` ever reaches the plan as a model path. A mapping key holding `${` is a
problem too (keys are names, never expanded).

Why our own parser instead of a library (issue 21 asked): PyPI's `expandvars` 1.1.2, the best kept
candidate, implements the bash grammar rather than ours, and measured on our forms it differs
where it matters: `$${X}` (our documented escape) is an error or `$$` = its process id, a bare `$`
(`cost $5`, `$HOME`) is expanded or an error, and forms we must refuse pass silently
(`${B/e/E}` returns B unchanged). `string.Template`, `os.path.expandvars` and python-dotenv's
expander have no nested defaults. This grammar is ~60 lines and tested case by case
(tests/test_matrix_env.py).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Mapping
from typing import Any

MAX_NESTING = 8  # `${A:-${B:-...}}` levels

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# What an unset variable should hold, by the key it fills (else the generic hint).
_HINTS = {
    "path": "set it to your ShareGPT JSON file",
    "model_path": "set it to the model checkpoint directory",
    "model": "set it to the model file or checkpoint directory",
}
_GENERIC_HINT = "export it before running, or give a default: ${{{name}:-value}}"

Loc = tuple[str | int, ...]


class _Problem(Exception):
    """One bad reference; carries the message for the value's YAML location."""


def expand_env_refs(raw: Any, environ: Mapping[str, str] | None = None) -> tuple[Any, list[tuple[Loc, str]]]:
    """(raw with every reference expanded, [(YAML location, problem), ...])."""
    env = os.environ if environ is None else environ
    problems: list[tuple[Loc, str]] = []
    return _walk(raw, (), env, problems), problems


def expand_with_placeholders(
    raw: Any, environ: Mapping[str, str] | None = None
) -> tuple[Any, list[tuple[Loc, str]], list[tuple[Loc, str]]]:
    """What a dry run shows: (raw expanded, problems, unset). A variable that is unset or empty with no
    default stays written `${NAME}` in the value (a placeholder the plan prints) and is listed in
    `unset` with what to set; every other problem is as in expand_env_refs."""
    env = _Placeholders(os.environ if environ is None else environ)
    problems: list[tuple[Loc, str]] = []
    return _walk(raw, (), env, problems), problems, env.unset


class _Placeholders(Mapping[str, str]):
    """The environment, plus the unset variables a reference without a default asked for."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self._env = env
        self.unset: list[tuple[Loc, str]] = []

    def __getitem__(self, name: str) -> str:
        return self._env[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._env)

    def __len__(self) -> int:
        return len(self._env)


def _walk(value: Any, loc: Loc, env: Mapping[str, str], problems: list[tuple[Loc, str]]) -> Any:
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if isinstance(k, str) and "${" in k:
                problems.append((loc + (k,), "a key holds `${`; keys are names and are not expanded"))
            out[k] = _walk(v, loc + (str(k),), env, problems)
        return out
    if isinstance(value, list):
        return [_walk(v, loc + (i,), env, problems) for i, v in enumerate(value)]
    if isinstance(value, str) and "$" in value:
        try:
            text, end = _expand(value, 0, env, loc, 0, top=True)
            assert end == len(value)
            return text
        except _Problem as exc:
            problems.append((loc, str(exc)))
    return value


def _expand(text: str, pos: int, env: Mapping[str, str], loc: Loc, nesting: int, *, top: bool,
            evaluate: bool = True) -> tuple[str, int]:  # fmt: skip
    """Expands from `pos` to the end (top) or to the `}` closing a default; returns (text, end).
    With evaluate=False (an unused default) only the syntax is checked."""
    out: list[str] = []
    while pos < len(text):
        if text.startswith("$${", pos):
            out.append("${")
            pos += 3
        elif text.startswith("${", pos):
            value, pos = _reference(text, pos, env, loc, nesting, evaluate)
            out.append(value)
        elif not top and text[pos] == "}":
            return "".join(out), pos
        else:
            out.append(text[pos])
            pos += 1
    if not top:
        raise _Problem(f"{text!r}: a default is not closed with `}}`")
    return "".join(out), pos


def _reference(
    text: str, start: int, env: Mapping[str, str], loc: Loc, nesting: int, evaluate: bool
) -> tuple[str, int]:
    """One `${...}` starting at `start`; returns (its value, the index after its `}`)."""
    if nesting >= MAX_NESTING:
        raise _Problem(f"{text!r}: references nest deeper than {MAX_NESTING} levels")
    name_match = _NAME.match(text, start + 2)
    end = name_match.end() if name_match else start + 2
    close = text.find("}", start)
    form = text[start : close + 1] if close >= 0 else text[start:]
    where = repr(form) if form == text else f"{form!r} in {text!r}"
    if close < 0:
        raise _Problem(f"{where}: `${{` is not closed with `}}` (write $${{ for a literal ${{)")
    if name_match is None:
        raise _Problem(f"{where} is not a reference: write ${{NAME}} or ${{NAME:-default}} (NAME: letters, digits "
                       "and _, not starting with a digit), or $${ for a literal ${")  # fmt: skip
    name = name_match.group()
    if text.startswith("}", end):
        if evaluate:
            return _lookup(name, env, loc), end + 1
        return "", end + 1
    if text.startswith(":-", end):
        found = env.get(name) if evaluate else None
        use_default = evaluate and not found
        default, close = _expand(text, end + 2, env, loc, nesting + 1, top=False, evaluate=use_default)
        return (default if use_default else (found or "")), close + 1
    raise _Problem(f"{where} is not a supported form; only ${{NAME}} and ${{NAME:-default}} are")


def _lookup(name: str, env: Mapping[str, str], loc: Loc) -> str:
    found = env.get(name)
    if found:
        return str(found)
    key = next((str(part) for part in reversed(loc) if isinstance(part, str)), "")
    hint = _HINTS.get(key) or _GENERIC_HINT.format(name=name)
    state = "is empty" if found == "" else "is not set"
    if isinstance(env, _Placeholders):
        env.unset.append((loc, f"environment variable {name} {state} ({hint})"))
        return f"${{{name}}}"
    raise _Problem(f"environment variable {name} {state} ({hint})")
