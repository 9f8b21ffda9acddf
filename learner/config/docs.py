"""Render the learner's config reference, docs/configuration.md, from its pydantic models.

    python -m learner.config.docs > docs/configuration.md

The models in ``learner.config`` are the one source of every field, type, default and
description; the page is generated so that it cannot drift from them (a test compares the two).
The walk is generic over pydantic models: a field whose type is a model becomes a TOML table, a
list of models an array of tables, and a discriminated union one table per variant, keyed by its
discriminator (``[rollout.sync] type = "nccl"``).
"""

from __future__ import annotations

import enum
import types
import typing
from collections.abc import Iterator
from typing import Any, Literal

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from learner.config import LearnerConfig

REGENERATE = "python -m learner.config.docs > docs/configuration.md"

HEADER = f"""# Learner configuration

<!-- Generated from learner/config/ by `{REGENERATE}`: edit the models, not this page. -->

A learner config is a TOML file validated by the pydantic models in `learner/config/__init__.py`. A file
says only what differs from the defaults below; an unknown key is an error that names the field
and suggests the one meant (`optim.lrr` → `lr`; `lr` at the top → `optim.lr`), so a typo never
falls back to a default silently. `--set section.field=value` overrides one field from the
command line (the value in TOML syntax; a bare word is a string). A list's strings need double
quotes, which the shell keeps only inside single quotes around the whole:

```bash
python -m learner --config my.toml --set optim.lr=1e-6 --set 'rollout.servers=["http://127.0.0.1:8000"]'
```

TOML has no null: `"none"` unsets a field that may be unset (`grpo.tis_cap = "none"`). Relative
data paths (`data.path`, `sft.data`, `eval.data`) are read next to the config file. A config
needs either `[data]` and at least one `[[rewards]]`, or an `[environment]`; `[sft]` alone makes
an SFT-only config (`python -m learner sft`). What the switches do together, and which to reach
for on a GPU, is in [options.md](options.md).
"""


def _strip_optional(annotation: Any) -> tuple[Any, bool]:
    """The annotation without ``None``, and whether ``None`` was one of its members."""
    args = typing.get_args(annotation)
    if _is_union(annotation) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return (rest[0] if len(rest) == 1 else typing.Union[tuple(rest)]), True  # noqa: UP007
    return annotation, False


def _is_union(annotation: Any) -> bool:
    return typing.get_origin(annotation) in (typing.Union, types.UnionType)


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _union_models(annotation: Any) -> list[type[BaseModel]]:
    """The variants of a union of models (empty if any member is not a model)."""
    if not _is_union(annotation):
        return []
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    return list(args) if args and all(_is_model(a) for a in args) else []


def type_name(annotation: Any) -> str:
    """A field's type as a reader of the TOML file sees it: ``int``, ``"a" | "b"``, ``list[str]``."""
    if annotation is type(None):
        return "none"
    if typing.get_origin(annotation) is Literal:
        return " | ".join(_toml(v) for v in typing.get_args(annotation))
    if typing.get_origin(annotation) is typing.Annotated:
        return type_name(typing.get_args(annotation)[0])
    if _is_union(annotation):
        return " | ".join(type_name(a) for a in typing.get_args(annotation))
    if _is_model(annotation):
        return "table"
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return " | ".join(_toml(m.value) for m in annotation)
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is not None:
        name = {list: "list", tuple: "list", dict: "table", set: "list"}.get(origin, str(origin))
        if origin is tuple and args:
            return f"[{', '.join(type_name(a) for a in args if a is not Ellipsis)}]"
        return f"{name}[{', '.join(type_name(a) for a in args)}]" if args else name
    return getattr(annotation, "__name__", str(annotation))


_BOUNDS = (
    (annotated_types.Ge, "ge", "≥"),
    (annotated_types.Gt, "gt", ">"),
    (annotated_types.Le, "le", "≤"),
    (annotated_types.Lt, "lt", "<"),
)


def bounds(field: FieldInfo) -> str:
    """The field's numeric bounds (``ge``, ``gt``, ``le``, ``lt``), e.g. ``≥ 1, < 1``."""
    out = []
    for meta in field.metadata:
        for kind, attr, sign in _BOUNDS:
            if isinstance(meta, kind):
                out.append(f"{sign} {getattr(meta, attr)}")
    return ", ".join(out)


def _toml(value: Any) -> str:
    """A value in TOML syntax (``None``, which TOML cannot write, as ``unset``)."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, enum.Enum):
        return _toml(value.value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list | tuple | set):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + "}"
    if isinstance(value, BaseModel):
        return "(table)"
    return repr(value)


def _default_value(field: FieldInfo) -> Any:
    """The field's default value (``PydanticUndefined`` for a required field)."""
    if field.default_factory is not None:
        return field.default_factory()  # type: ignore[call-arg]
    return field.default


