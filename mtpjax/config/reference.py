"""The configuration reference page, generated from the schema's field metadata: `python -m mtpjax.config.reference`."""

from __future__ import annotations

import typing
from typing import Any, Literal

from mtpjax.config.errors import bounds
from mtpjax.config.schema import Config, MixtureSource, walk

COMMAND = "python -m mtpjax.config.reference > docs/configuration.md"
_TYPES = {int: "integer", float: "number", bool: "true / false", str: "string"}


def _type(tp: Any, f: Any) -> str:
    """A field's type as the page shows it: the kind of value, its bounds, whether it is runtime-only."""
    extra = f.json_schema_extra or {}
    if typing.get_origin(tp) is Literal:
        kind = "choice"
    elif typing.get_origin(tp) is tuple:
        item = typing.get_args(tp)[0]
        item = typing.get_args(item)[0] if typing.get_origin(item) is typing.Annotated else item
        kind = "list of sources (below)" if item is MixtureSource else f"list of {_TYPES[item]}s"
    else:
        kind = "string" if _forms(tp, f) else " ".join(filter(None, (_TYPES[tp], bounds(f))))
    return kind + (" (runtime-only)" if extra.get("runtime") else "")


def _forms(tp: Any, f: Any) -> str:
    """The accepted spellings of a value written as one string ('' for other values)."""
    return getattr(tp, "FORMS", None) or (f.json_schema_extra or {}).get("forms", "")


def _meaning(tp: Any, f: Any) -> str:
    """The field's doc, then what each choice means (or the accepted forms)."""
    text, docs = f.description, (f.json_schema_extra or {}).get("choices", {})
    if typing.get_origin(tp) is Literal:
        names = typing.get_args(tp)
        text += (" — " + "; ".join(f"`{c}`: {docs[c]}" for c in names) if docs
                 else ": " + ", ".join(f"`{c}`" for c in names))
    if forms := _forms(tp, f):
        text += "; forms: " + ", ".join(f"`{form.strip()}`" for form in forms.split("|"))
    return text


def _default(data: Any) -> str:
    if isinstance(data, bool):
        return f"`{str(data).lower()}`"
    return '`""`' if data == "" else f"`{data}`"


def _table(rows: list[tuple[str, Any, Any]], defaults: dict) -> list[str]:
    out = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for k, f, tp in rows:
        cells = (f"`{k}`", _type(tp, f), _default(defaults[k.rpartition(".")[2]]), _meaning(tp, f))
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
    defaults = Config().to_dict()
    for section, f in Config.model_fields.items():
        lines += ["", f"## {section}", "", *_table(walk(f.annotation, f"{section}."), defaults[section])]
    lines += ["", "### data.mixture entries", "",
              "Each entry of `data.mixture` is a mapping with these keys, e.g. "
              "`{name: web, source: parquet, paths: [data/web], weight: 0.8}`.", "",
              *_table(walk(MixtureSource), MixtureSource().model_dump(mode="json"))]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
