"""The steps' rollouts in flight: generated ahead of training, trained on only while fresh.

With ``rollout.max_staleness`` = s, up to 1 + s steps' generations run on the event-loop thread
while the main thread trains, so the rollout servers never idle. A batch is trained on only if
the weights that produced it are at most s versions older than the learner's. An older one means
a rollout server restarted and serves its base weights (anything else fails the run with
``StalenessError``): the learner then gives the servers its weights again and generates the same
prompts again, so the data order does not change. A generation that failed because a server went
away (killed, restarting) waits for it (``rollout.reconnect_timeout_s``) and does the same.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import time
import zlib
from collections import deque
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from accelerate import Accelerator
from accelerate.utils import gather_object

from learner.config import LearnerConfig
from learner.data.prompts import PromptStream
from learner.run.checkpoint import TrainerState
from learner.servers.connection import ServerConnection
from learner.servers.pool import server_went_away
from learner.step.rollouts import (
    StepRollouts,
    check_episodes,
    collect,
    collect_episodes,
    request_seed,
)
from learner.step.update import max_over_ranks
from rewards.chat import ChatFormat
from rewards.env import Environment
from rewards.scoring import RewardRunner
from rollout_server.client import RolloutClient

logger = logging.getLogger(__name__)


class StalenessError(RuntimeError):
    pass


# A staleness no version gap reaches: a rank's generation failed because a server went away.
SERVER_LOST = 2**62


def rows_fingerprint(rows: list[dict[str, Any]]) -> int:
    """A stable 31-bit hash of a step's prompts, logged so runs can prove the same data order."""
    return zlib.crc32(json.dumps(rows, sort_keys=True).encode()) & 0x7FFFFFFF


@dataclass
class RankRollouts:
    """How this rank generates and scores its share of a step's prompts: episodes of the
    ``[environment]``, or completions scored by the ``[[rewards]]``."""

    cfg: LearnerConfig
    client: RolloutClient
    rank: int
    per_rank: int  # prompts per rank and step
    tokenizer: Any
    scorer: RewardRunner | None  # [data]
    env_cls: type[Environment] | None  # [environment]
    chat: ChatFormat | None  # with env_cls

    def collect(
        self, rows: list[dict[str, Any]], kind: str, step: int
    ) -> Coroutine[Any, Any, StepRollouts]:
        """Generate and score this rank's share of ``rows`` for ``step``."""
        mine = rows[self.rank * self.per_rank : (self.rank + 1) * self.per_rank]
        seed = request_seed(self.cfg, kind, step, self.rank)
        if self.env_cls is not None:
            return collect_episodes(self.cfg, self.client, self.env_cls, self.chat, mine, seed)
        assert self.scorer is not None
        return collect(
            self.cfg, self.client, self.scorer, mine, tokenizer=self.tokenizer, seed=seed
        )


@dataclass
class Launched:
    """One step's rollouts in flight, with the prompts they were launched for."""

    future: concurrent.futures.Future[StepRollouts]
    fingerprint: int  # rows_fingerprint(rows)
    rows: list[dict[str, Any]]


@dataclass
class Arrived:
    """One step's rollouts, fresh enough to train on."""

    rollouts: StepRollouts
    fingerprint: int
    staleness: int  # the most over the ranks
    wait_s: float  # the time the learner waited for them


