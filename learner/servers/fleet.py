"""Which rollout servers are in rotation as the run goes: an elastic fleet.

The servers come from ``rollout.servers`` or from ``rollout.servers_file``, which is read again
after every step. The rotation changes only between steps, decided on the main process:

- a server no longer listed leaves;
- a server the client took out of rotation (unreachable while generating: its share went to
  the others) stays out until it answers again;
- a listed server outside the rotation (new, back, or serving another weight version than the
  learner's: restarted, or it failed its part of a sync) joins once it is ready and has been
  given the learner's weights under the learner's version, never before, so every server in
  rotation serves one version and the staleness bound holds.

The weights go to the joining servers alone where the transport allows (http, file, ipc);
NCCL's group spans the whole rotation, so there every change re-forms it and syncs every server
(``learner.servers.connection``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from learner.config.base import FieldError
from learner.config.rollout import RolloutConfig
from rollout_server.client import RolloutClient
from rollout_server.protocol import InfoResponse

logger = logging.getLogger(__name__)


@dataclass
class FleetPlan:
    """A change of the rotation: who leaves and who joins (after getting the weights)."""

    members: list[str]  # in rotation that stay, in listing order
    join: dict[str, int] = field(default_factory=dict)  # server -> the version it serves
    left: list[str] = field(default_factory=list)

    def stale(self, version: int) -> list[str]:
        """The joining servers that need the weights of ``version`` first."""
        return [s for s, v in self.join.items() if v != version]

    @property
    def changes(self) -> bool:
        return bool(self.join or self.left)


class Fleet:
    """The main process's view of the listed servers and the rotation's history."""

    def __init__(self, rollout: RolloutConfig, client: RolloutClient) -> None:
        self.rollout = rollout
        self.client = client
        self._listed = list(client.servers)
        self._bad_listing: str | None = None
        self.joined_total = 0
        self.left_total = 0

    def listed(self) -> list[str]:
        """The servers configured now (an embedded server: the one started); a
        ``servers_file`` that cannot be read or names none keeps the last good listing (said
        once per distinct error)."""
        if not self.rollout.external:
            return self._listed
        try:
            self._listed = self.rollout.listed()
            self._bad_listing = None
        except FieldError as e:
            if e.message != self._bad_listing:
                logger.warning(
                    "rollout.servers_file: %s; keeping the servers listed before", e.message
                )
                self._bad_listing = e.message
        return self._listed

    async def plan(self, version: int, *, dropped: set[str], check_all: bool = False) -> FleetPlan:
        """The rotation's change for a learner at weight ``version``; ``dropped``: servers a
        rank's client took out of rotation. Asks ``/info`` only of the servers outside the
        rotation, or of all of them with ``check_all`` (after a server went away)."""
        listed = self.listed()
        members = [s for s in self.client.servers if s in listed and s not in dropped]
        left = [s for s in [*self.client.servers, *dropped] if s not in members]
        outside = [s for s in listed if s not in members]
        asked = listed if check_all else outside
        infos = dict(zip(asked, await asyncio.gather(*(self.probe(s) for s in asked)), strict=True))
        for s in [m for m in members if m in infos]:  # check_all: members that restarted
            info = infos[s]
            if info is None or info.weight_version != version:
                members.remove(s)
                left.append(s)
        join: dict[str, int] = {}
        for s in listed:
            info = infos.get(s)
            if s in members or info is None:
                continue
            if info.weight_version > version:
                logger.warning(
                    "rollout server %s serves weight version %d, newer than this learner's %d "
                    "(does another learner update it?): left out of rotation",
                    s, info.weight_version, version,
                )  # fmt: skip
                continue
            join[s] = info.weight_version
        if not members and not join:  # keep serving on what there is: a generation that
            logger.warning(  # fails waits for a listed server (rollout.reconnect_timeout_s)
                "no listed rollout server is ready to take over from %s: keeping the rotation",
                ", ".join(self.client.servers),
            )
            return FleetPlan(list(self.client.servers))
        return FleetPlan(members, join, list(dict.fromkeys(s for s in left if s not in join)))

    async def wait_any(self, timeout_s: float, poll_s: float = 0.5) -> str | None:
        """Wait until a listed server is ready; None once one is, else the listed ones."""
        deadline = time.monotonic() + timeout_s
        while True:
            listed = self.listed()
            ready = await asyncio.gather(*(self.client.is_ready(s) for s in listed))
            if any(ready):
                return None
            if time.monotonic() > deadline:
                return ", ".join(listed)
            await asyncio.sleep(poll_s)

    async def probe(self, server: str) -> InfoResponse | None:
        """``server``'s ``/info`` if it is ready (one attempt each), else None."""
        if not await self.client.is_ready(server):
            return None
        try:
            return await self.client.info_of(server)
        except Exception:  # gone again between the two calls
            return None

    def note(self, plan: FleetPlan, version: int) -> None:
        """Log a change of the rotation and count it."""
        self.joined_total += len(plan.join)
        self.left_total += len(plan.left)
        if plan.left:
            logger.warning("rollout server(s) left the rotation: %s", ", ".join(plan.left))
        if plan.join:
            logger.warning(
                "rollout server(s) joined at weight version %d: %s", version, ", ".join(plan.join)
            )
        logger.info(
            "rollout servers in rotation, all at weight version %d: %s",
            version,
            ", ".join(self.client.servers),
        )