def default(field: FieldInfo) -> str:
    """The field's default in TOML syntax, ``unset`` for None, or ``required``."""
    value = _default_value(field)
    if value is PydanticUndefined:
        return "required"
    if value is None:
        return "unset"
    return "(table)" if isinstance(value, BaseModel) else f"`{_toml(value)}`"


def _cell(text: str) -> str:
    """Text fit for one cell of a Markdown table."""
    return " ".join(text.split()).replace("|", "\\|")


def _doc(model: type[BaseModel]) -> str:
    """The model's own docstring (not one inherited from a base), as one paragraph."""
    doc = model.__dict__.get("__doc__") or ""
    return " ".join(doc.split())


def _literal_value(model: type[BaseModel], key: str) -> str:
    """The discriminator value of one variant of a discriminated union (its ``Literal``)."""
    ann = model.model_fields[key].annotation
    values = typing.get_args(ann) if typing.get_origin(ann) is Literal else ()
    return " | ".join(_toml(v) for v in values) or "?"


def _discriminator(field: FieldInfo) -> str | None:
    disc = field.discriminator
    if isinstance(disc, str):
        return disc
    return getattr(disc, "discriminator", None) if disc is not None else None


class Section(typing.NamedTuple):
    """One TOML table of the config: its dotted path, its model, and how it is written."""

    path: str
    model: type[BaseModel] | None  # None: the heading of a union, whose variants follow
    note: str  # the parent field's description, and how the table is written
    heading: str  # "[path]", "[[path]]" or '[path] type = "x"'
    depth: int  # heading level below the page title
    skip: frozenset[str] = frozenset()  # fields not listed (a variant's discriminator)


def _sentence(text: str) -> str:
    text = " ".join(text.split())
    if not text:
        return ""
    text = text[0].upper() + text[1:]
    return text if text.endswith(".") else text + "."


def sections(model: type[BaseModel], prefix: str = "", depth: int = 2) -> Iterator[Section]:
    """The tables under ``model``, depth first, in the models' field order."""
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        inner, optional = _strip_optional(field.annotation)
        note = _sentence(field.description or "")
        if optional:
            note = f"{note} An optional table.".strip()
        if _is_model(inner):
            yield Section(path, inner, note, f"[{path}]", depth)
            yield from sections(inner, f"{path}.", depth + 1)
        elif typing.get_origin(inner) is list and _is_model(typing.get_args(inner)[0]):
            item = typing.get_args(inner)[0]
            note = f"{note} An array of tables: one `[[{path}]]` each.".strip()
            yield Section(path, item, note, f"[[{path}]]", depth)
            yield from sections(item, f"{path}.", depth + 1)
        elif variants := _union_models(inner):
            key = _discriminator(field)
            choice = f"One of the tables below, chosen by `{key}`." if key else "One of the below."
            if key and isinstance(made := _default_value(field), BaseModel):
                choice += f" Default: `{key} = {_toml(getattr(made, key))}`."
            yield Section(path, None, f"{note} {choice}".strip(), f"[{path}]", depth)
            for variant in variants:
                value = _literal_value(variant, key) if key else variant.__name__
                heading = f"[{path}] {key} = {value}" if key else f"[{path}] ({value})"
                skip = frozenset({key}) if key else frozenset()
                yield Section(path, variant, "", heading, depth + 1, skip)
                yield from sections(variant, f"{path}.", depth + 2)


def _is_table(field: FieldInfo) -> bool:
    inner, _ = _strip_optional(field.annotation)
    if _is_model(inner) or _union_models(inner):
        return True
    return typing.get_origin(inner) is list and _is_model(typing.get_args(inner)[0])


def field_rows(model: type[BaseModel], skip: frozenset[str] = frozenset()) -> list[str]:
    """The Markdown table of a model's plain fields (nested tables get their own section)."""
    rows = ["| field | type | default | description |", "|---|---|---|---|"]
    for name, field in model.model_fields.items():
        if name in skip or _is_table(field):
            continue
        kind = type_name(field.annotation)
        if b := bounds(field):
            kind = f"{kind} ({b})"
        rows.append(
            f"| `{name}` | {_cell(kind)} | {_cell(default(field))} | "
            f"{_cell(field.description or '')} |"
        )
    return rows if len(rows) > 2 else []


def render(model: type[BaseModel] = LearnerConfig, header: str = HEADER) -> str:
    """The whole page: the header, then one part per table in the models' field order."""
    blocks = [header.strip("\n")]
    if top := field_rows(model):
        blocks += ["## Top level", "\n".join(top)]
    for sec in sections(model):
        blocks.append(f"{'#' * min(sec.depth, 6)} `{sec.heading}`")
        doc = _sentence(_doc(sec.model)) if sec.model is not None else ""
        if text := " ".join(t for t in (sec.note, doc) if t):
            blocks.append(text)
        if sec.model is not None:
            rows = field_rows(sec.model, sec.skip)
            blocks.append("\n".join(rows) if rows else "No fields of its own: its tables follow.")
    return "\n\n".join(blocks) + "\n"


def main() -> None:
    print(render(), end="")


if __name__ == "__main__":
    main()