class InFlightRollouts:
    """The queue of steps launched ahead of training (``rollout.max_staleness``) and the data
    stream's count of the rows they hold (a checkpoint must not skip them)."""

    def __init__(
        self,
        cfg: LearnerConfig,
        accelerator: Accelerator,
        servers: ServerConnection,
        rank_rollouts: RankRollouts,
        stream: PromptStream,
        state: TrainerState,
    ) -> None:
        self.cfg = cfg
        self.accelerator = accelerator
        self.servers = servers
        self.rank_rollouts = rank_rollouts
        self.stream = stream
        self.state = state
        self.pending: deque[Launched] = deque()
        self._warned_ahead = False

    def launch(self, rows: list[dict[str, Any]] | None = None) -> None:
        """Start generating the next step's rollouts (of ``rows``: prompts that go again)."""
        if rows is None:
            rows = self.stream.take(self.cfg.grpo.prompts_per_step)
        # the step these rows train, also when a restarted server makes them go again
        coro = self.rank_rollouts.collect(rows, "train", self.state.step + len(self.pending) + 1)
        self.pending.append(Launched(self.servers.loop.submit(coro), rows_fingerprint(rows), rows))
        self._count_pending()

    def next(self) -> Arrived | None:
        """The next step's rollouts, launching up to 1 + ``max_staleness`` steps ahead first.
        None when they were too stale because a server restarted: the weights went to the
        servers again and every step in flight is generating again (try the step again)."""
        ahead = 1 + self.cfg.rollout.max_staleness
        while (
            len(self.pending) < ahead and self.state.step + len(self.pending) < self.cfg.run.steps
        ):
            self.launch()
        launched = self.pending.popleft()
        t0 = time.perf_counter()
        step_rollouts, lost = None, None
        try:
            step_rollouts = launched.future.result()
        except Exception as e:  # an episode's generation wraps the client's error
            if not (self.cfg.rollout.external and server_went_away(e)):
                raise  # a dead embedded server does not come back: its own error says why
            lost = e
        wait_s = time.perf_counter() - t0
        self._count_pending()
        staleness = self._staleness(step_rollouts)
        if staleness == SERVER_LOST:
            self._regenerate(launched, lambda: self.servers.reconnect(lost))
            return None
        assert step_rollouts is not None  # else SERVER_LOST
        if staleness > self.cfg.rollout.max_staleness:
            if not self.servers.server_restarted():
                raise StalenessError(
                    f"samples {staleness} versions old, bound {self.cfg.rollout.max_staleness}"
                )
            self._regenerate(launched, self.servers.resync)
            return None
        if self.rank_rollouts.env_cls is not None:  # all ranks stop, or none: gathered
            world = self.accelerator.num_processes
            check_episodes(self.cfg, step_rollouts, gather_object if world > 1 else None)
        return Arrived(step_rollouts, launched.fingerprint, staleness, wait_s)

    def refill_round(self, k: int, short: bool) -> StepRollouts | None:
        """Dynamic sampling's round ``k`` for the step in training (``fill_step``): every rank
        takes the round's rows; a ``short`` one generates them."""
        rows = self.stream.take_refill(self.cfg.grpo.prompts_per_step)  # on every rank
        if not short:
            return None
        coro = self.rank_rollouts.collect(rows, f"refill{k}", self.state.step + 1)
        return self.servers.loop.run(coro)

    def cancel(self) -> None:
        """Stop waiting for every step in flight."""
        for launched in self.pending:
            launched.future.cancel()
        self.pending.clear()

    def _count_pending(self) -> None:
        self.stream.pending = len(self.pending) * self.cfg.grpo.prompts_per_step

    def _staleness(self, step_rollouts: StepRollouts | None) -> int:
        """How many versions the samples' weights are behind the learner's, the most over the
        ranks (one branch on every rank); ``SERVER_LOST`` when a rank got none because a
        server went away."""
        if step_rollouts is None:
            return max_over_ranks(self.accelerator, SERVER_LOST)
        version = int(step_rollouts.metrics["weight_version/min"])
        staleness = self.state.weight_version - version
        if staleness < 0 and not self._warned_ahead:
            self._warned_ahead = True
            logger.warning(
                "samples from weight version %d, newer than this learner's %d: is another "
                "learner updating these rollout servers? Give each learner its own.",
                version,
                self.state.weight_version,
            )
        return max_over_ranks(self.accelerator, staleness)  # one branch on every rank

    def _regenerate(self, launched: Launched, restore: Callable[[], None]) -> None:
        """A server restarted (it serves its base weights) or went away: ``restore`` the
        servers (wait for them, sync this learner's weights again), then generate every step
        in flight again on the same prompts, so the data order does not change."""
        redo = [launched.rows, *(p.rows for p in self.pending)]
        self.cancel()
        restore()
        for rows in redo:
            self.launch(rows)
