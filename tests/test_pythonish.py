"""The checker the quickstart test judges generated text with: it passes code and fails what the issue saw."""

import pytest
from pythonish import check_pythonish, logical_lines

GOOD = '''
    """Return the n-th Fibonacci number.

    Counting from fibonacci(0) == 0.
    """
    if n < 2:
        return n
    a, b = 0, 1
    for _ in range(n - 1):
        a, b = b, a + b
    return b


class Cache(dict):
    def __missing__(self, key):
        self.misses += 1  # remember it
        self[key] = value = fibonacci(key)
        return value
'''


def test_real_code_passes():
    rep = check_pythonish(GOOD, "def fibonacci(n):")
    assert rep.ok, rep.failures
    assert rep.keywords == {"if", "return", "for", "class", "def", "self."}
    assert rep.indent_levels == {0, 4, 8}


@pytest.mark.parametrize("text", [
    "\n" + " " * 127,  # what the 200-step byte model printed for "def fibonacci(n):"
    " t to the the the the the the the the the the the the the the the the the the the the the\n" * 4,
    "\n".join(["the value of the file is not the same as the name of the file"] * 8) + "\n",
    "",
])
def test_what_the_issue_saw_fails(text):
    rep = check_pythonish(text, "import os")
    assert not rep.ok


def test_prose_lines_fail_even_when_they_start_with_keywords():
    text = "\n".join(f"{w} the value is in the list of the name {i}" for i, w in
                     enumerate(["if", "for", "return", "import", "with", "if", "for", "return"])) + "\n"
    rep = check_pythonish(text)
    assert rep.keyword_lines == 8 and rep.statement_lines == 0
    assert not rep.ok and any("parse as Python" in f for f in rep.failures)


def test_a_repeated_line_is_not_enough():
    rep = check_pythonish("\n" + "    return self.x\n" * 20, "def f(self):")
    assert not rep.ok and any("different code lines" in f for f in rep.failures)


def test_indentation_must_be_consistent():
    assert check_pythonish(GOOD, "def fibonacci(n):").bad_indents == []
    one = GOOD.replace("\n        return n", "\n      return n")  # 6 spaces
    rep = check_pythonish(one, "def fibonacci(n):")
    assert rep.bad_indents == ["      return n"] and rep.code_lines == 12
    assert rep.ok, rep.failures  # one odd line in twelve is tolerated...
    two = one.replace("\n        self[key]", "\n         self[key]")
    rep = check_pythonish(two, "def fibonacci(n):")
    assert len(rep.bad_indents) == 2 and not rep.ok  # ...two are not
    # deeper without a block header before it
    rep = check_pythonish(GOOD.replace("    a, b = 0, 1\n", "    a, b = 0, 1\n        c = 2\n"), "def fibonacci(n):")
    assert rep.bad_indents == ["        c = 2"]
    # flat code (one indentation level) is not what a reader recognises as a Python block structure
    flat = "\n".join(ln.strip() for ln in GOOD.splitlines() if '"' not in ln and "Counting" not in ln) + "\n"
    assert any("indentation levels" in f for f in check_pythonish(flat).failures)


def test_the_prompt_sets_the_context_but_is_not_judged():
    # the prompt's header makes the first continuation line's indentation legal
    assert check_pythonish(GOOD, "def fibonacci(n):").bad_indents == []
    bad = check_pythonish(GOOD, "x = 1").bad_indents
    assert len(bad) == 1 and bad[0].startswith('    """Return the n-th')
    # a prompt line left open by a bracket: the continuation finishes it, and that line is not judged
    rep = check_pythonish("b):\n    return a + b\n", "def add(a,")
    assert rep.code_lines == 1


def test_a_last_line_cut_off_by_the_token_limit_is_not_judged():
    assert check_pythonish("\n    x = 1\n    retu", "def f():").code_lines == 1
    assert check_pythonish("\n    x = 1\n    return (x,\n", "def f():").code_lines == 1  # bracket still open


def test_logical_lines_join_brackets_and_mark_docstrings():
    text = 'f(a,\n  b)\n"""doc\nprose here\n"""\nx = 1 \\\n    + 2\n'
    assert logical_lines(text) == [(0, "f(a,\n  b)", False), (2, '"""doc"""', False), (3, "prose here", True),
                                   (4, '"""', True), (5, "x = 1 \\\n    + 2", False), (7, "", False)]


def test_block_headers_that_need_a_block_before_them_parse():
    text = "\n    try:\n        x = 1\n    except OSError:\n        pass\n    else:\n        y = 2\n    return y\n"
    rep = check_pythonish(text, "def f():")
    assert rep.statement_lines == rep.code_lines == 7 and rep.ok, rep.failures


def test_a_bracket_never_closed_ends_at_the_next_statement():
    text = "\n    self.sock.append(\n    self.call(fd)\n    return self.sock\n    if x:\n        y = 1\n"
    lines = logical_lines("def f():" + text)
    assert [ln for _, ln, _ in lines] == ["def f():", "    self.sock.append(\n    self.call(fd)",
                                          "    return self.sock", "    if x:", "        y = 1", ""]
    rep = check_pythonish(text, "def f():")
    assert rep.code_lines == 4 and rep.statement_lines == 3
