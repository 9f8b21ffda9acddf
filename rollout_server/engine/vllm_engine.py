"""The production engine: vLLM's ``AsyncLLM`` on dedicated GPUs.

Everything vLLM-specific lives here, in ``vllm_helpers`` (the engine arguments, sampling
parameters, outputs and weight metadata, as pure functions), in ``vllm_updates`` (NCCL and CUDA
IPC updates through the workers) and in ``vllm_worker`` (the worker extension that receives
weights); vLLM is imported only when this engine starts. The server's core
(``rollout_server.core``) owns versions, the pause gate and the sleep bookkeeping; this class
translates requests and calls into vLLM.

Choices that matter for RL:

- Log-probs are vLLM's ``processed_logprobs`` (after penalties, temperature, top-k/top-p), i.e.
  under the distribution the token was sampled from, which the learner's importance-sampling
  correction needs. Only the sampled token's log-prob is requested (``logprobs=0``), in vLLM's
  flat form where it has one (``flat_logprobs``: no dict and object per token for the garbage
  collector to walk).
- ``weight_metadata`` describes the tensors a *learner* sends: the Hugging Face checkpoint names
  and full shapes (built on the meta device from the model's config). vLLM's own parameters are
  fused (``qkv_proj``) and sharded over tensor-parallel ranks, so they cannot validate an update;
  ``model.load_weights`` maps checkpoint names onto them.
- Weight loads (NCCL, HTTP, file) run with generation paused by the service. vLLM's own
  ``pause_generation`` is also called when requests are still in the engine (a safety net; it
  costs ~20 ms, so it is skipped when nothing is in flight, which is the normal case).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
import shutil
import tempfile
import threading
import uuid
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from rollout_server.engine.base import (
    Engine,
    EngineError,
    EngineInfo,
    HFTokenizerMixin,
    ReceivedUpdate,
    SampleOutput,
    TensorMeta,
    UnsupportedError,
)
from rollout_server.engine.vllm_helpers import (
    WORKER_EXTENSION,
    checkpoint_metadata,
    engine_kwargs,
    hf_weight_metadata,
    sampling_kwargs,
    served_sampling_kwargs,
    supported_kwargs,
    supports_flat_logprobs,
    to_sample,
)
from rollout_server.engine.vllm_lora import VllmAdapters, lora_engine_kwargs
from rollout_server.engine.vllm_updates import AnnouncedUpdates

if TYPE_CHECKING:
    import torch

    from rollout_server.protocol import (
        IpcUpdateRequest,
        LoraAdapterSpec,
        NcclInitRequest,
        NcclUpdateRequest,
        SamplingParams,
    )
    from rollout_server.settings import ServerSettings

# The helpers are re-exported from vllm_helpers: the tests and benchmarks import them from here.
__all__ = [
    "WORKER_EXTENSION",
    "VLLMEngine",
    "checkpoint_metadata",
    "engine_kwargs",
    "hf_weight_metadata",
    "sampling_kwargs",
    "served_sampling_kwargs",
    "supported_kwargs",
    "supports_flat_logprobs",
    "to_sample",
]

log = logging.getLogger(__name__)


class VLLMEngine(HFTokenizerMixin, Engine):
    name = "vllm"

    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        self._llm: Any = None
        self.tokenizer: Any = None
        self._info: EngineInfo | None = None
        self._metadata: dict[str, TensorMeta] = {}
        self._asleep: set[str] = set()
        self._sleep_level = 0  # level 2 discarded the served adapter's memory too
        self._in_flight = 0
        # NCCL and CUDA IPC updates through the workers (vLLM is reached when they run)
        self._updates = AnnouncedUpdates(
            self._rpc, self._paused, self.reset_prefix_cache, settings.direct_weight_copy
        )
        self._adapters = VllmAdapters(settings)  # the LoRA adapter served, if any
        # HF fast tokenizers are not safe to call from several threads at once ("Already
        # borrowed"), and the service tokenizes in worker threads; client prompts are encoded
        # with a copy of the tokenizer under a lock of their own (HFTokenizerMixin).
        self._tokenizer_lock = threading.Lock()
        self._client_lock = threading.Lock()

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        # The learner's side of the weight-sync group must use the same NCCL memory mode;
        # vLLM has long defaulted its workers to 0, pin it so both ends agree.
        os.environ.setdefault("NCCL_CUMEM_ENABLE", "0")
        # FlashInfer's top-k/top-p sampler cannot return processed log-probs; the native one can.
        os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
        try:
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.usage.usage_lib import UsageContext
            from vllm.v1.engine.async_llm import AsyncLLM
        except ImportError as exc:
            raise EngineError(
                f"the vllm engine needs vLLM ({exc}); install it with `pip install -e .[vllm]` "
                "or run with --engine transformers"
            ) from exc
        s = self.settings
        kwargs = {**lora_engine_kwargs(s), **engine_kwargs(s)}
        if s.weight_transfer_backend is not None:  # vLLM's RL routes (rollout_server.native)
            kwargs["weight_transfer_config"] = {"backend": s.weight_transfer_backend}
        args = AsyncEngineArgs(**supported_kwargs(AsyncEngineArgs, kwargs))
        # Built in the event loop, as vLLM's own server does (it binds its output tasks to the
        # running loop); the ~40 s of loading happen before the service reports ready.
        # A rollout server serves batches: vLLM's batch defaults (its offline LLM's usage
        # context: 1024 sequences, 16384 batched tokens on a >= 70 GB GPU), not the engine
        # context's 128 / 2048, which decoded a 256 x 8 request 128 sequences at a time.
        self._llm = AsyncLLM.from_engine_args(args, usage_context=UsageContext.LLM_CLASS)
        self.tokenizer, self._metadata = await asyncio.gather(
            asyncio.to_thread(self._load_tokenizer),
            asyncio.to_thread(hf_weight_metadata, s.model, self._dtype_name(), s.trust_remote_code),
        )
        self._info = self._build_info()

    def _load_tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(
            self.settings.model, trust_remote_code=self.settings.trust_remote_code
        )

    def _dtype_name(self) -> str:
        return str(self._llm.model_config.dtype).removeprefix("torch.")

    def _build_info(self) -> EngineInfo:
        mc = self._llm.model_config
        eos: list[int] = []
        gen = mc.try_get_generation_config() if hasattr(mc, "try_get_generation_config") else {}
        for value in ((gen or {}).get("eos_token_id"), self.tokenizer.eos_token_id):
            for token in value if isinstance(value, list) else [value]:
                if token is not None and int(token) not in eos:
                    eos.append(int(token))
        s = self.settings
        sched = self._llm.vllm_config.scheduler_config
        return EngineInfo(
            model=s.name,
            engine=self.name,
            dtype=self._dtype_name(),
            device="cuda",
            max_model_len=int(mc.max_model_len),
            vocab_size=int(mc.get_vocab_size()),
            eos_token_ids=eos,
            tensor_parallel_size=s.tensor_parallel_size,
            data_parallel_size=s.data_parallel_size,
            weight_transports=["http", "file", "nccl"],
            max_num_seqs=int(sched.max_num_seqs),
            max_batch_tokens=int(sched.max_num_batched_tokens),
        )

    async def close(self) -> None:
        if self._llm is not None:
            with contextlib.suppress(Exception):
                await self._rpc("grpo_close_weight_group")
            self._llm.shutdown()
            self._llm = None
        self._adapters.close()

    def info(self) -> EngineInfo:
        if self._info is None:
            raise EngineError("the vllm engine has not started")
        return self._info

    # -- tokens ----------------------------------------------------------------------------

    # -- generation ------------------------------------------------------------------------

    async def generate(
        self, prompts: list[list[int]], n: int, params: SamplingParams
    ) -> list[list[SampleOutput]]:
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.sampling_params import RequestOutputKind

        if self._asleep:
            raise EngineError("the vllm engine is asleep; POST /wake_up first")
        kwargs = served_sampling_kwargs(params, n)
        try:
            sp = VLLMSamplingParams(**kwargs, output_kind=RequestOutputKind.FINAL_ONLY)
            per_prompt = [sp] * len(prompts)
            if params.seed is not None:  # prompt k: seed + k * n; vLLM gives its sample i + i
                per_prompt = [
                    VLLMSamplingParams(
                        **{**kwargs, "seed": params.seed + k * n},
                        output_kind=RequestOutputKind.FINAL_ONLY,
                    )
                    for k in range(len(prompts))
                ]
        except (ValueError, TypeError) as exc:  # e.g. vLLM's temperature limit (<= 2)
            from rollout_server.errors import BadRequest

            raise BadRequest(f"vLLM refused the sampling parameters: {exc}") from exc
        self._in_flight += 1
        try:
            async with asyncio.TaskGroup() as tg:  # one failure cancels (aborts) the rest
                tasks = [
                    tg.create_task(self._one(ids, p))
                    for ids, p in zip(prompts, per_prompt, strict=True)
                ]
        except ExceptionGroup as group:
            first = group.exceptions[0]
            if isinstance(first, ValueError):  # vLLM's request validation: the caller's mistake
                from rollout_server.errors import BadRequest

                raise BadRequest(f"vLLM refused the request: {first}") from first
            raise EngineError(f"vLLM generation failed: {type(first).__name__}: {first}") from first
        finally:
            self._in_flight -= 1
        return [t.result() for t in tasks]

    async def _one(self, prompt_ids: list[int], sp: Any) -> list[SampleOutput]:
        final = None
        request_id = uuid.uuid4().hex
        try:
            lora = self._adapters.request  # read once: a switch waits for this request (the gate)
            async for out in self._llm.generate(
                {"prompt_token_ids": prompt_ids}, sp, request_id, lora_request=lora
            ):
                final = out
        except asyncio.CancelledError:  # the client went away or the server stops: free the slots
            await self._llm.abort(request_id)
            raise
        if final is None:
            raise EngineError("vLLM returned no output for a request")
        want = sp.logprobs is not None
        return [to_sample(c, want) for c in sorted(final.outputs, key=lambda c: c.index)]

    # -- weights ---------------------------------------------------------------------------

    def weight_metadata(self) -> dict[str, TensorMeta]:
        return self._metadata

    async def _rpc(self, method: str, *args: Any) -> list[Any]:
        return await self._llm.collective_rpc(method, args=args)

    @contextlib.asynccontextmanager
    async def _paused(self):
        """vLLM's own pause around a load, when anything is still in the engine."""
        pause = getattr(self._llm, "pause_generation", None)
        if pause is None or self._in_flight == 0:
            yield
            return
        params = inspect.signature(pause).parameters
        await (pause(mode="wait") if "mode" in params else pause(wait_for_inflight_requests=True))
        try:
            yield
        finally:
            await self._llm.resume_generation()

    async def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """HTTP/file transports: the validated CPU tensors go to the workers through a
        safetensors file in shared memory (every TP worker reads it; no giant RPC message)."""
        from safetensors.torch import save_file

        tensors = {name: t.contiguous() for name, t in tensors}
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        fd, path = tempfile.mkstemp(suffix=".safetensors", dir=_staging_dir(nbytes))
        os.close(fd)
        try:
            await asyncio.to_thread(save_file, tensors, path)
            async with self._paused():
                await self._rpc("grpo_load_file", path)
        finally:
            with contextlib.suppress(OSError):
                os.unlink(path)
        await self._adapters.drop(self._llm)  # full weights: the policy they are, served alone

    async def load_adapter(
        self, spec: LoraAdapterSpec, tensors: dict[str, torch.Tensor], version: int
    ) -> None:
        """Through vLLM's LoRA support: loaded into the engine, then generation switches to it
        (``vllm_lora``)."""
        async with self._paused():
            await self._adapters.load(self._llm, spec, tensors, version)

    def check_adapter(self, spec: LoraAdapterSpec) -> None:
        self._adapters.check(spec)

    def served_lora_rank(self) -> int | None:
        return self._adapters.rank

    async def weights_checksum(self) -> float:
        if self._adapters.request is not None:
            raise UnsupportedError(
                "weights_checksum with a LoRA adapter served: vLLM keeps the adapter apart from "
                "the base weights, so their merged digest is not computed on this engine"
            )
        if self.settings.tensor_parallel_size > 1:
            raise UnsupportedError(
                "weights_checksum with tensor parallelism: shards replicate some tensors, so "
                "their sum is not the model's; compare NCCL checksums of the received bytes"
            )
        return (await self._rpc("grpo_params_checksum"))[0]

    async def reset_prefix_cache(self) -> None:
        await self._llm.reset_prefix_cache()

    async def init_weight_group(self, request: NcclInitRequest) -> None:
        rank_offset = getattr(request, "rank_offset", 1)
        await self._rpc(
            "grpo_init_weight_group",
            request.master_address,
            request.master_port,
            rank_offset,
            request.world_size,
            request.timeout_s,
        )

    async def receive_nccl_update(self, request: NcclUpdateRequest) -> ReceivedUpdate:
        if request.adapter is not None:  # the first worker writes it where vLLM loads it from
            return await self._adapters.receive(
                self._llm, request.adapter, lambda d: self._updates.receive_nccl(request, str(d))
            )
        received = await self._updates.receive_nccl(request)
        await self._adapters.drop(self._llm)  # full weights: served alone
        return received

    async def prepare_nccl_update(self, request: NcclUpdateRequest) -> None:
        await self._updates.prepare_nccl(request)

    async def commit_nccl_update(self, request: NcclUpdateRequest) -> ReceivedUpdate:
        received = await self._updates.commit_nccl(request)
        await self._adapters.drop(self._llm)  # full weights: served alone
        return received

    async def cancel_nccl_commit(self) -> bool:
        return self._updates.cancel_commit()

    async def drop_prepared_update(self) -> None:
        await self._updates.drop_prepared()

    async def receive_ipc_update(self, request: IpcUpdateRequest) -> ReceivedUpdate:
        if request.adapter is not None:
            return await self._adapters.receive(
                self._llm, request.adapter, lambda d: self._updates.receive_ipc(request, str(d))
            )
        received = await self._updates.receive_ipc(request)
        await self._adapters.drop(self._llm)  # full weights: served alone
        return received

    # -- vLLM's own RL weight transfer (--weight-transfer-backend) --------------------------
    # Handed to vLLM's engine as its api_router does; the tensors load as they arrive (vLLM's
    # semantics), the server's version moves at finish (rollout_server.native).

    def _require_weight_transfer(self) -> None:
        if self.settings.weight_transfer_backend is None:
            raise UnsupportedError(
                "vLLM's weight-transfer routes need a backend: restart the server with "
                "--weight-transfer-backend nccl (or ipc)"
            )

    async def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        self._require_weight_transfer()
        await self._llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init_info))

    async def start_weight_update(self, is_checkpoint_format: bool) -> None:
        self._require_weight_transfer()
        await self._llm.start_weight_update(is_checkpoint_format=is_checkpoint_format)

    async def update_weights(self, update_info: dict[str, Any]) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        self._require_weight_transfer()
        await self._llm.update_weights(request=WeightTransferUpdateRequest(update_info=update_info))

    async def finish_weight_update(self) -> None:
        self._require_weight_transfer()
        await self._llm.finish_weight_update()
        await self._llm.reset_prefix_cache()
        await self._adapters.drop(self._llm)  # full weights: served alone

    def world_size(self, include_dp: bool) -> int:
        """vLLM's workers: TP x PP, times DP with ``include_dp`` (its /get_world_size)."""
        parallel = self._llm.vllm_config.parallel_config
        return int(parallel.world_size_across_dp if include_dp else parallel.world_size)

    # -- sleep -----------------------------------------------------------------------------

    async def sleep(self, level: int) -> None:
        if not self.settings.enable_sleep_mode:
            raise UnsupportedError(
                "sleep needs vLLM's sleep mode: restart the server with enable_sleep_mode on"
            )
        if self._asleep:
            log.info("sleep(level=%d) ignored: already asleep", level)
            return
        await self._rpc("grpo_release_staging")  # kept NCCL staging is not vLLM's to offload
        params = inspect.signature(self._llm.sleep).parameters
        await (self._llm.sleep(level, mode="wait") if "mode" in params else self._llm.sleep(level))
        self._asleep = {"weights", "kv_cache"}
        self._sleep_level = level

    async def wake_up(self, tags: list[str] | None = None) -> None:
        if not self._asleep:
            return
        await self._llm.wake_up(tags)
        if self._sleep_level == 2 and "weights" in (tags or ["weights"]):
            await self._adapters.reload(self._llm)
        self._asleep -= set(tags or ["weights", "kv_cache"])
        if not self._asleep:
            self._sleep_level = 0
        if "kv_cache" not in self._asleep:
            await self._llm.reset_prefix_cache()  # the cached blocks' memory was dropped

    def is_sleeping(self) -> bool:
        return bool(self._asleep)


def _staging_dir(nbytes: int) -> str:
    """/dev/shm when it has room (RAM-backed, fast), else the temp directory."""
    shm = "/dev/shm"
    with contextlib.suppress(OSError):
        if shutil.disk_usage(shm).free > 2 * nbytes:
            return shm
    return tempfile.gettempdir()
