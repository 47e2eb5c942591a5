"""What pyproject.toml promises: the Python floor (what the pinned dependencies need, and no standard-library name
the floor lacks imported anywhere in the package) and extras that pin what they pull in."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())

# Standard-library names by the Python version that added them (What's New 3.11-3.14), those this code base could
# reach for; a module alone is keyed with name None.
ADDED = {
    (3, 11): {("typing", n) for n in ("Self", "LiteralString", "Never", "assert_never", "assert_type",
                                      "reveal_type", "Required", "NotRequired", "Unpack", "TypeVarTuple",
                                      "dataclass_transform", "get_overloads", "clear_overloads")}
    | {("tomllib", None), ("datetime", "UTC"), ("enum", "StrEnum"), ("enum", "verify"), ("asyncio", "TaskGroup"),
       ("asyncio", "timeout"), ("hashlib", "file_digest"), ("operator", "call"), ("contextlib", "chdir")},
    (3, 12): {("typing", "override"), ("typing", "TypeAliasType"), ("itertools", "batched"),
              ("math", "sumprod"), ("os", "unshare"), ("calendar", "Month"), ("calendar", "Day")},
    (3, 13): {("typing", n) for n in ("TypeIs", "ReadOnly", "NoDefault", "get_protocol_members", "is_protocol")}
    | {("warnings", "deprecated"), ("copy", "replace"), ("os", "process_cpu_count"), ("math", "fma"),
       ("pathlib", "UnsupportedOperation")},
    (3, 14): {("annotationlib", None), ("compression", None), ("string.templatelib", None)},
}


def floor() -> tuple[int, int]:
    """requires-python's lower bound."""
    m = re.fullmatch(r">=\s*3\.(\d+)", PYPROJECT["project"]["requires-python"])
    assert m, PYPROJECT["project"]["requires-python"]
    return 3, int(m.group(1))


def newer_than(version: tuple[int, int], source: str) -> list[str]:
    """The standard-library names `source` imports that Python `version` does not have."""
    later = {key: v for v, keys in ADDED.items() if v > version for key in keys}
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module:
            keys = [(node.module, None)] + [(node.module, a.name) for a in node.names]
        elif isinstance(node, ast.Import):
            keys = [(a.name, None) for a in node.names] + [(a.name.partition(".")[0], None) for a in node.names]
        else:
            continue
        found += [f"{m}{'.' + n if n else ''} (Python {'.'.join(map(str, later[m, n]))})"
                  for m, n in keys if (m, n) in later]
    return found


def package_newer_than(version: tuple[int, int], package: Path = ROOT / "mtpjax") -> dict[str, list[str]]:
    out = {}
    for path in sorted(package.rglob("*.py")):
        if found := newer_than(version, path.read_text()):
            out[str(path.relative_to(package.parent))] = found
    return out


def test_the_package_imports_nothing_the_python_floor_lacks():
    assert package_newer_than(floor()) == {}


def test_companion_a_name_past_the_floor_is_found(tmp_path):
    """Companion: typing.Self (3.11) under a 3.10 floor, as config/specs.py imported it when pyproject said 3.10;
    3.12's itertools.batched under this floor; and the package walk finds such an import in a file of the package
    (the pydantic config no longer imports Self: the walk is checked on a package written for it)."""
    assert newer_than((3, 10), "from typing import ClassVar, Self\n") == ["typing.Self (Python 3.11)"]
    assert newer_than(floor(), "import itertools\nfrom itertools import batched\n") == [
        "itertools.batched (Python 3.12)"]
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    (tmp_path / "pkg" / "sub" / "specs.py").write_text("import abc\nfrom typing import Self\n")
    assert package_newer_than((3, 10), tmp_path / "pkg") == {"pkg/sub/specs.py": ["typing.Self (Python 3.11)"]}


def _name(text: str) -> str:
    return re.sub(r"[-_.]+", "-", text).lower()


def _pins(specs: list[str]) -> dict[str, str]:
    """{package: version} of the `name==version` (or `name[extra]==version`) requirements."""
    return {_name(m.group(1)): m.group(2)
            for s in specs if (m := re.fullmatch(r"([A-Za-z0-9_.-]+)(?:\[[^]]*])?==([^;\s]+)", s.strip()))}


def _closure(extras: dict[str, list[str]], extra: str) -> list[str]:
    """An extra's requirements, the project's own extras it names (`mtpjax[peer]`) followed."""
    out = []
    for spec in extras[extra]:
        m = re.fullmatch(r"mtpjax\[([^]]+)]", spec)
        out += [r for e in m.group(1).split(",") for r in _closure(extras, e.strip())] if m else [spec]
    return out


def _installed(name: str) -> str | None:
    """The installed version without its local label (torch's +cpu), None if not installed."""
    try:
        return metadata.version(name).split("+")[0]
    except metadata.PackageNotFoundError:
        return None


def unpinned_needs(extras: dict[str, list[str]]) -> list[str]:
    """'extra: package needs dep' wherever a package an extra pins (installed at that pin) requires one the project
    pins elsewhere but the extra, with the base dependencies, does not: installing it alone would pull another."""
    everywhere = _pins(PYPROJECT["project"]["dependencies"]) | {
        k: v for specs in extras.values() for k, v in _pins(specs).items()}
    out = []
    for extra in extras:
        pins = _pins(PYPROJECT["project"]["dependencies"]) | _pins(_closure(extras, extra))
        for name, version in pins.items():
            if _installed(name) != version:
                continue
            for req in metadata.requires(name) or []:
                dep = _name(re.match(r"[A-Za-z0-9_.-]+", req).group(0))
                if "extra ==" not in req and dep in everywhere and dep not in pins:
                    out.append(f"{extra}: {name} needs {dep}")
    return out


def test_every_extra_pins_what_its_packages_pull_of_the_project_s_pins():
    extras = PYPROJECT["project"]["optional-dependencies"]
    assert all(re.fullmatch(r"mtpjax\[[^]]+]", s) or _pins([s]) for e in extras.values() for s in e), \
        "every extra's requirement is name==version or one of the project's extras"
    assert unpinned_needs(extras) == []


def test_companion_the_eval_extra_before_issue_50_pulls_another_torch():
    """Companion: lm-eval, accelerate and peft alone leave torch and transformers to the resolver (it chose torch
    2.14.1 with its CUDA libraries beside the peer extra's 2.13.0)."""
    extras = {**PYPROJECT["project"]["optional-dependencies"],
              "eval": ["lm-eval==0.4.13", "accelerate==1.16.0", "peft==0.21.2"]}
    found = unpinned_needs(extras)
    assert "eval: accelerate needs torch" in found and "eval: peft needs transformers" in found


def test_the_floor_is_what_the_pinned_dependencies_need_and_ruff_and_the_docs_say_it():
    """requires-python is the highest Requires-Python of the installed pinned dependencies (jax 0.10 needs 3.11:
    a lower floor would promise an install that cannot resolve), ruff checks syntax for it, the docs name it."""
    pins = _pins(PYPROJECT["project"]["dependencies"])
    needs = []
    for name, version in pins.items():
        if _installed(name) == version and (req := metadata.metadata(name)["Requires-Python"]):
            needs += [(3, int(m.group(1))) for m in re.finditer(r">=\s*3\.(\d+)", req)]
    assert needs and floor() == max(needs)
    assert sys.version_info[:2] >= floor()
    assert PYPROJECT["tool"]["ruff"]["target-version"] == f"py3{floor()[1]}"
    text = f"Python 3.{floor()[1]}+"
    assert text in (ROOT / "README.md").read_text() and text in (ROOT / "docs" / "index.md").read_text()
