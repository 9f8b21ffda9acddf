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
from accelerate.utils import broadcast_object_list

from learner.config.rollout import RolloutConfig
from learner.run.checkpoint import TrainerState
from learner.servers.pool import EventLoopThread, main_decides, restarted, sync_weights
from learner.sync.base import WeightTransport
from rollout_server.client import RolloutClient, RolloutUnavailableError

logger = logging.getLogger(__name__)

#: The learner's exit code when its rollout servers stayed away (``EX_TEMPFAIL``: start them
#: again and ``--resume``).
SERVERS_LOST_EXIT = 75


class ServersLostError(RuntimeError):
    """A rollout server went away during the run and did not come back in time."""

    def __init__(self, servers: str, timeout_s: float) -> None:
        super().__init__(
            f"the rollout server {servers} went away during the run and was not ready again "
            f"within rollout.reconnect_timeout_s = {timeout_s:g} s: start it again, then run "
            "the same command with --resume to continue from the last checkpoint (or raise "
            "rollout.reconnect_timeout_s)"
        )
        self.servers = servers


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

    def resync(self) -> None:
        """Give the servers the weights the learner already served (a resumed run, a
        restarted server), under the learner's weight version."""
        sync_weights(self.accelerator, self.loop, self.syncer, self.policy, self.state, resync=True)

    def reconnect(self, error: BaseException | None) -> None:
        """A server went away while generating (``error``, on the ranks that saw it): wait up
        to ``rollout.reconnect_timeout_s`` for every server to be ready again, then, if one
        restarted, give it the learner's weights under the learner's version. Raises
        ``ServersLostError`` on every rank when the wait runs out."""
        down: list[str | None] = [None]
        if self.accelerator.is_main_process:
            down[0] = self._wait_back(error)
        broadcast_object_list(down, from_process=0)
        if down[0] is not None:
            raise ServersLostError(down[0], self.rollout.reconnect_timeout_s)
        if self.server_restarted():
            self.resync()

    def _wait_back(self, error: BaseException | None) -> str | None:
        """Wait for the servers; None once all are ready, else the ones that are not."""
        timeout = self.rollout.reconnect_timeout_s
        logger.warning(
            "a rollout server went away while generating (%s); waiting up to %.0f s "
            "(rollout.reconnect_timeout_s) for %s to be ready again",
            error or "on another rank",
            timeout,
            ", ".join(self.client.servers),
        )
        try:
            self.loop.run(self.client.wait_ready(timeout))
        except RolloutUnavailableError as e:
            return e.server
        return None

    def server_restarted(self) -> bool:
        """Whether a server serves an older weight version than the learner synced (decided on
        the main process, the answer on every rank)."""
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
        if sleep_level and self.accelerator.is_main_process:
            self.loop.run(self.client.sleep(sleep_level))  # colocated: give the GPU to training
        if self.may_prepare(pending):  # the servers are idle: queue the
            hf_model = self.accelerator.unwrap_model(self.policy).model  # sync's receives now
            return self.loop.submit(self.syncer.prepare(hf_model))
        return None

    def after_training(self, prepared: concurrent.futures.Future[Any] | None) -> None:
        """Wake the servers and push the new weights (``state.weight_version`` moves on)."""
        sleep_level = self.rollout.sleep_while_training
        if sleep_level and self.accelerator.is_main_process:
            # weights first, KV cache after the load
            self.loop.run(self.client.wake_up(["weights"]))
        if prepared is not None:
            try:
                prepared.result()
            except Exception:  # the push announces instead
                logger.warning("preparing the weight sync failed", exc_info=True)
        sync_weights(self.accelerator, self.loop, self.syncer, self.policy, self.state)
        if sleep_level and self.accelerator.is_main_process:
            self.loop.run(self.client.wake_up(["kv_cache"]))

    def close(self) -> None:
        self.syncer.close()
        self.loop.run(self.client.aclose())
