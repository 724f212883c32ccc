"""The report's jinja2 templates (benchsuite.report.template_env): every value autoescaped in html.escape's
spelling (the page's bytes from before the templates), a misspelt name an error, and the templates
shipped in the wheel (package data), not only found in this checkout."""

from __future__ import annotations

import html
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import jinja2
import pytest

from benchsuite.report.html import Section, render_page
from benchsuite.report.template_env import environment

ROOT = Path(__file__).resolve().parents[1]
TEMPLATES = ROOT / "benchsuite" / "report" / "templates"


def test_page_escapes_every_value_like_html_escape() -> None:
    text = "<b>\"x\" & 'y'</b>"
    escaped = html.escape(text)  # &lt;b&gt;&quot;x&quot; &amp; &#x27;y&#x27;&lt;/b&gt;
    whole = render_page(text, "<p>trusted header</p>", [Section(text, "s1", "<em>intro</em>", None)], [], [text], [])
    assert whole.startswith('<!DOCTYPE html><html lang="en">') and whole.endswith("</body></html>")
    head, script = whole.split('<script type="text/javascript">')
    page = head + script.split("</script>", 1)[1]  # plotly.js aside: it holds entity tables of its own
    assert f"<title>{escaped}</title>" in page and f"<h1>{escaped}</h1>" in page
    assert f'<a href="#s1">{escaped}</a>' in page and f'<h2 id="s1">{escaped}</h2><em>intro</em>' in page
    assert f"<p>Not drawn, for lack of data: {escaped}.</p>" in page
    assert "<p>trusted header</p>" in page  # HTML this package built passes as it is
    assert text not in page and "&#39;" not in page and "&#34;" not in page  # jinja2's own spelling: never


def test_a_misspelt_name_fails_the_render() -> None:
    with pytest.raises(jinja2.UndefinedError):
        environment().from_string("{{ no_such_value }}").render()


def test_the_wheel_ships_the_templates(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for package in ("benchsuite", "paged_experts"):
        shutil.copytree(ROOT / package, src / package, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    dist = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation", "-q", "-w", str(dist)],
        check=True,
        timeout=300,
    )
    wheel = zipfile.ZipFile(next(dist.glob("benchsuite-*.whl")))
    shipped = {Path(n).name for n in wheel.namelist() if n.startswith("benchsuite/report/templates/")}
    assert shipped == {p.name for p in TEMPLATES.iterdir()} and "page.html.j2" in shipped
    # the unpacked wheel renders from its own copy, not from this checkout
    site = tmp_path / "site"
    wheel.extractall(site)
    probe = (
        "from benchsuite.report import template_env as t\n"
        "print(t.__file__)\n"
        "print(len(t.environment().get_template('report.css').render()))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe],
        env={**os.environ, "PYTHONPATH": str(site)},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout.split()
    assert Path(out[0]).is_relative_to(site) and int(out[1]) > 1000
