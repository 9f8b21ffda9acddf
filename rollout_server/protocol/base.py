"""What every wire model of the rollout server shares: strict fields and the error body."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class WireModel(BaseModel):
    """An unknown field is a 422, not silently dropped: a misspelt option must not be ignored."""

    model_config = ConfigDict(extra="forbid")


class ErrorResponse(WireModel):  # the body of every error answer (rollout_server.errors)
    detail: str
