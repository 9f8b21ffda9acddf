"""The serving logic behind the thin routers: request checks, the pause gate, versions, sleep.

``RolloutService`` owns the state that must be consistent across endpoints: the weight version,
whether the engine is loaded, asleep, or holding discarded weights, and the gate that keeps
weight loads and generations apart. Engines stay stateless about all of this.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import math
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from rollout_server.engine.base import Engine, ReceivedUpdate, SampleOutput
from rollout_server.errors import BadRequest, Conflict, NonFiniteWeights, Unavailable
from rollout_server.gate import PauseGate
from rollout_server.metrics import Metrics
from rollout_server.protocol import (
    GenerateRequest,
    GenerateResponse,
    InfoResponse,
    NcclCommitRequest,
    NcclPrepared,
    PromptResult,
    Sample,
    SleepStatus,
    WeightChecksum,
    WeightUpdateResponse,
)
from rollout_server.weights import WeightStager, validate_tensors

if TYPE_CHECKING:
    import torch

    from rollout_server.protocol import IpcUpdateRequest, NcclInitRequest, NcclUpdateRequest
    from rollout_server.settings import ServerSettings

log = logging.getLogger(__name__)

_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int64": 8, "int32": 4,
             "int8": 1, "uint8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1}  # fmt: skip


@dataclass
class _Prepared:
    """An NCCL update whose receives the workers queued ahead of the broadcast."""

    id: str
    request: NcclUpdateRequest
    num_bytes: int
    expiry: asyncio.TimerHandle | None = None  # None while the workers are still queuing
    # set once its commit arrived (the learner may post it before it broadcasts: the workers
    # then wait for the bytes, bounded by the group's timeout); done when the commit ended
    committing: asyncio.Event | None = None


class RolloutService:
    def __init__(self, settings: ServerSettings, engine: Engine, metrics: Metrics) -> None:
        self.settings = settings
        self.limits = settings.limits
        self.engine = engine
        self.metrics = metrics
        self.gate = PauseGate()
        self.stager = WeightStager()
        self.version = 0
        self.state: Literal["loading", "ready", "failed", "closed"] = "loading"
        self.load_error: str | None = None
        self.sleep_level = 0
        self.asleep: set[str] = set()  # "weights", "kv_cache"
        # tensors not loaded since sleep level 2 discarded the weights (generation waits for all)
        self.missing_weights: set[str] = set()
        self.prepared: _Prepared | None = None
        self._froze_heap = False
        self._group_timeout_s = 300.0  # the weight-sync group's (a prepared update's lifetime)
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
        if self.state == "ready":
            await self._drop_prepared("the server is shutting down")
            await self.engine.close()
        self.state = "closed"
        if self._froze_heap:  # let what the engine held be collected
            gc.unfreeze()
            self._froze_heap = False

    def require_loaded(self) -> None:
        if self.state == "loading":
            raise Unavailable("the model is still loading; retry when GET /ready answers 200")
        if self.state != "ready":
            raise Unavailable(f"the engine is not running ({self.load_error or self.state})")

    def require_ready(self) -> None:
        """Loaded, awake, and holding real weights: what generation needs."""
        self.require_loaded()
        if self.asleep or self.engine.is_sleeping():
            raise Unavailable(
                f"the server is asleep (level {self.sleep_level}); POST /wake_up first",
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

    def info(self) -> InfoResponse:
        self.require_loaded()
        e = self.engine.info()
        return InfoResponse(
            model=e.model,
            engine=e.engine,
            dtype=e.dtype,
            device=e.device,
            max_model_len=e.max_model_len,
            vocab_size=e.vocab_size,
            eos_token_ids=e.eos_token_ids,
            weight_version=self.version,
            sleeping=bool(self.asleep),
            sleep_level=self.sleep_level,
            tensor_parallel_size=e.tensor_parallel_size,
            data_parallel_size=e.data_parallel_size,
            max_num_seqs=e.max_num_seqs,
            max_batch_tokens=e.max_batch_tokens,
            limits=self.limits,
            # no /weights/* routes at all under --disable-admin-endpoints
            weight_transports=[] if self.settings.disable_admin_endpoints else e.weight_transports,
        )

    # --- generation ------------------------------------------------------------------------

    def check_limits(self, req: GenerateRequest) -> None:
        lim = self.limits
        for field, value, limit, flag in (
            ("prompts", len(req.prompts), lim.max_batch_size, "--max-batch-size"),
            ("n", req.n, lim.max_n, "--max-n"),
            ("max_tokens", req.max_tokens, lim.max_tokens, "--max-tokens"),
        ):
            if value > limit:
                what = f"{value} prompts" if field == "prompts" else f"{field}={value}"
                raise BadRequest(
                    f"{what} exceeds the server limit of {limit} (lower it, or restart the "
                    f"server with a larger {flag})"
                )

    def _tokenize(self, req: GenerateRequest) -> list[list[int]]:
        """Token ids of every prompt, each checked against the limits and the vocabulary."""
        info = self.engine.info()
        out = []
        for i, prompt in enumerate(req.prompts):
            if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
                prompt = [m.model_dump() for m in prompt]
            try:
                ids = self.engine.tokenize_prompt(
                    prompt,
                    add_generation_prompt=req.add_generation_prompt,
                    chat_template_kwargs=req.chat_template_kwargs,
                    tools=req.tools,
                )
            except Exception as exc:  # template errors, bad message structure
                raise BadRequest(
                    f"prompts[{i}] could not be tokenized: {type(exc).__name__}: {exc}"
                ) from exc
            out.append(self._check_prompt(i, ids, info.vocab_size, info.max_model_len))
        for t in req.stop_token_ids:
            if not 0 <= t < info.vocab_size:
                raise BadRequest(f"stop_token_ids: {t} is not a token id (vocab {info.vocab_size})")
        return out

    def _check_prompt(self, i: int, ids: list[int], vocab: int, max_model_len: int) -> list[int]:
        if not ids:
            raise BadRequest(f"prompts[{i}] is empty (no tokens); send at least one token")
        limit = min(self.limits.max_prompt_len, max_model_len - 1)
        if len(ids) > limit:
            which, flag = (
                ("max_prompt_len", "--max-prompt-len")
                if limit == self.limits.max_prompt_len
                else ("max_model_len - 1 (room for one completion token)", "--max-model-len")
            )
            raise BadRequest(
                f"prompts[{i}] has {len(ids)} tokens, more than the limit {which} = {limit}: "
                f"send a shorter prompt, or restart the server with a larger {flag}"
            )
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise BadRequest(
                f"prompts[{i}] contains token ids outside the vocabulary [0, {vocab}): {bad[:5]}"
            )
        return ids

    @staticmethod
    def check_tools(req: GenerateRequest) -> None:
        """``tools`` reach the model only through the chat template: refuse them with a prompt
        the template never sees, rather than drop them silently."""
        if not req.tools:
            return
        for i, prompt in enumerate(req.prompts):
            if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
                kind = "text" if isinstance(prompt, str) else "token ids"
                raise BadRequest(
                    f"prompts[{i}] is {kind}, but tools apply only to chat-message prompts "
                    "(the chat template renders them): send the prompt as chat messages, or "
                    "leave tools out"
                )

    async def generate(self, req: GenerateRequest) -> GenerateResponse:
        self.require_loaded()
        self.check_limits(req)
        self.check_tools(req)
        prompt_ids = await asyncio.to_thread(self._tokenize, req)
        params = req.sampling()
        async with self.gate.read():
            self.require_ready()
            version = self.version
            start = time.perf_counter()
            outputs = await self.engine.generate(prompt_ids, req.n, params)
        if params.logprobs:
            self._check_finite_logprobs(outputs, version)
        results = [
            PromptResult(
                prompt_token_ids=ids,
                samples=[
                    Sample(
                        token_ids=o.token_ids,
                        logprobs=o.logprobs if params.logprobs else [],
                        text=o.text,
                        finish_reason=o.finish_reason,
                        weight_version=version,
                    )
                    for o in outs
                ],
            )
            for ids, outs in zip(prompt_ids, outputs, strict=True)
        ]
        self._record_generation(results, time.perf_counter() - start)
        return GenerateResponse(results=results, weight_version=version)

    @staticmethod
    def _check_finite_logprobs(outputs: list[list[SampleOutput]], version: int) -> None:
        """JSON has no NaN/inf (they would go out as null and break ``list[float]``): weights
        holding NaN/inf make every log-prob NaN. Log-probs are <= 0, so a finite list sums to a
        finite number, and one ``sum`` per sample finds a NaN or an inf."""
        for i, samples in enumerate(outputs):
            for o in samples:
                if not math.isfinite(sum(o.logprobs)):
                    raise NonFiniteWeights(
                        f"the served weights (version {version}) produce non-finite log-probs "
                        f"(NaN or inf) for prompts[{i}]: they hold NaN/inf values, which came with "
                        "the checkpoint the server started from (updates holding them are "
                        "refused); load finite weights"
                    )

    def _record_generation(self, results: list[PromptResult], seconds: float) -> None:
        m = self.metrics
        generated = sum(len(s.token_ids) for r in results for s in r.samples)
        m.prompt_tokens.inc(sum(len(r.prompt_token_ids) for r in results))
        m.generation_tokens.inc(generated)
        for r in results:
            for s in r.samples:
                m.samples.labels(s.finish_reason).inc()
        if seconds > 0:
            m.tokens_per_second.set(generated / seconds)

    # --- weights ---------------------------------------------------------------------------

    def _next_version(self, version: int | None) -> int:
        if version is None:
            return self.version + 1
        if version <= self.version:
            raise Conflict(
                f"version={version} is not newer than the current weight version {self.version}; "
                f"send a larger version or omit it to use {self.version + 1}"
            )
        return version

    def _require_weights_awake(self) -> None:
        self.require_loaded()
        if "weights" in self.asleep:
            raise Conflict(
                "the weights are asleep; POST /wake_up (or /wake_up with tags ['weights']) "
                "before updating or reading them"
            )

    def check_update_version(self, version: int | None) -> None:
        """Early refusal (at begin/announce) of a version that could never be committed."""
        self._require_weights_awake()
        self._refuse_if_prepared("another weight update")
        self._next_version(version)

    def _refuse_if_prepared(self, what: str) -> None:
        """While a prepared NCCL update waits, its receives hold the weight-sync group and the
        staging buffers: nothing else may load weights or sleep."""
        prepared = self.prepared
        if prepared is not None and prepared.committing is not None:
            raise Conflict(
                f"{what} cannot run while prepared NCCL update {prepared.id} is being committed "
                "(the workers wait for its broadcast, at most the group's timeout)"
            )
        if prepared is not None:
            raise Conflict(
                f"{what} cannot run while NCCL update {prepared.id} is prepared; POST "
                "/weights/nccl/commit first (or /weights/nccl/init, which drops it)"
            )

    async def apply_weights(
        self,
        tensors: Mapping[str, torch.Tensor],
        version: int | None,
        transport: str,
        *,
        values_checked: bool = False,
    ) -> WeightUpdateResponse:
        """Validate, then load under the pause; the version moves only if all of it loaded.
        ``values_checked``: staged buckets were already scanned for NaN/inf on arrival."""
        self._require_weights_awake()
        num_bytes = await asyncio.to_thread(
            validate_tensors,
            tensors,
            self.engine.weight_metadata(),
            check_values=not values_checked,
        )
        async with self.gate.write():
            self._require_weights_awake()
            self._refuse_if_prepared("another weight update")
            new_version = self._next_version(version)
            start = time.perf_counter()
            await self.engine.load_weights(tensors.items())
            await self.engine.reset_prefix_cache()
            seconds = time.perf_counter() - start
            self._set_version(new_version, tensors)
        return self._record_update(transport, len(tensors), num_bytes, seconds, None)

    def _set_version(self, version: int, loaded: Iterable[str]) -> None:
        """A whole update loaded: its tensors are no longer missing after a level-2 sleep."""
        self.version = version
        self.missing_weights.difference_update(loaded)
        self.metrics.weight_version.set(version)

    def _record_update(self, transport, num_tensors, num_bytes, seconds, checksum):
        m = self.metrics
        m.weight_updates.labels(transport, "ok").inc()
        m.weight_update_seconds.observe(seconds)
        m.weight_update_bytes.inc(num_bytes)
        log.info("weights v%d loaded over %s: %d tensors, %.1f MB in %.2fs",
                 self.version, transport, num_tensors, num_bytes / 1e6, seconds)  # fmt: skip
        return WeightUpdateResponse(
            weight_version=self.version,
            num_tensors=num_tensors,
            num_bytes=num_bytes,
            seconds=seconds,
            checksum=checksum,
        )

    async def weights_checksum(self) -> WeightChecksum:
        """The served weights' checksum, between loads (never of half-loaded weights)."""
        self._require_weights_awake()
        async with self.gate.read():
            self._require_weights_awake()
            version, checksum = self.version, await self.engine.weights_checksum()
        if not math.isfinite(checksum):  # JSON has no NaN/inf: it would go out as null
            raise NonFiniteWeights(
                f"the served weights (version {version}) hold non-finite values (NaN or inf), "
                "so they have no checksum: they came with the checkpoint the server started from "
                "(updates holding them are refused); load finite weights"
            )
        return WeightChecksum(weight_version=version, checksum=checksum)

    async def init_weight_group(self, request: NcclInitRequest) -> None:
        self.require_loaded()
        prepared = self.prepared
        if prepared is not None and prepared.committing is not None:
            # its workers wait for bytes from the group this init replaces: the learner that
            # would send them restarted (or gave that group up), so they will not come
            cancelled = await self.engine.cancel_nccl_commit()
            log.warning("init: %s the commit of prepared NCCL update %s (it waits for a broadcast "
                        "from the previous weight-sync group)",
                        "cancelled" if cancelled else "waiting for", prepared.id)  # fmt: skip
            await prepared.committing.wait()
        if self.prepared is not None:  # a learner that restarted after preparing
            await self._drop_prepared("the weight-sync group is being formed again")
        self._group_timeout_s = request.timeout_s
        await self.engine.init_weight_group(request)

    async def nccl_prepare(self, request: NcclUpdateRequest) -> NcclPrepared:
        """Pause early: wait for the generations in flight, then have the workers queue the
        update's receives and reset the prefix cache, and hold the pause (new generations wait,
        as behind any load) until the commit, which then only waits for the bytes and loads.
        Dropped (and the pause lifted) if not committed within the group's timeout."""
        from rollout_server.weights import validate_nccl_announce

        self._refuse_if_prepared("preparing another update")
        num_bytes = self._check_announce(validate_nccl_announce, request)
        prepared = self.prepared = _Prepared(uuid.uuid4().hex, request, num_bytes)
        try:
            await self.gate.acquire_write()
        except BaseException:
            self.prepared = None
            raise
        try:
            self._require_weights_awake()
            await self.engine.prepare_nccl_update(request)
        except BaseException:
            self.prepared = None
            await asyncio.shield(self.gate.release_write())
            raise
        timeout = self._group_timeout_s
        prepared.expiry = asyncio.get_running_loop().call_later(
            timeout, lambda: asyncio.ensure_future(self._expire(prepared))
        )
        return NcclPrepared(prepared_id=prepared.id, num_bytes=num_bytes, expires_s=timeout)

    async def _expire(self, prepared: _Prepared) -> None:
        if self.prepared is prepared and prepared.committing is None:
            await self._drop_prepared(f"not committed within {self._group_timeout_s:.0f} s")

    async def _drop_prepared(self, why: str) -> None:
        """Give a prepared update up: the workers abort the group (ending its receives) and
        generation resumes on the weights it had."""
        prepared, self.prepared = self.prepared, None
        if prepared is None:
            return
        log.warning("prepared NCCL update %s dropped (%s); the learner must init the weight-sync "
                    "group again", prepared.id, why)  # fmt: skip
        await self._release_prepared(prepared, drop=True)

    async def _release_prepared(self, prepared: _Prepared, *, drop: bool) -> None:
        if prepared.expiry is not None:
            prepared.expiry.cancel()
        try:
            if drop:
                await self.engine.drop_prepared_update()
        finally:
            await asyncio.shield(self.gate.release_write())

    async def nccl_commit(self, request: NcclCommitRequest) -> WeightUpdateResponse:
        """Load the prepared update once its broadcast arrived; the version moves only if all of
        it loaded. A failed commit drops it (and the group: init again). The learner may post
        the commit before it broadcasts (right after preparing): the workers then wait for the
        bytes, at most the group's timeout, and other updates and sleep stay refused."""
        announced = time.time()
        prepared = self.prepared
        if prepared is None or prepared.id != request.prepared_id or prepared.expiry is None:
            raise Conflict(
                f"no prepared NCCL update {request.prepared_id!r} (a failed commit, an init or "
                "its expiry drops one); prepare the update again"
            )
        if prepared.committing is not None:
            raise Conflict(f"prepared NCCL update {prepared.id} is already being committed")
        prepared.committing = asyncio.Event()
        prepared.expiry.cancel()
        loaded = False
        try:
            response = await self._announced_update(
                announced, prepared.request, prepared.num_bytes, "nccl",
                self.engine.commit_nccl_update, gate_held=True,
            )  # fmt: skip
            loaded = True
        except BaseException as exc:
            log.warning("prepared NCCL update %s failed: %s", prepared.id, exc)
            raise
        finally:  # no longer prepared: whoever waits for the commit goes on
            if self.prepared is prepared:
                self.prepared = None
            prepared.committing.set()
            # a failed one's receives may still wait: drop them (and the group)
            await self._release_prepared(prepared, drop=not loaded)
        return response

    async def nccl_update(self, request: NcclUpdateRequest) -> WeightUpdateResponse:
        from rollout_server.weights import validate_nccl_announce

        announced = time.time()
        num_bytes = self._check_announce(validate_nccl_announce, request)
        return await self._announced_update(
            announced, request, num_bytes, "nccl", self.engine.receive_nccl_update
        )

    async def ipc_update(self, request: IpcUpdateRequest) -> WeightUpdateResponse:
        """Colocated sync: the buckets are CUDA IPC handles to the learner's GPU memory."""
        from rollout_server.weights import validate_ipc_announce

        announced = time.time()
        num_bytes = self._check_announce(validate_ipc_announce, request)
        return await self._announced_update(
            announced, request, num_bytes, "ipc", self.engine.receive_ipc_update
        )

    def _check_announce(self, validate: Callable[..., int], request: NcclUpdateRequest) -> int:
        """Refuse early (4xx, nothing paused) what could never load; returns its bytes."""
        self._require_weights_awake()
        self._refuse_if_prepared("another weight update")
        num_bytes = validate(request, self.engine.weight_metadata(), _ITEMSIZE)
        self._next_version(request.version)
        return num_bytes

    async def _announced_update(
        self,
        announced: float,
        request: NcclUpdateRequest,
        num_bytes: int,
        transport: str,
        receive: Callable[[Any], Awaitable[ReceivedUpdate]],
        *,
        gate_held: bool = False,
    ) -> WeightUpdateResponse:
        """Receive and load under the write gate (``gate_held``: taken since prepare); the
        version moves only once all loaded."""
        async with contextlib.nullcontext() if gate_held else self.gate.write():
            paused = {} if gate_held else {"paused": time.time()}
            self._require_weights_awake()
            new_version = self._next_version(request.version)
            start = time.perf_counter()
            got = await receive(request)
            if not got.prefix_cache_reset:
                await self.engine.reset_prefix_cache()
            seconds = time.perf_counter() - start
            self._set_version(new_version, (t.name for t in request.tensors))
        response = self._record_update(
            transport, len(request.tensors), num_bytes, seconds, got.checksum
        )
        timeline = {"announced": announced, **paused, **got.timeline, "answered": time.time()}
        return response.model_copy(
            update=dict(
                received_s=got.received_s,
                loaded_s=got.loaded_s,
                loader=got.loader,
                timeline=timeline,
            )
        )

    # --- sleep -----------------------------------------------------------------------------

    def sleep_status(self) -> SleepStatus:
        return SleepStatus(is_sleeping=bool(self.asleep), level=self.sleep_level)

    async def sleep(self, level: int) -> SleepStatus:
        self.require_loaded()
        self._refuse_if_prepared("sleep")
        async with self.gate.write():  # in-flight generations finish first
            self._refuse_if_prepared("sleep")
            await self.engine.sleep(level)
            self.sleep_level = max(self.sleep_level, level)
            self.asleep = {"weights", "kv_cache"}
            if level == 2:
                self.missing_weights = self.engine.required_weights()
            self.metrics.sleep_level.set(self.sleep_level)
        return self.sleep_status()

    async def wake_up(self, tags: list[str] | None) -> SleepStatus:
        self.require_loaded()
        self._refuse_if_prepared("wake_up")
        async with self.gate.write():
            await self.engine.wake_up(tags)
            self.asleep -= set(tags or ["weights", "kv_cache"])
            if not self.asleep:
                self.sleep_level = 0
            self.metrics.sleep_level.set(self.sleep_level)
        return self.sleep_status()
