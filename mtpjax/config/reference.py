"""The configuration reference page, generated from the schema's field metadata: `python -m mtpjax.config.reference`."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Literal

from mtpjax.config.schema import MixtureSource, plain, walk
from mtpjax.config.specs import Spec

COMMAND = "python -m mtpjax.config.reference > docs/configuration.md"
_TYPES = {int: "integer", float: "number", bool: "true / false", str: "string"}


def _type(tp: Any, f: dataclasses.Field) -> str:
    """A field's type as the page shows it: the kind of value, its bounds, whether it is runtime-only."""
    return _kind(tp, f) + (" (runtime-only)" if f.metadata["runtime"] else "")


def _kind(tp: Any, f: dataclasses.Field) -> str:
    """The kind of value and its bounds."""
    if typing.get_origin(tp) is Literal:
        return "choice"
    if typing.get_origin(tp) is tuple:
        item = typing.get_args(tp)[0]
        return "list of sources (below)" if item is MixtureSource else f"list of {_TYPES[item]}s"
    name = "string" if isinstance(tp, type) and issubclass(tp, Spec) else _TYPES[tp]
    bounds = f.metadata.get("bounds")
    return f"{name} {bounds}" if bounds is not None else name


def _meaning(tp: Any, f: dataclasses.Field) -> str:
    """The field's doc, then what each choice means (or the accepted forms)."""
    text = f.metadata["doc"]
    if typing.get_origin(tp) is Literal:
        docs = f.metadata.get("choices", {})
        names = typing.get_args(tp)
        text += (" — " + "; ".join(f"`{c}`: {docs[c]}" for c in names) if docs
                 else ": " + ", ".join(f"`{c}`" for c in names))
    if isinstance(tp, type) and issubclass(tp, Spec):
        text += "; forms: " + ", ".join(f"`{form.strip()}`" for form in tp.FORMS.split("|"))
    return text


def _default(value: Any) -> str:
    data = plain(value)
    if isinstance(data, bool):
        return f"`{str(data).lower()}`"
    return '`""`' if data == "" else f"`{data}`"


def _table(rows: list[tuple[str, dataclasses.Field, Any]]) -> list[str]:
    out = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for k, f, tp in rows:
        cells = (f"`{k}`", _type(tp, f), _default(f.default), _meaning(tp, f))
        out.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return out


def markdown() -> str:
    """The whole reference page: one table per section, then the fields of a mixture entry."""
    lines = ["# Configuration", "",
             f"Generated from the fields of `mtpjax/config/schema.py` (their types and metadata) by `{COMMAND}`: "
             "edit those, not this page.",
             "", "A config file sets only what differs from these defaults (see `configs/`). Every value can be "
             "overridden on the command line as `section.key=value` (a YAML value). Unknown keys, wrong types and "
             "impossible values are refused with one line naming the key, the value and what is allowed. "
             "Runtime-only keys say how to compute, not what: a run resumes, and a checkpoint decodes, with another "
             "value."]
    rows = walk()
    for section in dict.fromkeys(k.split(".")[0] for k, _, _ in rows):
        lines += ["", f"## {section}", "", *_table([r for r in rows if r[0].startswith(f"{section}.")])]
    lines += ["", "### data.mixture entries", "",
              "Each entry of `data.mixture` is a mapping with these keys, e.g. "
              "`{name: web, source: parquet, paths: [data/web], weight: 0.8}`.", "",
              *_table(walk(MixtureSource))]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
