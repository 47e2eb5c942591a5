"""The built site reads well: on the configuration page no key cell can break inside a config key's name, by the
HTML the site builds and the cascade of its CSS (Material lets inline code break anywhere; docs/stylesheets/
extra.css must win for key cells). tests/render_config_page.py checks the same in headless Chromium."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KEY = re.compile(r"<code>[\w.\-]+</code>")
NEEDS = {"white-space": "nowrap", "word-break": "normal", "overflow-wrap": "normal"}


def build(src: Path, out: Path) -> Path:
    """`mkdocs build --strict` of the site rooted at src into out."""
    res = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-f", str(src / "mkdocs.yml"),
                          "-d", str(out)], capture_output=True, text=True,
                         env={**os.environ, "NO_MKDOCS_2_WARNING": "1"}, timeout=300)
    assert res.returncode == 0, res.stderr
    return out


def specificity(selector: str) -> tuple[int, int, int]:
    """(ids, classes + attributes + pseudo-classes, elements) of one selector; `:not(x)` counts as x."""
    s = re.sub(r":not\(([^)]*)\)", r" \1", selector)
    ids = len(re.findall(r"#[\w-]+", s))
    classes = len(re.findall(r"\.[\w-]+|\[[^\]]*\]|(?<!:):(?!:)[\w-]+", s))
    elements = len(re.findall(r"(?:^|[\s>+~])([a-zA-Z][\w-]*)", s))
    return ids, classes, elements


def rules(css: str):
    """(selector, {property: value}) of every rule outside @-blocks' headers (flat enough for these sheets)."""
    css = re.sub(r"/\*.*?\*/", "", css, flags=re.DOTALL)
    for sel, body in re.findall(r"([^{}@]+)\{([^{}]*)\}", css):
        decl = dict((k.strip(), v.strip()) for k, _, v in (d.partition(":") for d in body.split(";")) if v)
        for one in sel.split(","):
            yield one.strip(), decl


def key_cell_breaks(site: Path) -> list[str]:
    """Why a config key could break inside its name on the built configuration page (empty: it cannot)."""
    html = (site / "configuration" / "index.html").read_text()
    problems = [f"key cell {c!r} is not one code name" for c in re.findall(r"<tr>\s*<td>(.*?)</td>", html)
                if not KEY.fullmatch(c)]
    sheets = [site / h for h in re.findall(r'<link rel="stylesheet" href="\.\./([^"]+\.css)"', html)]
    theirs = [(sel, d) for f in sheets if "/assets/" in f.as_posix() for sel, d in rules(f.read_text())
              if re.search(r"(^|\s)code$", sel) and "pre" not in sel and "md-nav" not in sel]
    ours = [(sel, d) for f in sheets if "/assets/" not in f.as_posix() for sel, d in rules(f.read_text())
            if re.search(r"td:first-child code$", sel)]
    for prop, value in NEEDS.items():
        rival = max((specificity(s) for s, d in theirs if prop in d), default=(0, 0, 0))
        if not any(d.get(prop) == value and specificity(s) > rival for s, d in ours):
            problems.append(f"no key-cell rule sets {prop}: {value} above the theme's {rival}")
    return problems


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    return build(ROOT, tmp_path_factory.mktemp("site"))


def test_key_cells_of_the_configuration_page_never_break_inside_a_name(site):
    assert (site / "stylesheets" / "extra.css").is_file()
    assert len(re.findall(r"<tr>\s*<td><code>model\.", (site / "configuration" / "index.html").read_text())) > 20
    assert key_cell_breaks(site) == []


def test_companion_the_theme_alone_breaks_key_cells(site, tmp_path):
    """Without extra.css's key-cell rule the theme's `word-break: break-word` on code is what applies."""
    bare = tmp_path / "site"
    shutil.copytree(site, bare)
    css = bare / "stylesheets" / "extra.css"
    css.write_text(re.sub(r"[^{}]*td:first-child code\s*\{[^}]*\}", "", css.read_text()))
    assert len(key_cell_breaks(bare)) == len(NEEDS)
    assert specificity(".md-typeset table:not([class]) td:first-child code") == (0, 3, 3)
    assert specificity(".md-typeset code") == (0, 1, 1)
