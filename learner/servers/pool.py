"""The learner's side of the rollout servers: the event loop its HTTP work runs on, the servers
themselves (embedded or configured), their limits, and the weight sync with its retries.

Every function that ends in a collective (`main_decides`, `sync_weights`) is entered by every
rank; the HTTP calls run on the main process only.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import torch
from accelerate import Accelerator
from accelerate.utils import broadcast_object_list, gather_object

from learner.config import LearnerConfig, SamplingConfig
from learner.config.rollout import RolloutConfig
from learner.run.checkpoint import TrainerState
from learner.run.runtime import SetupError
from learner.servers.embedded import embedded_for, embedded_key, free_ports, record_served
from learner.servers.listening import ListenWatch
from learner.sync.base import WeightTransport
from rollout_server.client import (
    RolloutAuthError,
    RolloutClient,
    RolloutError,
    RolloutHTTPError,
    RolloutUnavailableError,
)
from rollout_server.protocol import InfoResponse

logger = logging.getLogger(__name__)
T = TypeVar("T")

#: The learner's exit code when its rollout servers stayed away (``EX_TEMPFAIL``: start them
#: again and ``--resume``).
SERVERS_LOST_EXIT = 75


class ServersLostError(RuntimeError):
    """A rollout server went away during the run and did not come back in time."""

    def __init__(self, servers: str, setting: str, timeout_s: float) -> None:
        super().__init__(
            f"the rollout server {servers} went away during the run and was not ready again "
            f"within {setting} = {timeout_s:g} s: start it again, then run the same command "
            f"with --resume to continue from the last checkpoint (or raise {setting})"
        )
        self.servers = servers


class EventLoopThread:
    """A private asyncio loop in a daemon thread: the sync training code submits HTTP work to it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.submit(coro).result()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)


@contextlib.contextmanager
def servers(
    cfg: LearnerConfig, model: str, run_dir: Path, acc: Accelerator
) -> Iterator[tuple[list[str], str | None]]:
    """The rollout servers' URLs and the API key they take: ``rollout.servers`` (or
    ``servers_file``'s) and the configured key, or an embedded server's, with a fresh random
    key (every rank's clients get both). With ``rollout.embedded.per_rank`` every rank starts
    its own on its own device, and gets its URL alone. A run that ends without an error
    records what an embedded server serves before the server stops (``served_record``)."""
    if cfg.rollout.external:
        yield cfg.rollout.listed(), cfg.rollout.key()
        return
    if cfg.rollout.embedded.per_rank:
        with own_server(cfg, model, run_dir, acc) as url_key:
            yield url_key
        return
    url_key: list[Any] = [None, embedded_key()]
    with contextlib.ExitStack() as stack:
        if acc.is_main_process:
            log_path = run_dir / "rollout_server.log"
            url_key[0] = stack.enter_context(
                embedded_for(cfg, model, log_path=log_path, api_key=url_key[1])
            )
        broadcast_object_list(url_key, from_process=0)
        yield [url_key[0]], url_key[1]
        acc.wait_for_everyone()  # nobody may still be generating when the server stops
        if acc.is_main_process:
            record_served(url_key[0], url_key[1], served_record(run_dir, 0), 0)


@contextlib.contextmanager
def own_server(
    cfg: LearnerConfig, model: str, run_dir: Path, acc: Accelerator
) -> Iterator[tuple[list[str], str]]:
    """This rank's embedded server (``rollout.embedded.per_rank``): on this rank's device, on
    a port the main process picked distinct from the other ranks', logging to
    ``rollout_server.rank{k}.log``; its URL alone and its own key. A run that ends without an
    error records what the server serves before it is stopped (``served_record``)."""
    ports: list[Any] = [free_ports(acc.num_processes) if acc.is_main_process else None]
    broadcast_object_list(ports, from_process=0)
    key, rank = embedded_key(), acc.process_index
    log_path = run_dir / f"rollout_server.rank{rank}.log"
    port = ports[0][rank]
    with embedded_for(cfg, model, log_path, api_key=key, port=port, device=acc.device) as url:
        yield [url], key
        record_served(url, key, served_record(run_dir, rank), rank)


def served_record(run_dir: Path, rank: int) -> Path:
    """Where rank ``rank`` writes what its embedded server served as the run ended
    (``learner.servers.embedded.record_served``)."""
    return run_dir / f"served_checksum.rank{rank}.json"


async def servers_ready(client: RolloutClient, rollout: RolloutConfig) -> None:
    """Wait for the servers to be ready; one that never is, or that refuses the API key, is a
    ``SetupError`` naming the setting. Configured servers (not the embedded one, which binds
    its port once its model loaded) are watched meanwhile: an address where nothing listens is
    said plainly at once and every 30 s (``learner.servers.listening``)."""
    listen = ListenWatch(lambda: client.servers, rollout.ready_timeout_s)
    watch = asyncio.create_task(listen.watch()) if rollout.external else None
    try:
        await _wait_ready(client, rollout, listen)
    finally:
        if watch is not None:
            watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watch


