"""The documentation's Python runs as written: the API page's opening example, the README's Python lines and the
decoding page's snippet, each executed verbatim in a directory whose `runs/tiny` (and `runs/draft_tiny`, the
decoding page's draft model: any run with the same tokenizer) is the shared trained tiny run (slow: they compile
decode loops)."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, re.DOTALL)


SNIPPETS = {
    "docs/api.md": lambda t: python_blocks(t)[0],
    "README.md": lambda t: python_blocks(t.split("From Python", 1)[1])[0],
    "docs/decoding.md": lambda t: python_blocks(t.split("## From Python", 1)[1])[0],
}


def test_the_snippets_are_found():
    for page, pick in SNIPPETS.items():
        code = pick((ROOT / page).read_text())
        assert 'runs/tiny' in code and compile(code, page, "exec"), page


@pytest.mark.slow
@pytest.mark.parametrize("page", SNIPPETS)
def test_a_documented_snippet_runs_as_written(page, tiny_run, tmp_path, monkeypatch, capsys):
    (tmp_path / "runs").mkdir()
    for name in ("tiny", "draft_tiny"):
        (tmp_path / "runs" / name).symlink_to(tiny_run[1])
    monkeypatch.chdir(tmp_path)
    exec(SNIPPETS[page]((ROOT / page).read_text()), {"__name__": "__snippet__"})
    out = capsys.readouterr().out
    assert out.strip(), page
