"""The shape alphabet (mtpjax/nn/shapes.py) holds in every array name of the package: ast only, no jax needed."""

import ast
import re
import sys
from pathlib import Path

import pytest

from mtpjax.nn.shapes import ALPHABET

ROOT = Path(__file__).resolve().parent.parent
SUFFIXED = re.compile(r"^_*[a-z][a-z0-9]*(?:_[a-z0-9]+)*_([A-Z][A-Z0-9]*)$")  # x_BTD, h0_BTD, lengths_V
RESERVED = {c for c, doc in ALPHABET.items() if "(reserved)" in doc}
# Arrays are batch-major; only an axis that stacks whole batches (micro-batches, depths, layers, loss chunks)
# comes before B. A depth axis written K (the old loss.py's x_KBCV) breaks this.
STACKS = set("AJLMQU")
# nn/loss.py works on hidden states and logits, never on attention heads or cache positions: one of these
# letters there is a depth axis in the wrong letter (the old self_K).
ATTENTION = set("KNRHS")
# A single capital bound straight to one of these config fields is that field's axis.
FIELD_LETTERS = {"mtp_depth": "J", "micro_batches": "A", "batch_size": "B", "seq_len": "T", "n_layers": "L",
                 "vocab_size": "V", "d_model": "D", "n_heads": "N", "n_kv_heads": "K", "num_draft": "G",
                 "head_dim": "H", "resolved_head_dim": "H", "d_ff": "F", "resolved_d_ff": "F",
                 "n_routed_experts": "E", "num_experts_per_tok": "X"}
# A letter twice in one suffix only where the shape really has that axis twice.
REPEATS = {
    ("mtpjax/nn/layers.py", "BKRTT"): "cached attention's scores of the R*T query rows over this call's T keys",
    ("mtpjax/nn/layers.py", "RTT"): "the causal mask of those R*T query rows over the same T keys",
    ("mtpjax/nn/layers.py", "BTT"): "a tree round's which-row-sees-which mask: this call's T rows over the same T rows",
    ("mtpjax/nn/mla.py", "BTT"): "the same tree mask, passed to MLA's cached attention",
    ("mtpjax/decode/mtp_proposers.py", "BTT"): "the tree mask a module's window of T rows is drafted under",
    ("mtpjax/decode/mtp_proposers.py", "WW"): "the causal part of that mask over the module's W recomputed rows",
    ("mtpjax/decode/mtp_proposers.py", "OO"): "which of a level's O node rows sees which (its ancestors)",
    ("mtpjax/decode/loop.py", "YY"): "the tree mask over the Y verified rows (each row sees its ancestors)",
}
# (file, rule) still broken and awaiting a rename on another branch (none now: decode/ was the last). Each entry
# must still fail (test_pending_files_still_break_their_rule), so none outlives its fix.
PENDING: set = set()
GLOSSARY = re.compile(r"^\s*[A-Z] {2,}[a-z]", re.M)  # "    B  batch rows": a line of an alphabet's own copy


def package_sources() -> dict[str, str]:
    """Relative path -> source of every module of the package."""
    return {f.relative_to(ROOT).as_posix(): f.read_text() for f in sorted((ROOT / "mtpjax").rglob("*.py"))}


def identifiers(tree: ast.AST):
    """Every name the code binds or reads: variables, arguments, attributes, functions, classes, keywords."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            yield node.id
        elif isinstance(node, ast.arg):
            yield node.arg
        elif isinstance(node, ast.Attribute):
            yield node.attr
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node.name
        elif isinstance(node, ast.keyword) and node.arg:
            yield node.arg


def suffix_problems(path: str, suffix: str) -> list[str]:
    """What is wrong with one name's shape suffix (empty: nothing)."""
    out = [f"'{c}' is no letter of the alphabet" for c in dict.fromkeys(suffix) if c not in ALPHABET]
    out += [f"'{c}' is reserved ({ALPHABET[c]})" for c in dict.fromkeys(suffix) if c in RESERVED]
    if len(set(suffix)) < len(suffix) and (path, suffix) not in REPEATS:
        out.append("repeats a letter (a shape with one axis twice goes in REPEATS, with its reason)")
    if "B" in suffix and not set(suffix[: suffix.index("B")]) <= STACKS:
        out.append(f"only a stacking axis ({''.join(sorted(STACKS))}) comes before B")
    if path == "mtpjax/nn/loss.py" and set(suffix) & ATTENTION:
        out.append(f"the loss has no attention axis ({''.join(sorted(ATTENTION))}): a depth axis is J or M")
    return out


