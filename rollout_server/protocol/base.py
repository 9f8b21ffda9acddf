"""What every wire model of the rollout server shares: strict fields, the error body, the
bounds of versions and counts, and the check that request strings are real Unicode."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

INT64_MAX = 2**63 - 1

Version = Annotated[
    int,
    Field(
        ge=0,
        le=INT64_MAX,
        description="a weight version: a non-negative int64, greater than the served one",
    ),
]
"""A weight version as a client may send it. Bounded so that it fits every consumer (the
metrics gauge, vLLM's and the learner's int64 bookkeeping) and is refused (422) before
anything is applied."""


class WireModel(BaseModel):
    """An unknown field is a 422, not silently dropped: a misspelt option must not be ignored."""

    model_config = ConfigDict(extra="forbid")


class ErrorResponse(WireModel):  # the body of every error answer (rollout_server.errors)
    detail: str


def lone_surrogate(value: object, where: str = "") -> str | None:
    """Where in ``value`` (``prompts[0][1].content``) a string holds a lone surrogate, or None.

    JSON's ``\\ud800`` escape decodes to a lone surrogate, which is no Unicode character: no
    tokenizer can encode it and no answer can echo it as UTF-8. One pass over the request's
    strings (bounded by the body's size) finds it before anything uses it."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            return f"{where or 'a string'} (character {exc.start}: {value[exc.start]!r})"
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            found = lone_surrogate(key, f"a key of {where or 'the body'}") or lone_surrogate(
                item, f"{where}.{key}" if where else str(key)
            )
            if found:
                return found
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            if not isinstance(item, int) and (found := lone_surrogate(item, f"{where}[{i}]")):
                return found
    return None


def refuse_lone_surrogates(value: object) -> None:
    """Raise the ``ValueError`` pydantic turns into a 422 if a string holds a lone surrogate."""
    if found := lone_surrogate(value):
        raise ValueError(
            f"{found} holds a lone surrogate, which is not a Unicode character: send valid "
            "Unicode (a character outside the BMP is a surrogate pair, e.g. \\ud83d\\ude00)"
        )
