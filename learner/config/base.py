"""The base of every learner config section: extra keys forbidden, no inf/nan, ``"none"`` unsets
an optional field, and a boolean is never taken for a number (see ``learner.config``)."""

from __future__ import annotations

import typing
from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator


class Section(BaseModel):
    # inf and nan are never meant (an inf timeout or learning rate is a typo, not a setting)
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _none_words(cls, data: Any) -> Any:
        """TOML has no null: ``"none"`` (or ``"null"``) unsets a field that may be unset, such as
        ``grpo.tis_cap = "none"`` or ``--set grpo.tis_cap=none``. Fields that take strings keep
        the word as it is."""
        if not isinstance(data, dict):
            return data
        out = dict(data)
        for name, value in data.items():
            field = cls.model_fields.get(name)
            if (
                field is not None
                and isinstance(value, str)
                and value.strip().lower() in ("none", "null")
                and _unsettable(field.annotation)
            ):
                out[name] = None
        return out

    @model_validator(mode="before")
    @classmethod
    def _no_bool_numbers(cls, data: Any) -> Any:
        """``true`` is not a number: ``run.steps = true`` would otherwise train 1 step."""
        if isinstance(data, dict):
            for name, value in data.items():
                field = cls.model_fields.get(name)
                if field is not None and isinstance(value, bool) and _numeric(field.annotation):
                    raise FieldError(name, f"give a number, not {str(value).lower()}")
        return data


class FieldError(ValueError):
    """A section validator's error about one of its fields (reported as ``section.field``)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field, self.message = field, message


def _numeric(annotation: Any) -> bool:
    """Whether a field takes numbers and no booleans (``int``, ``float``, ``float | None``...)."""
    kinds = set(typing.get_args(annotation)) or {annotation}
    return bool(kinds & {int, float}) and bool not in kinds


def _unsettable(annotation: Any) -> bool:
    """Whether a field of this type may be None and takes no plain string."""
    args = typing.get_args(annotation)
    return type(None) in args and str not in args