async def _wait_ready(client: RolloutClient, rollout: RolloutConfig, listen: ListenWatch) -> None:
    try:
        await client.wait_ready(rollout.ready_timeout_s)
    except RolloutAuthError as e:
        raise SetupError(
            f"the rollout server {e.server} refused the API key (HTTP {e.status}): give the "
            "learner the server's key as rollout.api_key_file, the ROLLOUT_API_KEY environment "
            f"variable or rollout.api_key ({'one is' if rollout.key() else 'none is'} set)"
        ) from None
    except RolloutUnavailableError as e:
        if nothing := [m for u in client.servers if (m := listen.nothing_listens(u))]:
            raise SetupError(
                f"rollout.servers: {e.server} not ready after {rollout.ready_timeout_s:g} s "
                f"(rollout.ready_timeout_s): {'; '.join(nothing)}"
            ) from None
        raise SetupError(
            f"rollout.servers: {e.server} {e.reason} (rollout.ready_timeout_s = "
            f"{rollout.ready_timeout_s:g})"
        ) from None
    except RolloutHTTPError as e:  # no readiness route: another kind of server
        other = ("a rollout server of ours? set rollout.server_api = \"rollout-server\""
                 if rollout.server_api == "vllm" else
                 'a stock vllm serve? set rollout.server_api = "vllm" and [rollout.sync] '
                 'type = "vllm" (docs/vllm-serve.md)')  # fmt: skip
        raise SetupError(
            f"rollout.servers: {e.server} is not the server rollout.server_api = "
            f'"{rollout.server_api}" expects (its readiness route answered HTTP {e.status}); '
            f"is it {other}"
        ) from None


def check_server_limits(s: SamplingConfig, infos: list[InfoResponse], urls: list[str]) -> None:
    """Refuse, before any step, a config that asks more of a server than its limits allow
    (the server would refuse every generate request)."""
    asks = [
        ("sampling.num_generations", s.num_generations, "max_n", "--max-n"),
        ("sampling.max_tokens", s.max_tokens, "max_tokens", "--max-tokens"),
    ]
    for i, info in enumerate(infos):
        for setting, value, limit_name, flag in asks:
            limit = getattr(info.limits, limit_name)
            if value > limit:
                where = f"the rollout server {urls[i]}" if urls else "the embedded rollout server"
                raise SetupError(
                    f"{setting} = {value} is over {where}'s limit {limit_name} = {limit}: lower "
                    f"it, or start the server with {flag} {value}"
                    + ("" if urls else " (rollout.embedded.extra_args)")
                )


def main_decides(accelerator: Accelerator, decide: Callable[[], bool]) -> bool:
    """``decide()`` on the main process, its answer on every rank: the collective weight sync
    that may follow must be entered by all ranks or by none."""
    flag = [decide() if accelerator.is_main_process else False]
    broadcast_object_list(flag, from_process=0)
    return bool(flag[0])


def updated_by_another(infos: list[InfoResponse]) -> bool:
    """Whether external rollout servers serve other weights than the ones they loaded (a weight
    version above 0: an earlier or another learner updated them). A fresh run then syncs its own
    weights before the first generation instead of training on another run's samples."""
    versions = [info.weight_version for info in infos]
    if any(versions):
        logger.warning(
            "the rollout servers serve weight versions %s, not the weights they loaded: "
            "syncing this learner's weights before the first generation",
            versions,
        )
    return any(versions)


def restarted(infos: list[InfoResponse], version: int) -> bool:
    """Whether a rollout server serves an older weight version than the learner last synced
    (it restarted, or lost its weights): the learner then syncs again instead of failing on
    stale samples."""
    oldest = min(info.weight_version for info in infos)
    if oldest < version:
        logger.warning(
            "a rollout server serves weight version %d, older than the %d this learner "
            "synced (restarted?): syncing again and generating this step's prompts again",
            oldest,
            version,
        )
    return oldest < version


def sync_weights(
    accelerator: Accelerator,
    loop: EventLoopThread,
    syncer: WeightTransport,
    policy: torch.nn.Module,
    state: TrainerState,
    *,
    resync: bool = False,
    per_rank: bool = False,
) -> None:
    """Push the weights to the servers; ``state.weight_version`` becomes the version they serve.
    ``per_rank`` (``rollout.embedded.per_rank``): every rank pushes to its own server, all
    under one version.

    The version only goes up: a new push is at least the learner's version + 1 and a ``resync``
    (the weights the learner already served: a resumed run, a restarted server) at least the
    learner's, so a server that restarted (at 0) serves the learner's version again instead of
    counting from 1 (the staleness bound and the logged weight_version compare versions)."""
    accelerator.wait_for_everyone()
    version = [state.weight_version]
    hf_model = accelerator.unwrap_model(policy).model
    least = state.weight_version + (0 if resync else 1)
    with torch.no_grad():
        if per_rank:
            version = [push_to_own(accelerator, loop, syncer, hf_model, least)]
        elif accelerator.is_main_process:
            answers = push_weights(accelerator, loop, syncer, hf_model, least)
            version = [min(a.weight_version for a in answers)]
        else:
            syncer.follow(hf_model)
    broadcast_object_list(version, from_process=0)
    state.weight_version = int(version[0])
    accelerator.wait_for_everyone()  # no rank generates before every server has the new weights


