"""Typed async client for one or more rollout servers.

The learner talks to servers only through this class. It speaks the models of
``rollout_server.protocol`` and turns every failure into an exception that names the server,
the call and the reason.

Retries: only calls that are safe to repeat are retried (health/info/generate, uploading a
staged bucket). A weight *commit* is never retried blindly: if its answer is lost, the server may
or may not have applied it, so the error says to check ``/info``'s ``weight_version``.

The HTTP calls themselves (one connection pool, retries with backoff) and the errors are
``client_http``'s; the errors are part of this module's API and imported from here.

Importing this module imports neither torch nor any engine; ``update_weights`` imports
safetensors/torch lazily.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from rollout_server.client_http import (
    RETRY_STATUSES,
    RolloutAuthError,
    RolloutError,
    RolloutHTTPError,
    RolloutUnavailableError,
    ServerCalls,
    WeightSyncError,
    logger,
)
from rollout_server.protocol import (
    GenerateRequest,
    GenerateResponse,
    InfoResponse,
    IpcUpdateRequest,
    NcclCommitRequest,
    NcclInitRequest,
    NcclPrepared,
    NcclUpdateRequest,
    SleepRequest,
    SleepStatus,
    WakeUpRequest,
    WeightChecksum,
    WeightFileRequest,
    WeightUpdateBegin,
    WeightUpdateCommit,
    WeightUpdateId,
    WeightUpdateResponse,
)

if TYPE_CHECKING:
    import torch

    from rollout_server.protocol import LoraAdapterSpec

__all__ = [
    "RETRY_STATUSES",
    "RolloutAuthError",
    "RolloutClient",
    "RolloutError",
    "RolloutHTTPError",
    "RolloutUnavailableError",
    "WeightSyncError",
]


def _shards(count: int, parts: int) -> list[tuple[int, int]]:
    """Contiguous, near-equal [start, end) ranges of ``count`` items over ``parts`` servers."""
    parts = max(1, min(parts, count))
    base, extra = divmod(count, parts)
    out, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        out.append((start, end))
        start = end
    return out


class RolloutClient:
    """Async client for a fleet of rollout servers (one batch is spread over all of them).

    ``servers`` are the ones in rotation. A server that cannot be reached while generating
    (after the retries) is taken out of rotation and its share goes to the others; ``dropped``
    keeps it for whoever brings it back (the learner resyncs it first). The last server is
    never taken out: its error reaches the caller."""

    def __init__(
        self,
        base_urls: str | Sequence[str],
        *,
        api_key: str | None = None,
        timeout_s: float = 600.0,
        connect_timeout_s: float = 10.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
    ) -> None:
        urls = [base_urls] if isinstance(base_urls, str) else list(base_urls)
        if not urls:
            raise ValueError(
                "RolloutClient needs at least one server URL (e.g. http://127.0.0.1:8000)"
            )
        self._options: dict[str, Any] = {
            "api_key": api_key,
            "timeout_s": timeout_s,
            "connect_timeout_s": connect_timeout_s,
            "max_retries": max_retries,
            "backoff_s": backoff_s,
        }
        self._calls = ServerCalls([u.rstrip("/") for u in urls], **self._options)
        self.dropped: list[str] = []  # taken out of rotation, in the order they were
        self._load: dict[str, int] = {}  # prompts in flight per server

    @property
    def servers(self) -> list[str]:
        """The servers in rotation (a new list object on every change: a call in flight keeps
        the list it started with)."""
        return self._calls.servers

    @servers.setter
    def servers(self, urls: Sequence[str]) -> None:
        if not urls:
            raise ValueError("a RolloutClient needs at least one server in rotation")
        self._calls.servers = [u.rstrip("/") for u in urls]
        self.dropped = [s for s in self.dropped if s not in self._calls.servers]

    def drop(self, server: str, why: str) -> bool:
        """Take ``server`` out of rotation (not the last one); returns whether it was."""
        if server not in self.servers or len(self.servers) == 1:
            return False
        self._calls.servers = [s for s in self.servers if s != server]
        self.dropped.append(server)
        logger.warning(
            "rollout server %s taken out of rotation (%s); %d remain: %s",
            server, why, len(self.servers), ", ".join(self.servers),
        )  # fmt: skip
        return True

    def subset(self, urls: Sequence[str]) -> RolloutClient:
        """A client for ``urls`` with this one's key, timeouts and retries."""
        return RolloutClient(list(urls), **self._options)

    @property
    def max_retries(self) -> int:
        return self._calls.max_retries

    @max_retries.setter
    def max_retries(self, value: int) -> None:
        self._calls.max_retries = value

    @property
    def backoff_s(self) -> float:
        return self._calls.backoff_s

    @backoff_s.setter
    def backoff_s(self, value: float) -> None:
        self._calls.backoff_s = value

    async def __aenter__(self) -> RolloutClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._calls.aclose()

    # -- status ----------------------------------------------------------------------------

    async def _probe(self, server: str, path: str, *, auth_fails: bool = False) -> str | None:
        """``None`` when ``server`` answers ``GET path``, else why not (one attempt: a poll).
        ``auth_fails``: a refused API key raises ``RolloutAuthError``, and a server without the
        route (404: another kind of server) ``RolloutHTTPError``: waiting cannot fix either."""
        try:
            await self._calls.call(server, "GET", path, retry=False)
            return None
        except RolloutError as e:
            if auth_fails and isinstance(e, RolloutAuthError):
                raise
            if auth_fails and isinstance(e, RolloutHTTPError) and e.status == 404:
                raise
            return e.reason

    async def health(self) -> list[bool]:
        return [w is None for w in await self._calls.all(lambda s: self._probe(s, "/health"))]

    async def ready(self) -> list[bool]:
        return [w is None for w in await self._calls.all(lambda s: self._probe(s, "/ready"))]

    async def wait_ready(
        self, timeout_s: float = 300.0, poll_s: float = 0.5, note_every_s: float = 15.0
    ) -> None:
        """Wait until every server answers ``/ready``; raise naming the ones that did not. A
        refused API key (401/403) raises ``RolloutAuthError`` at once.

        Says once at the start which servers it waits for, then every ``note_every_s`` how
        long it has waited and why each is not ready yet (not one warning per poll)."""
        start = time.monotonic()
        next_note = start
        while True:
            servers = self.servers
            why = await asyncio.gather(
                *(self._probe(s, "/ready", auth_fails=True) for s in servers)
            )
            down = {s: w for s, w in zip(servers, why, strict=True) if w is not None}
            waited = time.monotonic() - start
            if not down:
                if waited >= poll_s:
                    logger.info("rollout server(s) ready after %.0f s", waited)
                return
            reasons = "; ".join(f"{s}: {w}" for s, w in down.items())
            if waited > timeout_s:
                raise RolloutUnavailableError(
                    ", ".join(down),
                    f"not ready after {timeout_s:.0f} s (is it running? see its log); "
                    f"last answer: {reasons}",
                )
            if time.monotonic() >= next_note:
                logger.info(
                    "waiting for %d of %d rollout server(s) to be ready (%.0f s of %.0f s): %s",
                    len(down), len(self.servers), waited, timeout_s, reasons,
                )  # fmt: skip
                next_note += note_every_s
            await asyncio.sleep(poll_s)

    async def is_ready(self, server: str) -> bool:
        """Whether ``server`` (in rotation or not) answers ``/ready`` (one attempt)."""
        return await self._probe(server, "/ready") is None

    async def info_of(self, server: str) -> InfoResponse:
        """``server``'s ``/info`` (in rotation or not)."""
        return await self._calls.json(server, "GET", "/info", InfoResponse, retry=False)

    async def info(self) -> list[InfoResponse]:
        return await self._calls.all(lambda s: self._calls.json(s, "GET", "/info", InfoResponse))

    # -- generation ------------------------------------------------------------------------

    async def generate(self, request: GenerateRequest) -> GenerateResponse:
        """Generate for a batch, spread in contiguous shards over the servers in rotation (the
        least loaded first), results in order. A shard whose server cannot be reached goes to
        another one (the seeds stay those of its prompts: the samples do not change)."""
        servers = sorted(self.servers, key=lambda s: self._load.get(s, 0))
        shards = _shards(len(request.prompts), len(servers))
        parts = await asyncio.gather(
            *(self._shard(request, s, a, b) for s, (a, b) in zip(servers, shards, strict=False))
        )
        results = [r for p in parts for r in p.results]
        return GenerateResponse(
            results=results,
            weight_version=min(p.weight_version for p in parts),
            server=",".join(p.server for p in parts),
        )

    async def _shard(
        self, request: GenerateRequest, server: str, start: int, end: int
    ) -> GenerateResponse:
        """Prompts ``[start, end)`` of ``request`` on ``server``, or, when it cannot be
        reached, on the least loaded server still in rotation."""
        update: dict[str, Any] = {"prompts": request.prompts[start:end]}
        if request.seed is not None:  # prompt k draws from seed + k * n on any server
            update["seed"] = request.seed + start * request.n
        sub = request.model_copy(update=update)
        while True:
            try:
                out = await self._generate_on(server, sub, end - start)
            except RolloutUnavailableError as e:
                if not self.drop(server, e.reason) and server in self.servers:
                    raise
                server = min(self.servers, key=lambda s: self._load.get(s, 0))
                continue
            if len(out.results) != end - start:
                raise RolloutError(
                    server, f"returned {len(out.results)} results for {end - start} prompts"
                )
            return out.model_copy(update={"server": server})

    async def _generate_on(
        self, server: str, sub: GenerateRequest, prompts: int
    ) -> GenerateResponse:
        """``sub`` generated on ``server``, counted in its load while it runs."""
        self._load[server] = self._load.get(server, 0) + prompts
        try:
            return await self._generate_request(server, sub)
        finally:
            self._load[server] -= prompts

    async def _generate_request(self, server: str, sub: GenerateRequest) -> GenerateResponse:
        """The generation call itself: ``POST /generate``."""
        return await self._calls.json(server, "POST", "/generate", GenerateResponse, body=sub)

    # -- sleep -----------------------------------------------------------------------------

    async def sleep(self, level: int = 1) -> None:
        await self._calls.all(
            lambda s: self._calls.call(
                s, "POST", "/sleep", body=SleepRequest(level=level), retry=False
            )
        )

    async def wake_up(self, tags: list[str] | None = None) -> None:
        body = WakeUpRequest.model_validate({"tags": tags})
        await self._calls.all(
            lambda s: self._calls.call(s, "POST", "/wake_up", body=body, retry=False)
        )

    async def is_sleeping(self) -> list[SleepStatus]:
        return await self._calls.all(
            lambda s: self._calls.json(s, "GET", "/is_sleeping", SleepStatus)
        )

    # -- vLLM's weight-transfer routes (a stock vllm serve's; ours answers them too) -------

    async def world_size(self, server: str) -> int:
        """The workers of ``server`` that join a weight-transfer group (``/get_world_size``)."""
        resp = await self._calls.call(server, "GET", "/get_world_size", params={"include_dp": True})
        return int(resp.json()["world_size"])

    async def native(
        self,
        server: str,
        route: str,
        body: dict[str, Any] | None = None,
        params: dict[str, Any] | None = None,
    ) -> None:
        """``POST /<route>`` of vLLM's RL interface on ``server`` (never retried: a weight
        update's step must not run twice)."""
        await self._calls.call(server, "POST", f"/{route}", body=body, params=params, retry=False)

    async def pause(self, mode: str = "wait") -> None:
        """Stop new generations on every server (``wait``: the ones in flight finish)."""
        await self._calls.all(
            lambda s: self._calls.call(s, "POST", "/pause", params={"mode": mode}, retry=False)
        )

    async def resume(self) -> None:
        await self._calls.all(lambda s: self._calls.call(s, "POST", "/resume", retry=False))

    # -- weights ---------------------------------------------------------------------------

    async def nccl_init(self, server: str, request: NcclInitRequest) -> None:
        """Ask one server's workers to join the NCCL weight-sync group (they block until the
        learner, rank 0, joins too: run this concurrently with the learner's own join)."""
        await self._calls.call(server, "POST", "/weights/nccl/init", body=request, retry=False)

    async def weights_checksum(self) -> list[WeightChecksum]:
        """Every server's checksum of the weights it serves (``GET /weights/checksum``)."""
        return await self._calls.all(
            lambda s: self._calls.json(s, "GET", "/weights/checksum", WeightChecksum)
        )

    async def nccl_update(self, server: str, request: NcclUpdateRequest) -> WeightUpdateResponse:
        """Announce one NCCL update to one server; answers once it loaded (or refused) it."""
        return await self._calls.json(
            server, "POST", "/weights/nccl/update", WeightUpdateResponse, body=request, retry=False
        )

    async def nccl_prepare(self, server: str, request: NcclUpdateRequest) -> NcclPrepared:
        """Queue an update's receives on ``server`` ahead of its broadcast (``nccl_commit``)."""
        return await self._calls.json(
            server, "POST", "/weights/nccl/prepare", NcclPrepared, body=request, retry=False
        )

    async def nccl_commit(self, server: str, prepared_id: str) -> WeightUpdateResponse:
        body = NcclCommitRequest(prepared_id=prepared_id)
        return await self._calls.json(
            server, "POST", "/weights/nccl/commit", WeightUpdateResponse, body=body, retry=False
        )

    async def ipc_update(self, server: str, request: IpcUpdateRequest) -> WeightUpdateResponse:
        """One server loads an update shared as CUDA IPC handles (it must be on the learner's
        GPU); answers once it loaded (or refused) it. Keep the buffers alive until then."""
        return await self._calls.json(
            server, "POST", "/weights/ipc/update", WeightUpdateResponse, body=request, retry=False
        )

    async def load_weights_file(
        self, path: str, version: int | None = None, *, adapter: LoraAdapterSpec | None = None
    ) -> list[WeightUpdateResponse]:
        """Every server loads a safetensors file (or directory) from a shared disk; with
        ``adapter``, a LoRA adapter served on the base weights."""
        body = WeightFileRequest(path=path, version=version, adapter=adapter)

        async def one(s: str) -> WeightUpdateResponse:
            try:
                return await self._calls.json(
                    s, "POST", "/weights/load_file", WeightUpdateResponse, body=body, retry=False
                )
            except RolloutError as e:
                raise WeightSyncError(
                    s, f"file update refused, old weights still serve: {e}"
                ) from e

        return await self._calls.all(one)

    async def update_weights(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        version: int | None = None,
        bucket_bytes: int = 256 * 2**20,
        adapter: LoraAdapterSpec | None = None,
    ) -> list[WeightUpdateResponse]:
        """Send weights to every server over HTTP in safetensors buckets, then commit atomically
        (with ``adapter``: a LoRA adapter's tensors, served on the base weights).

        Tensors are consumed lazily (a ZeRO-3 gather can feed this bucket by bucket); each bucket is
        serialised once and uploaded to all servers concurrently. Any failure aborts the update on
        every server, which keeps serving its old weights."""
        staged, num_buckets = await self._upload(named_tensors, version, bucket_bytes, adapter)
        if num_buckets == 0:
            await self._abort(staged)
            raise ValueError("update_weights got no tensors")

        async def commit(s: str) -> WeightUpdateResponse:
            try:
                return await self._calls.json(
                    s,
                    "POST",
                    "/weights/commit",
                    WeightUpdateResponse,
                    body=WeightUpdateCommit(update_id=staged[s], num_buckets=num_buckets),
                    retry=False,
                )
            except RolloutUnavailableError as e:
                raise WeightSyncError(
                    s, f"commit sent but no answer ({e}); check GET /info weight_version"
                ) from e
            except RolloutError as e:
                raise WeightSyncError(s, f"commit refused, old weights still serve: {e}") from e

        return list(await asyncio.gather(*(commit(s) for s in staged)))

    async def _upload(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        version: int | None,
        bucket_bytes: int,
        adapter: LoraAdapterSpec | None = None,
    ) -> tuple[dict[str, str], int]:
        """Open the update on every server and upload every bucket to all of them; returns
        each server's update id and the bucket count. Any failure aborts it everywhere."""
        from safetensors.torch import save as st_save

        staged: dict[str, str] = {}
        num_buckets = 0
        servers = list(self.servers)  # the rotation may change while the update is staged
        try:
            begin = WeightUpdateBegin(version=version, adapter=adapter)
            ids = await asyncio.gather(
                *(
                    self._calls.json(
                        s, "POST", "/weights/begin", WeightUpdateId, body=begin, retry=False
                    )
                    for s in servers
                )
            )
            staged = {s: i.update_id for s, i in zip(servers, ids, strict=True)}
            for index, bucket in enumerate(_bucketize(named_tensors, bucket_bytes)):
                payload = st_save(dict(bucket))
                del bucket
                await asyncio.gather(
                    *(
                        self._calls.call(
                            s,
                            "POST",
                            "/weights/bucket",
                            content=payload,
                            params={"update_id": staged[s], "index": index},
                        )
                        for s in servers
                    )
                )
                num_buckets = index + 1
        except BaseException as e:
            await self._abort(staged)
            if isinstance(e, RolloutError):
                raise WeightSyncError(
                    e.server, f"update aborted, old weights still serve: {e}"
                ) from e
            raise
        return staged, num_buckets

    async def _abort(self, staged: dict[str, str]) -> None:
        for s, uid in staged.items():
            try:
                await self._calls.call(
                    s, "POST", "/weights/abort", body=WeightUpdateId(update_id=uid), retry=False
                )
            except RolloutError as e:  # the server drops stale staged updates itself
                logger.warning("could not abort update %s on %s: %s", uid, s, e)


def _bucketize(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group tensors (copied to CPU one at a time) into buckets of about ``bucket_bytes``."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in named_tensors:
        t = t.detach().to("cpu").contiguous()
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += nbytes
    if bucket:
        yield bucket
