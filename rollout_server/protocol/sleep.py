"""The wire models of ``/sleep``, ``/wake_up`` and ``/is_sleeping``."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rollout_server.protocol.base import WireModel


class SleepRequest(WireModel):
    level: Literal[1, 2] = Field(
        1, description="1: weights to CPU, KV cache dropped; 2: both dropped (re-sync weights)"
    )


class WakeUpRequest(WireModel):
    tags: list[Literal["weights", "kv_cache"]] | None = None


class SleepStatus(WireModel):
    is_sleeping: bool
    level: int = 0
