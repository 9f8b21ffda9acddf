"""The rollout servers as the training loop sees them once they are up: the HTTP client, the
weight syncer and the event loop both run on, and what a train step asks of the servers.

Around each optimizer step the servers are put to sleep (colocated mode: the step takes their
GPU memory), or, when they idle, asked to queue the next weight sync's receives (NCCL); after
it they are woken and given the new weights. Every method that ends in a collective is entered
by every rank; the HTTP calls run on the main process only.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Sized
from dataclasses import dataclass
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import broadcast_object_list, gather_object

from learner.config.rollout import RolloutConfig
from learner.run.checkpoint import TrainerState
from learner.servers.fleet import Fleet, FleetPlan
from learner.servers.pool import (
    EventLoopThread,
    ServersLostError,
    main_decides,
    restarted,
    sync_weights,
)
from learner.sync import make_transport
from learner.sync.base import WeightTransport
from rollout_server.client import RolloutClient, RolloutError

logger = logging.getLogger(__name__)


@dataclass
class ServerConnection:
    """The learner's rollout servers, connected; ``state.weight_version``: what they serve."""

    rollout: RolloutConfig
    accelerator: Accelerator
    loop: EventLoopThread
    client: RolloutClient
    syncer: WeightTransport
    policy: torch.nn.Module
    state: TrainerState
    fleet: Fleet | None = None  # the main process's

    def __post_init__(self) -> None:
        if self.accelerator.is_main_process and not self.per_rank:
            self.fleet = Fleet(self.rollout, self.client)

    @property
    def per_rank(self) -> bool:
        """Every rank has its own embedded server (``rollout.embedded.per_rank``): each rank
        puts its server to sleep, wakes it and syncs it; no fleet (a rank's rotation is its
        one server)."""
        return self.rollout.embedded.per_rank

    @property
    def speaks(self) -> bool:
        """Whether this process asks the servers to sleep and wake."""
        return self.per_rank or self.accelerator.is_main_process

    def sync(self, *, resync: bool = False) -> None:
        """Push the weights (every rank enters)."""
        acc, per_rank = self.accelerator, self.per_rank
        sync_weights(
            acc, self.loop, self.syncer, self.policy, self.state, resync=resync, per_rank=per_rank
        )

    def resync(self) -> None:
        """Give the servers the weights the learner already served (a resumed run, a
        restarted server), under the learner's weight version."""
        self.sync(resync=True)

    def reconnect(self, error: BaseException | None) -> None:
        """Every server in rotation went away while generating (``error``, on the ranks that
        saw it): wait up to ``rollout.reconnect_timeout_s`` for a listed server to be ready,
        then bring the rotation up to date (one that restarted gets the learner's weights
        under the learner's version first). Raises ``ServersLostError`` on every rank when the
        wait runs out."""
        down: list[str | None] = [None]
        if self.accelerator.is_main_process:
            assert self.fleet is not None
            logger.warning(
                "a rollout server went away while generating (%s); waiting up to %.0f s "
                "(rollout.reconnect_timeout_s) for a listed server to be ready",
                error or "on another rank",
                self.rollout.reconnect_timeout_s,
            )
            down[0] = self.loop.run(self.fleet.wait_any(self.rollout.reconnect_timeout_s))
        broadcast_object_list(down, from_process=0)
        if down[0] is not None:
            raise ServersLostError(
                down[0], "rollout.reconnect_timeout_s", self.rollout.reconnect_timeout_s
            )
        self.refresh(check_all=True)

    def refresh(self, *, check_all: bool = False) -> None:
        """Between steps, on every rank: bring the rotation up to date (``learner.servers.
        fleet``): servers that left are out, and ready ones that join serve the learner's
        weights before they get a request. ``check_all``: ask every listed server its version
        (after one went away), not only those outside the rotation."""
        acc = self.accelerator
        if self.per_rank:
            return
        dropped = self.client.dropped
        self.client.dropped = []
        if acc.num_processes > 1:
            dropped = gather_object(dropped)
        plan: list[FleetPlan | None] = [None]
        if acc.is_main_process:
            assert self.fleet is not None
            version = self.state.weight_version
            p = self.loop.run(self.fleet.plan(version, dropped=set(dropped), check_all=check_all))
            plan[0] = p if p.changes else None
        broadcast_object_list(plan, from_process=0)
        if plan[0] is not None:
            self._change(plan[0])

    def _change(self, plan: FleetPlan) -> None:
        """Put ``plan`` into effect on every rank. NCCL's group spans the rotation: it is formed
        again over the new one, and every server synced. Other transports give the weights to
        the joining servers that lack them alone; one that fails to take them stays out."""
        acc = self.accelerator
        rotation = [*plan.members, *plan.join]
        if self.syncer.group_bound:
            self.client.servers = rotation
            self.syncer.close()
            self.resync()
        else:
            failed: list[list[str]] = [self._push_to(plan.stale(self.state.weight_version))]
            broadcast_object_list(failed, from_process=0)
            for s in failed[0]:
                rotation.remove(s)
                del plan.join[s]
            self.client.servers = rotation
        if acc.is_main_process:
            assert self.fleet is not None
            self.fleet.note(plan, self.state.weight_version)

    def _push_to(self, servers: list[str]) -> list[str]:
        """Give ``servers`` the learner's weights under its version (a transport of the run's
        kind for them alone; every rank: the ZeRO-3 gathers); returns the ones that failed."""
        if not servers:
            return []
        hf_model = self.accelerator.unwrap_model(self.policy).model
        with torch.no_grad():
            if not self.accelerator.is_main_process:
                self.syncer.follow(hf_model)
                return []
            sub = self.client.subset(servers)
            transport = make_transport(self.rollout, sub, device=self.accelerator.device)
            try:
                self.loop.run(transport.connect())
                self.loop.run(transport.push(hf_model, self.state.weight_version))
                return []
            except RolloutError as e:
                logger.warning("giving the weights to joining server(s) failed: %s", e)
                return servers
            finally:
                transport.close()
                self.loop.run(sub.aclose())

    def server_restarted(self) -> bool:
        """Whether a server serves an older weight version than the learner synced (decided on
        the main process, or by any rank for its own server; the answer on every rank)."""
        if self.per_rank:
            return any(gather_object([self._restarted()]))
        return main_decides(self.accelerator, self._restarted)

    def _restarted(self) -> bool:
        return restarted(self.loop.run(self.client.info()), self.state.weight_version)

    def may_prepare(self, pending: Sized) -> bool:
        """Prepare the NCCL sync during training only when no rollouts are being generated (a
        prepared update holds the servers' generation paused) and the servers stay awake."""
        r = self.rollout
        return (
            self.accelerator.is_main_process
            and r.sync.prepares
            and not r.sleep_while_training
            and not pending
        )

    def before_training(self, pending: Sized) -> concurrent.futures.Future[Any] | None:
        """Colocated: put the servers to sleep. With no rollouts ``pending`` (the servers idle):
        have them queue the sync's receives now. Returns that preparation, in flight."""
        sleep_level = self.rollout.sleep_while_training
        if sleep_level and self.speaks:
            self.loop.run(self.client.sleep(sleep_level))  # colocated: give the GPU to training
        if self.may_prepare(pending):  # the servers are idle: queue the
            hf_model = self.accelerator.unwrap_model(self.policy).model  # sync's receives now
            return self.loop.submit(self.syncer.prepare(hf_model))
        return None

    def after_training(self, prepared: concurrent.futures.Future[Any] | None) -> None:
        """Wake the servers and push the new weights (``state.weight_version`` moves on)."""
        sleep_level = self.rollout.sleep_while_training
        if sleep_level and torch.cuda.is_available():
            # the step's activations stay cached in torch's allocator (up to the plan's peak,
            # learner.model.plan): hand them back, or the servers sharing this GPU cannot wake
            torch.cuda.empty_cache()
        if sleep_level and self.speaks:
            # weights first, KV cache after the load
            self.loop.run(self.client.wake_up(["weights"]))
        if prepared is not None:
            try:
                prepared.result()
            except Exception:  # the push announces instead
                logger.warning("preparing the weight sync failed", exc_info=True)
        self.sync()
        if sleep_level and self.speaks:
            self.loop.run(self.client.wake_up(["kv_cache"]))
        self.refresh()

    def metrics(self) -> dict[str, float]:
        """The rotation's size and changes so far (on the main process)."""
        if self.fleet is None:
            return {}
        return {
            "fleet/servers": float(len(self.client.servers)),
            "fleet/joined": float(self.fleet.joined_total),
            "fleet/left": float(self.fleet.left_total),
        }

    def close(self) -> None:
        self.syncer.close()
        self.loop.run(self.client.aclose())
