"""The state every feature of the server shares, held by one ``ServerCore`` that each feature's
service is given (generation, weights, sleep, status).

It owns what must stay consistent across endpoints: the weight version, whether the engine is
loaded, asleep, or holding weights discarded by a level-2 sleep, and the pause gate that keeps
weight loads and generations apart. Engines stay stateless about all of this.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Literal

from rollout_server.errors import Conflict, Unavailable
from rollout_server.gate import PauseGate
from rollout_server.protocol import SleepStatus

if TYPE_CHECKING:
    from rollout_server.engine.base import Engine
    from rollout_server.metrics import Metrics
    from rollout_server.settings import ServerSettings

log = logging.getLogger(__name__)


class ServerCore:
    def __init__(self, settings: ServerSettings, engine: Engine, metrics: Metrics) -> None:
        self.settings = settings
        self.limits = settings.limits
        self.engine = engine
        self.metrics = metrics
        self.gate = PauseGate()
        self.version = 0
        self.state: Literal["loading", "ready", "failed", "closed"] = "loading"
        self.load_error: str | None = None
        self.sleep_level = 0
        self.asleep: set[str] = set()  # "weights", "kv_cache"
        # tensors not loaded since sleep level 2 discarded the weights (generation waits for all)
        self.missing_weights: set[str] = set()
        # why generation cannot succeed with the weights loaded (their probe failed and the
        # engine had no copy to go back to); cleared by an update whose probe passes
        self.unservable: str | None = None
        self._froze_heap = False
        metrics.waiting.set_function(lambda: self.gate.waiting)
        metrics.in_flight.set_function(lambda: self.gate.readers)
        metrics.weight_version.set(0)

    # --- lifecycle -------------------------------------------------------------------------

    async def start(self, on_failure: Callable[[BaseException], None] | None = None) -> None:
        try:
            await self.engine.start()
        except Exception as exc:
            self.state, self.load_error = "failed", f"{type(exc).__name__}: {exc}"
            log.exception("the engine failed to start")
            if on_failure is not None:
                on_failure(exc)
            return
        if self.settings.gc_freeze:
            # Loading and vLLM's start leave ~10^5-10^6 long-lived objects (705k on a GPU); full
            # collections would walk them all while serving (vLLM's own server does the same).
            gc.collect()
            gc.freeze()
            self._froze_heap = True
            log.info("%d startup objects kept out of the garbage collector", gc.get_freeze_count())
        self.state = "ready"
        log.info("engine %s ready: %s", self.engine.name, self.settings.name)

    async def close(self) -> None:
        """Close the engine (a prepared weight update was dropped first: ``build_app``)."""
        if self.state == "ready":
            await self.engine.close()
        self.state = "closed"
        if self._froze_heap:  # let what the engine held be collected
            gc.unfreeze()
            self._froze_heap = False

    # --- what a request needs --------------------------------------------------------------

    def require_loaded(self) -> None:
        if self.state == "loading":
            raise Unavailable("the model is still loading; retry when GET /ready answers 200")
        if self.state != "ready":
            raise Unavailable(f"the engine is not running ({self.load_error or self.state})")

    def require_ready(self) -> None:
        """Loaded, awake, and holding real weights that generate: what generation needs."""
        self.require_loaded()
        if self.asleep or self.engine.is_sleeping():
            raise Unavailable(
                f"the server is asleep (level {self.sleep_level}); POST /wake_up first",
                retry_after_s=30,
            )
        if self.unservable is not None:
            raise Unavailable(
                f"the served weights cannot generate: {self.unservable}; load other weights",
                retry_after_s=30,
            )
        if self.missing_weights:
            missing = sorted(self.missing_weights)
            listed = ", ".join(repr(n) for n in missing[:5])
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise Unavailable(
                f"weights were discarded by sleep level 2 and {len(missing)} of "
                f"{len(self.engine.required_weights())} tensors have not been loaded since "
                f"({listed}{more}); sync the full weights first (POST /weights/update, "
                "/weights/load_file or an NCCL update)",
                retry_after_s=30,
            )

    def servable_after(self, loaded: Iterable[str]) -> bool:
        """Whether generation could run once ``loaded`` is in: awake, nothing else missing (a
        version that passes is then probed before it is served)."""
        awake = not self.asleep and not self.engine.is_sleeping()
        return awake and not (self.missing_weights - set(loaded))

    def require_weights_awake(self) -> None:
        """What loading or reading the weights needs."""
        self.require_loaded()
        if "weights" in self.asleep:
            raise Conflict(
                "the weights are asleep; POST /wake_up (or /wake_up with tags ['weights']) "
                "before updating or reading them"
            )

    def sleep_status(self) -> SleepStatus:
        return SleepStatus(is_sleeping=bool(self.asleep), level=self.sleep_level)

    def set_version(self, version: int, loaded: Iterable[str]) -> None:
        """A whole update loaded: its tensors are no longer missing after a level-2 sleep."""
        self.version = version
        self.missing_weights.difference_update(loaded)
        self.metrics.weight_version.set(version)
