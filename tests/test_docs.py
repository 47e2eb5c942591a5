"""The documentation holds together: every page is in the nav, the README's links land on pages and headings that
exist, the README stays short, the site shows the README's quickstart, and every `docs/design.md §N` the code cites
is a section of the design page."""

import re
from pathlib import Path

import markdown
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
CITATION = re.compile(r"docs/design\.md §(\d+[a-z]?)")


def nav_pages(nav) -> list[str]:
    """The page paths of a mkdocs nav (nested lists of {title: page or list})."""
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, dict):
        return [p for v in nav.values() for p in nav_pages(v)]
    return [p for item in nav for p in nav_pages(item)]


def unlisted(docs: Path, nav) -> tuple[list[str], list[str]]:
    """(pages under docs/ that the nav leaves out, nav entries with no page)."""
    pages = {p.relative_to(docs).as_posix() for p in docs.rglob("*.md")}
    listed = set(nav_pages(nav))
    return sorted(pages - listed), sorted(listed - pages)


def anchors(page: Path) -> set[str]:
    """The heading ids of a page as MkDocs renders them (Python-Markdown's toc extension)."""
    md = markdown.Markdown(extensions=["toc", "tables", "fenced_code"])
    md.convert(page.read_text())

    def ids(tokens):
        return {t["id"] for t in tokens} | {i for t in tokens for i in ids(t["children"])}

    return ids(md.toc_tokens)


def broken_doc_links(text: str, root: Path) -> list[str]:
    """The `docs/...` links of a Markdown text whose page or heading does not exist under root."""
    broken = []
    for target in re.findall(r"\]\((docs/[^)\s]*)\)", text):
        path, _, anchor = target.partition("#")
        page = root / path
        if not page.is_file() or (anchor and anchor not in anchors(page)):
            broken.append(target)
    return broken


def broken_citations(sources: list[Path], root: Path) -> list[str]:
    """`file: docs/page.md#heading` for each heading the sources cite (in prose, not as a link) that does not exist."""
    return [f"{p.name}: {target}" for p in sources for target in re.findall(r"docs/[\w-]+\.md#[\w-]+", p.read_text())
            if broken_doc_links(f"]({target})", root)]


def design_sections(text: str) -> set[str]:
    """The section numbers of the design page ('## 6a. Leaving ...' -> '6a')."""
    return set(re.findall(r"^## (\w+)\. ", text, re.MULTILINE))


def uncited(sources: list[Path], sections: set[str]) -> list[str]:
    """`file: §N` for each design citation in the sources whose section does not exist."""
    return [f"{p.name}: §{n}" for p in sources for n in CITATION.findall(p.read_text()) if n not in sections]


def test_every_docs_page_is_in_the_nav():
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]
    left_out, missing = unlisted(DOCS, nav)
    assert not left_out, f"docs pages not in mkdocs.yml's nav: {left_out}"
    assert not missing, f"mkdocs.yml's nav names pages that do not exist: {missing}"


def test_unlisted_sees_a_page_left_out_and_a_missing_one(tmp_path):
    for name in ("index.md", "orphan.md"):
        (tmp_path / name).write_text("# t\n")
    assert unlisted(tmp_path, [{"Home": "index.md"}, {"More": [{"Gone": "gone.md"}]}]) == (["orphan.md"], ["gone.md"])


def test_readme_links_resolve_to_docs_pages_and_headings():
    readme = (ROOT / "README.md").read_text()
    assert re.findall(r"\]\((docs/[^)\s]*)\)", readme), "the README links to no docs page"
    assert not broken_doc_links(readme, ROOT)


def test_broken_doc_links_sees_a_missing_page_and_a_missing_heading(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A\n\n## Some heading\n")
    text = "[ok](docs/a.md) [ok](docs/a.md#some-heading) [page](docs/b.md) [heading](docs/a.md#other)"
    assert broken_doc_links(text, tmp_path) == ["docs/b.md", "docs/a.md#other"]


def test_docs_home_runs_the_readme_quickstart():
    from readme_quickstart import quickstart_commands

    home = (DOCS / "index.md").read_text()
    assert quickstart_commands(home) == quickstart_commands()  # the tests run the README's; the site shows the same
    assert quickstart_commands(home.replace("--top-k 40", "--top-k 4")) != quickstart_commands()


def test_readme_is_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200  # the rest lives in docs/


def test_design_citations_name_existing_sections():
    sections = design_sections((DOCS / "design.md").read_text())
    assert {"1", "2", "3", "4", "5", "6", "6a", "7"} <= sections  # the numbers the code cites stay stable
    sources = [p for p in [*(ROOT / "mtpjax").rglob("*.py"), *(ROOT / "tests").glob("*.py")] if p != Path(__file__)]
    assert not uncited(sources, sections)
    assert not [p.name for p in sources if "DESIGN §" in p.read_text()], "cite the design as docs/design.md §N"


def test_uncited_sees_a_section_the_design_lacks(tmp_path):
    src = tmp_path / "m.py"
    src.write_text('"""See docs/design.md §2 and docs/design.md §9."""\n')
    assert uncited([src], {"2"}) == ["m.py: §9"]
    assert design_sections("## 6a. Leaving\n## 7. Layout\n### 8. not a section\n") == {"6a", "7"}


def test_headings_the_code_cites_exist():
    """A docstring or help text's `docs/page.md#heading` names a heading of that page (bench/cache_cliff.py cited
    benchmarks.md#verification-cost after the heading grew to "Verification cost on the memory-bound model")."""
    sources = [*(ROOT / "mtpjax").rglob("*.py"), *(ROOT / "bench").rglob("*.py"), *(ROOT / "launch").iterdir(),
               ROOT / "train.py", ROOT / "decode.py"]
    assert not broken_citations(sources, ROOT)


def test_broken_citations_sees_a_missing_heading_and_page(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A\n\n## Some heading\n")
    src = tmp_path / "m.py"
    src.write_text('"""See docs/a.md#some-heading, docs/a.md#other and docs/b.md#x."""\n')
    assert broken_citations([src], tmp_path) == ["m.py: docs/a.md#other", "m.py: docs/b.md#x"]
