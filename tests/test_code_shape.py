"""The code's shape rules: no function in mtpjax/ over 50 lines (issue 48), no module over 400 (the guide)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_FUNCTION, MAX_MODULE = 50, 400


def too_long(root: Path) -> list[str]:
    """Every function longer than MAX_FUNCTION lines, and every module longer than MAX_MODULE, under `root`."""
    out = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        if (n := text.count("\n")) > MAX_MODULE:
            out.append(f"{path.relative_to(root.parent)}: {n} lines")
        for node in ast.walk(ast.parse(text, str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if (n := node.end_lineno - node.lineno + 1) > MAX_FUNCTION:
                    out.append(f"{path.relative_to(root.parent)}:{node.lineno} {node.name}: {n} lines")
    return out


def test_no_function_over_50_lines_and_no_module_over_400():
    assert too_long(ROOT / "mtpjax") == []


def test_companion_a_long_function_and_a_long_module_are_found(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "f.py").write_text("def f():\n" + "    x = 1\n" * MAX_FUNCTION)
    (pkg / "m.py").write_text("x = 1\n" * (MAX_MODULE + 1))
    (pkg / "ok.py").write_text("def g():\n" + "    x = 1\n" * (MAX_FUNCTION - 1))
    assert too_long(pkg) == ["pkg/f.py:1 f: 51 lines", "pkg/m.py: 401 lines"]
