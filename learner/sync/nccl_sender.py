"""The NCCL sender (``learner.sync.nccl``'s transport, the GPU benches): learner rank 0
broadcasts flat buckets to every rollout worker.

One ``send`` is one HTTP announce per server (every tensor's name/dtype/shape and the bucket
layout) plus one broadcast per bucket segment (runs of whole tensors of at most
``segment_bytes``: the first leaves while the next are packed) and a final commit word, never
one round trip per tensor.
The announce answers once the server has loaded the update (or refused it), so it runs
concurrently with the broadcasts. After the commit word every worker and the learner join one
sum all-reduce, each worker adding 1 once the update is in its parameters: the learner knows
the load is done without the HTTP answer's trip back, and ``send(wait_answers=False)`` returns
right then (``answers()`` has the HTTP answers later).

``prepare`` moves the announce and the commit off the sync's critical path: called while the
optimizer still steps, it has every server queue the next update's receives
(``POST /weights/nccl/prepare``) and posts the commit (``/weights/nccl/commit``) right away, so
the workers wait for the bytes. The ``send`` that follows only broadcasts and waits for the
workers' acknowledgement: no HTTP call on its path. Any failure of a prepared send drops the
group on this end; the next ``send`` forms it again. A prepared update that will not be sent
(a different one comes) is abandoned: zeros and commit word 0, the servers keep their
weights. The wire details (bucket layout, commit word, checksum, abort on a dead peer) live in
``rollout_server.nccl_wire``, shared with the receiving side
(``rollout_server.engine.vllm_worker``), so both ends use one definition.

Set ``NCCL_CUMEM_ENABLE=0`` in the learner's environment before it starts (the server's vLLM
workers run with it; two ends of one communicator with different settings can hang).

Only the main process sends, but under ZeRO-3 every rank must run the same parameter gathers:
feed ``send`` from ``learner.sync.zero3.iter_gathered_params`` on rank 0 and exhaust the same
iterator on the other ranks. ``send`` always consumes its iterator to the end, even when it
fails, so the ranks' gathers stay in step.

The group is formed by ``learner.sync.nccl_group``. The communicator and what runs on it, off
the event loop (the broadcast thread, the streams, the packing buffers), belong to the sender's
``learner.sync.nccl_broadcast.Broadcaster``; the bucket planning and tensor-stream helpers,
shared with the CUDA IPC sender, are in ``learner.sync.nccl_buckets``.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from learner.sync.nccl_broadcast import Broadcaster
from learner.sync.nccl_buckets import (
    announce_to_all,
    check_checksums,
    plan_buckets,
    update_stats,
)
from learner.sync.nccl_group import form_group, joining_device
from rollout_server.client import RolloutClient, RolloutError, WeightSyncError
from rollout_server.nccl_wire import (
    Bucket,
    NcclGroupError,
    bucket_layout,
)
from rollout_server.protocol import (
    LoraAdapterSpec,
    NcclPrepared,
    NcclUpdateRequest,
    TensorSpec,
    WeightUpdateResponse,
)

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

_SWITCH_INTERVAL_S = 0.0002  # GIL switch interval while a send is in progress
# Each bucket goes over the wire in runs of whole tensors of at most this many bytes: the first
# leaves while the next are packed, and the servers copy each in as it lands (prepared updates).
SEGMENT_BYTES = 64 << 20


@dataclass(frozen=True)
class _PreparedSend:
    request: NcclUpdateRequest
    key: tuple  # _update_key of its arguments (cheaper to compare than the request)
    ids: list[str]  # per server, in client.servers order
    layout: list[Bucket]  # the request's, made at prepare (off the send's critical path)
    commit: asyncio.Future  # the servers' commit, posted right after preparing: their answers


class NcclWeightSender:
    """Learner rank 0 of the weight-sync group. ``init`` once, then ``send`` after each step
    (``prepare`` before it, while the optimizer steps, takes the announce off its path)."""

    def __init__(self) -> None:
        self._client: RolloutClient | None = None
        self._broadcaster = Broadcaster()  # the group's communicator and broadcast thread
        self._init_args: dict[str, Any] = {}
        self._prepared: _PreparedSend | None = None
        self._workers = 0  # the servers' workers in the group (each acknowledges a load)
        self._answers: asyncio.Future | None = None  # a send's HTTP answers not awaited yet
        self.last_stats: dict[str, float] = {}
        self.last_prepare_s: float | None = None

    @property
    def ready(self) -> bool:
        return self._broadcaster.ready

    async def init(
        self,
        client: RolloutClient,
        *,
        master_address: str,
        master_port: int,
        device: torch.device | int | str,
        timeout_s: float = 300.0,
    ) -> None:
        """Form the group: rank 0 here, then every worker of every server (from ``/info``).

        ``master_address`` must be an address of this machine that the servers can reach."""
        dev = joining_device(device)
        self.close()
        self._client = client
        self._init_args = dict(
            master_address=master_address,
            master_port=master_port,
            device=device,
            timeout_s=timeout_s,
        )
        comm, dev, self._workers = await form_group(
            client,
            master_address=master_address,
            master_port=master_port,
            device=dev,
            timeout_s=timeout_s,
        )
        self._broadcaster.attach(comm, dev, timeout_s)

    def close(self) -> None:
        """Leave the group. A prepared update still waiting is left to the servers' timeout
        (``_abandon`` ends it at once, when the group still works)."""
        if self._prepared is not None:
            self._prepared.commit.cancel()
            self._prepared = None
        if self._answers is not None:
            self._answers.cancel()
            self._answers = None
        self._broadcaster.abort()

    @staticmethod
    def _request(
        specs: Sequence[TensorSpec],
        bucket_bytes: int,
        version: int | None,
        checksum: bool,
        segment_bytes: int,
        adapter: LoraAdapterSpec | None = None,
    ) -> NcclUpdateRequest:
        plan = plan_buckets(specs, bucket_bytes)
        return NcclUpdateRequest(
            tensors=list(specs),
            buckets=plan.buckets,
            bucket_dtypes=plan.dtypes,
            version=version,
            checksum=checksum,
            segment_bytes=segment_bytes,
            ack=True,
            adapter=adapter,
        )

    async def prepare(
        self,
        specs: Sequence[TensorSpec],
        *,
        bucket_bytes: int = 1 << 30,
        version: int | None = None,
        checksum: bool = False,
        segment_bytes: int = SEGMENT_BYTES,
    ) -> bool:
        """Have every server queue the receives of the next ``send`` of these ``specs`` (same
        arguments), and post its commit at once: the workers then wait for the bytes, and that
        ``send`` only broadcasts (no HTTP call on its path). Call it while the learner is still
        busy (the optimizer step) and no generation is wanted from the servers: until the
        update is loaded they hold generation paused (requests wait, as behind any weight
        load). ``send`` must follow within the group's ``timeout_s``, or the servers give the
        update up. Returns False, and ``send`` then announces as usual, if a server could not
        prepare (e.g. no GPU memory to stage on)."""
        if self._client is None:
            raise RuntimeError("NcclWeightSender.prepare before init()")
        await self._settle()
        request = self._request(specs, bucket_bytes, version, checksum, segment_bytes)
        key = _update_key(specs, bucket_bytes, version, checksum, segment_bytes)
        if self._prepared is not None:
            if self._prepared.key == key:
                return True
            await self._abandon()  # a different update
        if not self._broadcaster.ready:
            await self.init(self._client, **self._init_args)
        client = self._client
        start = time.perf_counter()
        answers = await asyncio.gather(
            *(client.nccl_prepare(s, request) for s in client.servers), return_exceptions=True
        )
        failed = [(s, a) for s, a in zip(client.servers, answers, strict=True)
                  if isinstance(a, BaseException)]  # fmt: skip
        if failed:
            for server, exc in failed:
                log.warning("%s could not prepare the NCCL update (%s); it is announced with "
                            "the send instead", server, exc)  # fmt: skip
            if len(failed) < len(answers):
                self.close()  # the others wait on receives: forming the group again drops them
            if not all(isinstance(a, RolloutError) for _, a in failed):
                raise failed[0][1]
            return False
        prepared = [a for a in answers if isinstance(a, NcclPrepared)]
        ids = [a.prepared_id for a in prepared]
        # The commit goes out now, while the learner still steps: the workers then wait for
        # the bytes, and the send has no HTTP call on its path, only the broadcasts.
        commit = asyncio.ensure_future(self._commit(ids))
        self._prepared = _PreparedSend(request, key, ids, _layout(request), commit)
        self.last_prepare_s = time.perf_counter() - start
        return True

    async def send(
        self,
        specs: Sequence[TensorSpec],
        tensor_iter: Iterable[tuple[str, torch.Tensor]],
        *,
        bucket_bytes: int = 1 << 30,
        version: int | None = None,
        checksum: bool = False,
        segment_bytes: int = SEGMENT_BYTES,
        on_bucket: Callable[[int], None] | None = None,
        wait_answers: bool = True,
        adapter: LoraAdapterSpec | None = None,
    ) -> list[WeightUpdateResponse] | None:
        """Send one update. ``tensor_iter`` yields the tensors of ``specs`` in that order; each
        is cast to its spec's dtype while it is copied into the bucket.

        Every worker acknowledges the load over NCCL (a sum all-reduce after the commit word)
        as soon as the update is in its parameters. With ``wait_answers=False`` (and no
        ``checksum``) this returns None right then, while the servers finish the commit
        (version bump, resuming generation: any request sent from now on is served by the new
        weights); ``answers()`` returns their HTTP answers, and the next ``send``/``prepare``
        waits for them. Otherwise it returns the answers.

        Raises ``WeightSyncError`` if any server did not load it (those keep their previous
        weights). ``on_bucket(b)`` runs once bucket ``b`` has left this GPU. ``adapter``: the
        tensors are that LoRA adapter's (never prepared), served on the base weights."""
        begun = time.perf_counter(), time.time()  # the sync's time counts from here
        if self._client is None:
            raise RuntimeError("NcclWeightSender.send before init()")
        if self._answers is not None:
            await self._settle()
            begun = time.perf_counter(), time.time()
        specs = list(specs)
        key = _update_key(specs, bucket_bytes, version, checksum, segment_bytes)
        if adapter is not None:
            key = (*key, "adapter")  # never the prepared update's
        if self._prepared is not None and self._prepared.key != key:
            log.warning("the update differs from the prepared one; announcing it instead")
            await self._abandon()
        prepared, self._prepared = self._prepared, None
        if prepared is not None:
            request = prepared.request
        else:
            request = self._request(specs, bucket_bytes, version, checksum, segment_bytes, adapter)
        if not self._broadcaster.ready:  # a failed update aborted the group: form it again
            await self.init(self._client, **self._init_args)
        try:
            return await self._send(
                request, prepared, tensor_iter, on_bucket, begun, not (wait_answers or checksum)
            )
        except BaseException:
            if prepared is not None:
                self.close()  # the servers dropped theirs (and the group) with the commit
            raise

    async def answers(self) -> list[WeightUpdateResponse]:
        """The servers' answers to the last ``send(wait_answers=False)``; raises its failure."""
        pending, self._answers = self._answers, None
        if pending is None:
            raise RuntimeError("no send(wait_answers=False) is waiting for its answers")
        responses = await pending
        self.last_stats["answered_at"] = time.time()
        return responses

    async def _settle(self) -> None:
        """Wait for an earlier send's answers before the next update (its failure raises)."""
        if self._answers is not None:
            try:
                await self.answers()
            except BaseException:
                self.close()  # the group's state is unknown: form it again
                raise

    async def _send(
        self,
        request: NcclUpdateRequest,
        prepared: _PreparedSend | None,
        tensor_iter: Iterable[tuple[str, torch.Tensor]],
        on_bucket: Callable[[int], None] | None,
        begun: tuple[float, float],
        early: bool,
    ) -> list[WeightUpdateResponse] | None:
        checksum = request.checksum
        layout = prepared.layout if prepared is not None else _layout(request)
        marks: dict[str, float] = {}  # the broadcast thread's progress, for profiling
        stop = threading.Event()
        worded = threading.Event()  # the commit word is out: the servers will answer soon
        # Announced: the workers queue their receives on the announce, so it goes first.
        # Prepared: they wait already, and so does the commit, posted after preparing.
        announce = prepared.commit if prepared is not None else (
            asyncio.ensure_future(self._announce(request))
        )  # fmt: skip
        announce.add_done_callback(
            lambda f: stop.set() if f.cancelled() or f.exception() is not None else None
        )
        start, sent_at = begun
        # The broadcast thread fills buckets in Python while this loop writes the announce: with
        # the default 5 ms GIL switch interval the announce could wait that long to go out.
        switch = sys.getswitchinterval()
        sys.setswitchinterval(min(switch, _SWITCH_INTERVAL_S))
        try:
            sent_checksum, acked = await self._broadcaster.run(
                layout,
                tensor_iter,
                stop,
                checksum,
                request.segment_bytes,
                on_bucket,
                marks,
                worded,
            )
        except NcclGroupError as exc:
            self._broadcaster.forget()  # aborted: the next send forms the group again
            if not worded.is_set():
                announce.cancel()  # the servers time out (or never got the announce)
            await asyncio.gather(announce, return_exceptions=True)
            if announce.done() and not announce.cancelled() and announce.exception():
                raise announce.exception() from exc  # the server's reason is the useful one
            raise WeightSyncError("learner", f"NCCL broadcast failed: {exc}") from exc
        except BaseException:
            if not worded.is_set():
                announce.cancel()
            await asyncio.gather(announce, return_exceptions=True)  # the server says why
            raise
        finally:
            sys.setswitchinterval(switch)
        loaded_s = time.perf_counter() - start  # every worker acknowledged the load
        # wall-clock stamps too, to line up with the servers' response timelines
        stats = dict(sent_at=sent_at, prepared=float(prepared is not None), loaded_s=loaded_s)
        early = early and acked == self._workers
        if not early:
            responses = await announce
            if acked != self._workers:  # the answers said nothing wrong, yet one did not load
                raise WeightSyncError(
                    "server", f"only {acked} of {self._workers} workers acknowledged the load"
                )
            stats["answered_at"] = time.time()
        self.last_stats = update_stats(start, request.tensors, **stats)
        self.last_stats["sender_ms"] = {k: (t - start) * 1e3 for k, t in marks.items()}  # type: ignore[assignment]
        if early:
            self._answers = announce
            return None
        if checksum:
            check_checksums(self._client.servers, responses, sent_checksum)
        return responses

    async def _announce(self, request: NcclUpdateRequest) -> list[WeightUpdateResponse]:
        client = self._client
        assert client is not None
        # The first refusal raises at once: it stops the broadcast (the others would wait).
        return await announce_to_all(
            client.servers, lambda s: client.nccl_update(s, request), "NCCL"
        )

    async def _commit(self, ids: list[str]) -> list[WeightUpdateResponse]:
        client = self._client
        assert client is not None
        by_server = dict(zip(client.servers, ids, strict=True))
        return await announce_to_all(
            client.servers, lambda s: client.nccl_commit(s, by_server[s]), "NCCL"
        )

    async def _abandon(self) -> None:
        """Give the prepared update up: its receives (and commit) wait on the servers, so it is
        sent as zeros with commit word 0. They restore what they had and keep the group."""
        prepared, self._prepared = self._prepared, None
        if prepared is None:
            return
        log.info("abandoning the prepared update: zeros and commit word 0")
        begun = time.perf_counter(), time.time()
        try:
            await self._send(prepared.request, prepared, iter(()), None, begun, False)
        except Exception as exc:  # expected: the empty stream, or the servers' refusal
            log.info("the prepared update was abandoned (%s)", exc)


def _update_key(specs: Sequence[TensorSpec], *args: Any) -> tuple:
    """What makes two updates the same: every spec, and the other arguments."""
    return (tuple((s.name, s.dtype, *s.shape) for s in specs), *args)


def _layout(request: NcclUpdateRequest) -> list[Bucket]:
    specs = [s.model_dump() for s in request.tensors]
    return bucket_layout(specs, request.buckets, request.bucket_dtypes)
