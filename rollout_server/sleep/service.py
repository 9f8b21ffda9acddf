"""Sleep and wake-up: the engine offloads (level 1) or discards (level 2) its weights once the
generations in flight finish, and generation answers 503 until it is awake again."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rollout_server.core import ServerCore
    from rollout_server.protocol import SleepStatus
    from rollout_server.weights.prepared import PreparedUpdates


class SleepService:
    def __init__(self, core: ServerCore, prepared: PreparedUpdates) -> None:
        self.core = core
        # a prepared NCCL update's receives hold the staging buffers: no sleep meanwhile
        self.prepared = prepared

    async def sleep(self, level: int) -> SleepStatus:
        core = self.core
        core.require_loaded()
        self.prepared.refuse("sleep")
        async with core.gate.write():  # in-flight generations finish first
            self.prepared.refuse("sleep")
            await core.engine.sleep(level)
            core.sleep_level = max(core.sleep_level, level)
            core.asleep = {"weights", "kv_cache"}
            if level == 2:
                core.missing_weights = core.engine.required_weights()
            core.metrics.sleep_level.set(core.sleep_level)
        return core.sleep_status()

    async def wake_up(self, tags: list[str] | None) -> SleepStatus:
        core = self.core
        core.require_loaded()
        self.prepared.refuse("wake_up")
        async with core.gate.write():
            await core.engine.wake_up(tags)
            core.asleep -= set(tags or ["weights", "kv_cache"])
            if not core.asleep:
                core.sleep_level = 0
            core.metrics.sleep_level.set(core.sleep_level)
        return core.sleep_status()
