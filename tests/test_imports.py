"""No import cycle in the package: every import of every mtpjax module, module- or function-level, parsed with ast."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _modules(root: Path, package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under root/package (a package is its __init__)."""
    out = {}
    for f in sorted((root / package).rglob("*.py")):
        parts = list(f.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """Module -> the package's modules it imports anywhere in its body (`from P import m` counts P.m if a module).

    A parent package's __init__, which Python runs first, is an edge only when imported by name: otherwise
    every package that re-exports its submodules would be a cycle."""
    mods = _modules(root, package)
    graph = {m: set() for m in mods}
    for name, path in mods.items():
        pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in _runtime_nodes(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            for t in targets:
                while t and t not in mods:  # `import mtpjax.decode.loop.x` names the module mtpjax.decode.loop
                    t = t.rpartition(".")[0]
                if t and t != name:
                    graph[name].add(t)
    return graph


def _runtime_nodes(tree):
    """Every node that can run: all of them but the bodies of `if TYPE_CHECKING:` blocks."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                stack.extend(child.orelse)
            else:
                stack.append(child)


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle as [a, b, ..., a], or [] if there is none."""
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                return stack[stack.index(n):] + [n]
            if n not in state and (found := visit(n)):
                return found
        stack.pop()
        state[m] = "done"
        return []

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return []


def test_the_package_has_no_import_cycle():
    graph = import_graph(ROOT, "mtpjax")
    assert {"mtpjax.decode.loop", "mtpjax.decode.autodraft", "mtpjax.speed"} <= set(graph)
    assert "mtpjax.decode.host" in graph["mtpjax.decode.autodraft"]  # the parser sees `from pkg import module`
    assert find_cycle(graph) == []


def test_companion_a_function_level_cycle_is_found(tmp_path):
    """The old speculative <-> autodraft shape: a module-level import one way, a function-level one back."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "speculative.py").write_text("from pkg import autodraft\n")
    (pkg / "autodraft.py").write_text("def calibrate():\n    from .speculative import run\n    return run\n")
    (pkg / "other.py").write_text("import pkg.speculative\n")
    (pkg / "typed.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.other\n")
    (pkg / "other.py").write_text("import pkg.speculative\nimport pkg.typed\n")  # typed's import never runs
    assert find_cycle(import_graph(tmp_path, "pkg")) == ["pkg.autodraft", "pkg.speculative", "pkg.autodraft"]