def capital_problems(tree: ast.AST) -> list[str]:
    """Single capitals bound as shape sizes: alphabet letters, none reserved, config fields and `.shape`
    unpackings in their own letters."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.arg) and _capital(node.arg):
            out += _letter(node.arg, node.lineno)
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) and _capital(node.id):
            out += _letter(node.id, node.lineno)
        for target in node.targets if isinstance(node, ast.Assign) else ():
            out += [f"line {node.lineno}: {name} = {what}, which is {want}"
                    for name, want, what in _bound(target, node.value) if name != want]
    return out


def _capital(name: str) -> bool:
    return len(name) == 1 and name.isupper()


def _letter(name: str, line: int) -> list[str]:
    if name not in ALPHABET:
        return [f"line {line}: {name} is no letter of the alphabet"]
    return [f"line {line}: {name} is reserved ({ALPHABET[name]})"] if name in RESERVED else []


def _bound(target: ast.expr, value: ast.expr):
    """(capital, the letter its value is, the value) for each capital bound to a config field or a suffixed
    shape: `J = cfg.model.mtp_depth`, `B, T, D = x_BTD.shape`, `T = x_BTD.shape[1]`, elementwise in tuples."""
    if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple) and len(target.elts) == len(value.elts):
        for t, v in zip(target.elts, value.elts):
            yield from _bound(t, v)
        return
    suffix = _shape_of(value)
    if isinstance(target, ast.Tuple) and suffix and len(target.elts) == len(suffix):
        for t, want in zip(target.elts, suffix):
            if isinstance(t, ast.Name) and _capital(t.id):
                yield t.id, want, f"axis {want} of {ast.unparse(value)}"
        return
    if not (isinstance(target, ast.Name) and _capital(target.id)):
        return
    if isinstance(value, ast.Subscript):
        of, index = _shape_of(value.value), value.slice
        if of and isinstance(index, ast.Constant) and isinstance(index.value, int):
            if -len(of) <= index.value < len(of):
                yield target.id, of[index.value], ast.unparse(value)
    field = _field(value)
    if field in FIELD_LETTERS:
        yield target.id, FIELD_LETTERS[field], ast.unparse(value)


def _shape_of(value: ast.expr) -> str | None:
    """SUFFIX for `x_SUFFIX.shape` (a name or an attribute)."""
    if isinstance(value, ast.Attribute) and value.attr == "shape":
        inner = value.value
        name = inner.id if isinstance(inner, ast.Name) else inner.attr if isinstance(inner, ast.Attribute) else ""
        m = SUFFIXED.match(name)
        return m.group(1) if m else None
    return None


def _field(value: ast.expr) -> str | None:
    """The field a value reads straight: `cfg.x.field`, `field`, `info["field"]`."""
    if isinstance(value, ast.Attribute):
        return value.attr
    if isinstance(value, ast.Name):
        return value.id
    if isinstance(value, ast.Subscript) and isinstance(value.slice, ast.Constant):
        return value.slice.value if isinstance(value.slice.value, str) else None
    return None


def violations(sources: dict[str, str]) -> set[tuple[str, str, str]]:
    """(file, rule, what) for every breach of the alphabet in `sources` (relative path -> source)."""
    out = set()
    for path, text in sources.items():
        tree = ast.parse(text, path)
        for name in set(identifiers(tree)):
            m = SUFFIXED.match(name)
            out |= {(path, "suffix", f"{name}: {p}") for p in suffix_problems(path, m.group(1))} if m else set()
        out |= {(path, "capital", p) for p in capital_problems(tree)}
    return out


def test_every_array_name_speaks_the_alphabet():
    found = sorted(v for v in violations(package_sources()) if v[:2] not in PENDING)
    assert not found, "\n".join(f"{f} ({rule}): {what}" for f, rule, what in found)


def test_pending_files_still_break_their_rule():
    found = {v[:2] for v in violations(package_sources())}
    assert PENDING <= found, f"fixed now, drop from PENDING: {sorted(PENDING - found)}"


def test_the_alphabet_is_written_once():
    layers = (ROOT / "mtpjax/nn/layers.py").read_text()
    assert "mtpjax/nn/shapes.py" in ast.get_docstring(ast.parse(layers))
    copies = {p: len(GLOSSARY.findall(t)) for p, t in package_sources().items() if p != "mtpjax/nn/shapes.py"}
    assert not {p: n for p, n in copies.items() if n > 1}, copies


def test_reserved_letters_are_marked_and_repeats_are_real():
    assert RESERVED == set()  # O: the draft trees' nodes; Z: MLA's latent rank; E, X: the experts; U: unrolled
    assert all(len(set(s)) < len(s) for _, s in REPEATS)


def test_one_letter_one_meaning():
    assert all(len(c) == 1 and c.isupper() for c in ALPHABET) and len(ALPHABET) == 26
    assert len(set(ALPHABET.values())) == len(ALPHABET)


# Companions: each rule catches the mistake it is there for.

@pytest.mark.parametrize("path, source, rule", [
    ("mtpjax/nn/x.py", "def f(x_BTW2): pass", "no letter"),  # a literal size is not an axis
    ("mtpjax/nn/x.py", "y_BOD = 0", "reserved"),
    ("mtpjax/nn/x.py", "y_BTT = 0", "repeats a letter"),
    ("mtpjax/nn/x.py", "y_KBCV = 0", "before B"),  # the old loss.py's depth-first logits
    ("mtpjax/nn/loss.py", "self_K = 0", "no attention axis"),  # the old loss.py's per-depth means
])
def test_suffix_rules_bite(path, source, rule, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "RESERVED", {"O"})  # none is reserved now: the rule on one that is
    assert any(r == "suffix" and rule in what for _, r, what in violations({path: source})), rule


@pytest.mark.parametrize("source, rule", [
    ("D = cfg.model.mtp_depth", "which is J"),  # the old flops.py / plan.py
    ("dp, B, M = mesh, cfg.train.batch_size, cfg.train.micro_batches", "which is A"),  # the old train/loop.py
    ("B = info['batch_size']\nT = info['seq_len']\nK = info['mtp_depth']", "which is J"),
    ("M, B, T, K = hidden_MBTD.shape", "which is D"),
    ("P = ctx.h_BTD.shape[1]", "which is T"),
    ("O = T // C", "reserved"),
    ("def f(O): pass", "reserved"),
])
def test_capital_rules_bite(source, rule, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "RESERVED", {"O"})  # none is reserved now: the rule on one that is
    assert any(r == "capital" and rule in what for _, r, what in violations({"mtpjax/nn/x.py": source})), rule


def test_the_rules_pass_what_is_right():
    ok = ("M, B, T, D = hidden_MBTD.shape\nJ = cfg.model.mtp_depth\nB, T, _ = x_BTD.shape\nA = micro_batches\n"
          "def f(loss_M, self_J, x_JBCV, q_BTKRH, h_ID, k_BKSH): return x_JBCV.shape[-1]\nV = logits.shape[-1]")
    assert not violations({"mtpjax/nn/x.py": ok})
    assert not violations({"mtpjax/nn/loss.py": "def f(loss_M, self_J, x_JBCV, tgt_MBT): pass"})


def test_the_old_layers_alphabet_is_caught():
    old = '"""Layers.\n\n    B  batch rows                          V  vocabulary\n    T  positions of this call\n"""\n'
    assert len(GLOSSARY.findall(old)) > 1
