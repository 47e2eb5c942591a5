"""The package's layer order (mtpjax.LAYERS) and no import cycle: every import of every module, parsed with ast."""

import ast
from pathlib import Path

import mtpjax

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
    """Module -> the package's modules it imports anywhere (module level, in functions, under TYPE_CHECKING).

    `from P import m` counts P.m if m is a module. A parent package's __init__, which Python runs first, is an
    edge only when imported by name: otherwise every package that re-exports its submodules would be a cycle."""
    mods = _modules(root, package)
    graph = {m: set() for m in mods}
    for name, path in mods.items():
        pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
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


def layer_of(module: str, layers: tuple[str, ...]) -> int:
    """The module's rank in `layers` (bottom first); the root package is below all, a `__main__` is the top."""
    parts = module.split(".")
    if parts[-1] == "__main__":
        return len(layers) - 1
    if len(parts) == 1:
        return -1
    if parts[1] not in layers:
        raise AssertionError(f"{module} is in no layer: add its package to {parts[0]}.LAYERS")
    return layers.index(parts[1])


def upward_imports(graph: dict[str, set[str]], layers: tuple[str, ...]) -> list[tuple[str, str]]:
    """Every (importer, imported) pair where the imported module sits in a higher layer."""
    return sorted((a, b) for a, deps in graph.items() for b in deps if layer_of(b, layers) > layer_of(a, layers))


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


def test_every_import_goes_down_the_layers():
    graph = import_graph(ROOT, "mtpjax")
    assert {"mtpjax.decode.loop", "mtpjax.nn.speed", "mtpjax.cli.decode", "mtpjax.data.mixture"} <= set(graph)
    assert "mtpjax.decode.host" in graph["mtpjax.decode.autodraft"]  # the parser sees `from pkg import module`
    assert "mtpjax.train.checkpoint" in graph["mtpjax.cli.decode"]  # and imports inside functions
    assert {m.split(".")[1] for m in graph if m.count(".")} - {"__main__"} == set(mtpjax.LAYERS)
    assert upward_imports(graph, mtpjax.LAYERS) == []


def test_the_package_has_no_import_cycle():
    assert find_cycle(import_graph(ROOT, "mtpjax")) == []


def _package(tmp_path, files: dict[str, str]) -> Path:
    for rel, text in {"pkg/__init__.py": "", **files}.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    return tmp_path


LAYERED = {"pkg/low/__init__.py": "", "pkg/low/a.py": "X = 1\n", "pkg/high/__init__.py": "",
           "pkg/high/b.py": "from pkg.low import a\n", "pkg/high/__main__.py": "from pkg.high import b\n"}


def test_companion_an_upward_import_of_each_kind_is_found(tmp_path):
    """The same low -> high import planted at module level, inside a function and under TYPE_CHECKING."""
    layers = ("low", "high")
    assert upward_imports(import_graph(_package(tmp_path / "ok", LAYERED), "pkg"), layers) == []
    plants = {"module": "from pkg.high import b\n",
              "function": "def f():\n    from pkg.high.b import c\n    return c\n",
              "typing": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.high.b\n"}
    for kind, text in plants.items():
        root = _package(tmp_path / kind, {**LAYERED, "pkg/low/a.py": text})
        assert upward_imports(import_graph(root, "pkg"), layers) == [("pkg.low.a", "pkg.high.b")], kind


def test_companion_a_function_level_cycle_is_found(tmp_path):
    """The old speculative <-> autodraft shape: a module-level import one way, a function-level one back."""
    root = _package(tmp_path, {"pkg/speculative.py": "from pkg import autodraft\n",
                               "pkg/autodraft.py": "def calibrate():\n    from .speculative import run\n",
                               "pkg/other.py": "import pkg.speculative\n"})
    assert find_cycle(import_graph(root, "pkg")) == ["pkg.autodraft", "pkg.speculative", "pkg.autodraft"]


def test_companion_a_type_checking_cycle_is_found(tmp_path):
    """The former data/corpus <-> data/mixture shape: one side's import only under TYPE_CHECKING."""
    root = _package(tmp_path, {"pkg/corpus.py": "def f():\n    from pkg.mixture import g\n",
                               "pkg/mixture.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                                 "    from pkg.corpus import f\n"})
    assert find_cycle(import_graph(root, "pkg")) == ["pkg.corpus", "pkg.mixture", "pkg.corpus"]
