"""The `${...}` grammar of matrix values (benchsuite.config.env_refs), form by form.

Every `${` either expands or is a problem naming its YAML path; only `$${` leaves a literal `${`.
The rows marked "expandvars differs" are the cases where PyPI's `expandvars` 1.1.2 (bash grammar)
gives another answer, which is why the module keeps its own small parser (see its docstring).
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from benchsuite.config.env_refs import MAX_NESTING, expand_env_refs

ENV = {"B": "bee", "EMPTY": "", "HOME": "/home/u"}


def expand(text: str) -> str:
    out, problems = expand_env_refs({"model": text}, ENV)
    assert problems == [], problems
    return out["model"]


def problem(text: str) -> str:
    _, problems = expand_env_refs({"engines": {"e": {"model": text}}}, ENV)
    assert len(problems) == 1, problems
    loc, message = problems[0]
    assert loc == ("engines", "e", "model")
    return message


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("${B}", "bee"),
        ("/m/${B}/x", "/m/bee/x"),
        ("${A:-dflt}", "dflt"),
        ("${EMPTY:-dflt}", "dflt"),  # :- also replaces an empty value
        ("${B:-dflt}", "bee"),
        ("${A:-${B:-x}}", "bee"),  # nested defaults (issue 18: stayed literal before)
        ("${A:-${C:-x}}", "x"),
        ("${A:-pre-${B}-post}", "pre-bee-post"),
        ("${B:-${UNSET_AND_UNUSED}}", "bee"),  # an unused default is not evaluated
        ("${A:-}", ""),
        ("${A:-a}}b", "a}b"),
        ("$${X}", "${X}"),  # the escape; expandvars differs (error, or $$ = its pid)
        ("${A:-$${lit}}", "${lit}"),
        ("cost $5", "cost $5"),  # a bare $ is itself; expandvars differs (error)
        ("a$HOME", "a$HOME"),  # only ${...} expands; expandvars differs (/home/u)
        ("$$", "$$"),
    ],
)
def test_forms_that_expand(text: str, expected: str) -> None:
    assert expand(text) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("${}", "'${}' is not a reference"),
        ("/models/${}", "'${}' in '/models/${}' is not a reference"),
        ("${1BAD}", "'${1BAD}' is not a reference"),
        ("${ B}", "is not a reference"),
        ("${A:?x}", "is not a supported form"),
        ("${A-x}", "is not a supported form"),
        ("${B/e/E}", "is not a supported form"),  # expandvars differs: returns 'bee' unchanged
        ("${B", "is not closed"),
        ("${A:-x", "is not closed"),
        ("${A:-${}}", "'${}' in '${A:-${}}' is not a reference"),
        ("${A}", "environment variable A is not set"),
        ("${EMPTY}", "environment variable EMPTY is empty"),
        ("${A:-${C}}", "environment variable C is not set"),
        ("${A:-" * (MAX_NESTING + 1) + "x" + "}" * (MAX_NESTING + 1), f"nest deeper than {MAX_NESTING} levels"),
    ],
)
def test_forms_that_are_refused_naming_the_path(text: str, message: str) -> None:
    assert message in problem(text)


def test_a_key_holding_a_reference_is_refused() -> None:
    _, problems = expand_env_refs({"engines": {"${B}": {}}}, ENV)
    assert problems == [(("engines", "${B}"), "a key holds `${`; keys are names and are not expanded")]


@given(st.text(st.sampled_from("${}:-AB_1 x"), max_size=24))
def test_no_literal_reference_survives_unless_escaped(text: str) -> None:
    out, problems = expand_env_refs({"v": text}, {"A": "a", "B": "b"})
    if not problems:
        assert "${" not in out["v"].replace("${", "", text.count("$${")), (text, out)
