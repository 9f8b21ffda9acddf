"""docs/configuration.md is generated from the config models: it must match them, and the
generator must render every kind of field the models use (nested tables, arrays of tables,
discriminated unions)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, Field

from learner.config.docs import REGENERATE, render, type_name

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_configuration_md_is_up_to_date() -> None:
    assert DOC.read_text() == render(), (
        f"docs/configuration.md is stale: regenerate it with `{REGENERATE}`"
    )


class _Http(BaseModel):
    type: Literal["http"] = "http"
    bucket_mb: int = Field(256, ge=1, description="bucket size")


class _Nccl(BaseModel):
    type: Literal["nccl"]
    port: int = Field(0, description="0 = a free port")


class _Item(BaseModel):
    name: str = Field(description="a name")


class _Inner(BaseModel):
    """An inner table."""

    level: Literal[1, 2] | None = None


class _Rollout(BaseModel):
    sync: Annotated[_Http | _Nccl, Field(discriminator="type")] = Field(
        default_factory=_Http, description="weight transport"
    )
    inner: _Inner = Field(default_factory=_Inner)


class _Top(BaseModel):
    rollout: _Rollout = Field(default_factory=_Rollout)
    items: list[_Item] = Field(default_factory=list)
    extra: _Inner | None = Field(None, description="something optional")


def test_discriminated_union_renders_each_variant_keyed_by_its_type() -> None:
    page = render(_Top, header="# T\n")
    assert "## `[rollout]`" in page
    assert "### `[rollout.sync]`" in page
    assert (
        'Weight transport. One of the tables below, chosen by `type`. Default: `type = "http"`.'
        in page
    )
    assert '#### `[rollout.sync] type = "http"`' in page
    assert '#### `[rollout.sync] type = "nccl"`' in page
    http = page.split('#### `[rollout.sync] type = "http"`')[1].split("####")[0]
    assert "| `bucket_mb` | int (≥ 1) | `256` | bucket size |" in http
    assert "| `type` |" not in http  # the discriminator is the heading, not a row
    nccl = page.split('#### `[rollout.sync] type = "nccl"`')[1]
    assert "| `port` | int | `0` | 0 = a free port |" in nccl
    assert "### `[rollout.inner]`" in page and "An inner table." in page
    assert "| `level` | 1 \\| 2 \\| none | unset |  |" in page
    assert "## `[[items]]`" in page and "| `name` | str | required | a name |" in page
    assert "## `[extra]`\n\nSomething optional. An optional table. An inner table." in page


def test_type_names_read_as_toml() -> None:
    assert type_name(list[str] | str) == "list[str] | str"
    assert type_name(Literal["a", "b"]) == '"a" | "b"'
    assert type_name(tuple[float, float]) == "[float, float]"
    assert type_name(dict[str, int]) == "table[str, int]"
    assert type_name(float | None) == "float | none"
