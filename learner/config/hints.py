"""What a config error suggests: the field a misspelt one was meant to be (``optim.lrr`` →
``lr``), the section a field belongs to (``--set lr=1e-3`` → ``optim.lr``), and the quoting
of a list in ``--set`` that the shell stripped (``[a,b]`` → ``'["a", "b"]'``)."""

from __future__ import annotations

import difflib
import tomllib
import types
import typing
from collections.abc import Iterator
from typing import Any

from pydantic import BaseModel

DOCS = "docs/configuration.md"


def _models(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models a field's annotation holds (``X | None``, ``list[X]``, unions)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType, list, tuple, dict):
        return [m for arg in typing.get_args(annotation) for m in _models(arg)]
    if typing.get_origin(annotation) is typing.Annotated:
        return _models(typing.get_args(annotation)[0])
    return []


def section_at(root: type[BaseModel], path: tuple[str | int, ...]) -> type[BaseModel] | None:
    """The config section at ``path`` (``("rollout", "sync")``; list indices skipped), or None
    where the path leads to no section, or to one of several (a tagged union)."""
    model = root
    for part in path:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part)
        found = _models(field.annotation) if field is not None else []
        if len(found) != 1:
            return None
        model = found[0]
    return model


def _all_fields(
    model: type[BaseModel], prefix: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], str]]:
    """Every (section path, field name) under ``model``, sections included as fields."""
    for name, field in model.model_fields.items():
        yield prefix, name
        for sub in _models(field.annotation):
            yield from _all_fields(sub, (*prefix, name))


def unknown_field_hint(root: type[BaseModel], loc: tuple[str | int, ...]) -> str:
    """A suggestion for the unknown field at ``loc``: the same name in another section first,
    else a close name in its own section, else a close name elsewhere; "" when none is close."""
    *parents, name = loc
    if not isinstance(name, str):
        return ""
    where = tuple(p for p in parents if isinstance(p, str))
    everywhere = [(path, f) for path, f in _all_fields(root) if path != where]
    if same := [".".join((*path, f)) for path, f in everywhere if f == name]:
        shown = " or ".join(f"`{s}`" for s in same[:3])
        return f"did you mean {shown}, the section(s) that have `{name}`?"
    section = section_at(root, tuple(parents))
    if section is not None and (
        close := difflib.get_close_matches(name, list(section.model_fields), n=1)
    ):
        return f"did you mean `{close[0]}`?"
    dotted = {".".join((*path, f)): f for path, f in everywhere}
    if close := difflib.get_close_matches(name, list(dotted.values()), n=1, cutoff=0.75):
        paths = [p for p, f in dotted.items() if f == close[0]][:3]
        return f"did you mean {' or '.join(f'`{p}`' for p in paths)}?"
    return ""


def unparsed_list(key: str, raw: str) -> str | None:
    """For ``--set key=raw`` whose value looks like a TOML list but does not parse as one (the
    shell ate its strings' double quotes): what to write instead. None for anything else."""
    value = raw.strip()
    if not (value.startswith("[") and value.endswith("]")):
        return None
    try:
        tomllib.loads(f"v = {value}")
        return None
    except tomllib.TOMLDecodeError:
        pass
    items = [i.strip() for i in value[1:-1].split(",") if i.strip()]
    quoted = ", ".join(i if _is_toml(i) else f'"{i.strip(chr(34) + chr(39))}"' for i in items)
    return (
        f"override {key}={raw!r}: {value} is not a TOML list (its strings need double quotes, "
        f"which the shell removes unless the whole is in single quotes): write "
        f"--set '{key}=[{quoted}]'"
    )


def _is_toml(item: str) -> bool:
    try:
        tomllib.loads(f"v = {item}")
        return True
    except tomllib.TOMLDecodeError:
        return False
