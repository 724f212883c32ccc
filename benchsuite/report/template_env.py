"""The report's jinja2 environment: the page templates shipped in benchsuite/report/templates
(package data), autoescaped.

Every `{{ value }}` is escaped unless it is Markup (`|safe`, or HTML this package built), and escaped
the way html.escape does (`&quot;`, `&#x27;`), the spelling of the pages the report wrote with f-strings
before its templates: the same report, the same bytes. jinja2's own escaping spells those `&#34;` and
`&#39;`, so the templates use no `|e` or `|join` of text (they would escape in that spelling).
"""

from __future__ import annotations

import html
from functools import cache
from typing import Any

import jinja2
from markupsafe import Markup


def _escape(value: Any) -> Markup:
    # called on every {{ }} value before autoescaping, which leaves Markup as it is
    return value if isinstance(value, Markup) else Markup(html.escape(str(value)))


@cache
def environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.PackageLoader("benchsuite.report", "templates"),
        autoescape=True,
        finalize=_escape,
        undefined=jinja2.StrictUndefined,  # a misspelt name fails the report instead of printing nothing
        trim_blocks=True,  # a line holding only a {% tag %} leaves no newline in the page
        lstrip_blocks=True,
    )


def render(name: str, **values: Any) -> str:
    return environment().get_template(name).render(**values)