def next_version(loop: EventLoopThread, syncer: WeightTransport, least: int) -> int | None:
    """The version for a push: None (each server numbers it: its own + 1, as a prepared NCCL
    update expects) where every server serves the same version and its + 1 is at least
    ``least``; else ``least``, or above every server's version where one serves a newer one, so
    that every server takes it and all serve the same version after it."""
    served = {i.weight_version for i in loop.run(syncer.client.info())}
    if len(served) == 1 and max(served) + 1 >= least:
        return None
    return max(least, max(served) + 1)


def push_to_own(
    accelerator: Accelerator,
    loop: EventLoopThread,
    syncer: WeightTransport,
    hf_model: Any,
    least: int,
) -> int:
    """Every rank: push the weights to this rank's own server, as one version agreed over the
    ranks (at least ``least`` and above what any rank's server serves, so every server takes
    it); under ZeRO-3 the ranks' pushes run the gathers together. Returns the version the
    servers serve, the least over the ranks."""
    served = max(i.weight_version for i in loop.run(syncer.client.info()))
    agreed = max(gather_object([max(least, served + 1)]))
    answers = push_weights(accelerator, loop, syncer, hf_model, least, version=agreed)
    return min(gather_object([min(a.weight_version for a in answers)]))


SYNC_ATTEMPTS = 3


def push_weights(
    accelerator: Accelerator,
    loop: EventLoopThread,
    syncer: WeightTransport,
    hf_model: Any,
    least: int,
    *,
    version: int | None = None,
) -> list[Any]:
    """Push the weights as ``version`` (default ``next_version(least)``); when a server could not be reached
    (it restarts, say), take the servers that are not ready out of rotation where others are
    (they get the weights when they join again: ``learner.servers.fleet``), else wait until
    they are ready, and push again (its version asked again), up to ``SYNC_ATTEMPTS`` times. Not for NCCL (its group would have to be formed
    again) nor under ZeRO-3 (the other ranks' gathers follow one push). A server that refuses
    the weights' shapes serves another model: a ``SetupError`` naming it."""
    ds = accelerator.state.deepspeed_plugin
    retry = syncer.retries_pushes and (ds is None or ds.zero_stage != 3)
    for attempt in range(1, SYNC_ATTEMPTS + 1):
        try:
            v = next_version(loop, syncer, least) if version is None else version
            return loop.run(syncer.push(hf_model, v))
        except RolloutError as e:
            if (mismatch := other_model(e)) is not None:
                raise SetupError(mismatch) from None
            if not retry or not server_went_away(e):
                raise
            if attempt == SYNC_ATTEMPTS:
                raise ServersLostError(
                    e.server, "rollout.ready_timeout_s", syncer.ready_timeout_s
                ) from e
            logger.warning(
                "weight sync failed (%s); waiting for the rollout servers, then syncing again "
                "(attempt %d of %d)",
                e,
                attempt + 1,
                SYNC_ATTEMPTS,
            )
            loop.run(drop_unready(syncer.client))
            try:
                loop.run(syncer.client.wait_ready(syncer.ready_timeout_s))
            except RolloutUnavailableError as gone:
                raise ServersLostError(
                    gone.server, "rollout.ready_timeout_s", syncer.ready_timeout_s
                ) from None
    raise AssertionError("unreachable")


async def drop_unready(client: RolloutClient) -> None:
    """Take the servers that do not answer ``/ready`` out of rotation (never the last one)."""
    servers = client.servers
    ready = await asyncio.gather(*(client.is_ready(s) for s in servers))
    if any(ready):
        for s, ok in zip(servers, ready, strict=True):
            if not ok:
                client.drop(s, "not ready after a failed weight sync")


def other_model(e: BaseException | None) -> str | None:
    """Why a refused sync means the server serves another model than the learner's (a tensor of
    another shape, or one it does not have), in one line; None if it does not."""
    while e is not None:
        if isinstance(e, RolloutHTTPError) and e.status in (400, 422):
            detail = " ".join(e.detail.split())
            if any(k in detail for k in ("has shape", "unknown tensor", "not a parameter")):
                return (
                    f"the rollout server {e.server} serves a model of other shapes than the "
                    f"learner's (model.name_or_path): {detail[:400]}. Serve the same model"
                )
        e = e.__cause__
    return None


def server_went_away(e: BaseException | None) -> bool:
    """Whether a failed sync failed because a server was unreachable or lost the update it had
    staged (a restart), rather than because it refused the weights."""
    while e is not None:
        if isinstance(e, RolloutUnavailableError) or (
            isinstance(e, RolloutHTTPError) and e.status == 404
        ):
            return True
        e = e.__cause__
    return False
