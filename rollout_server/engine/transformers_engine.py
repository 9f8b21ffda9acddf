"""``TransformersEngine``: a real Hugging Face causal LM on CPU (or a small GPU).

The embedded default and the engine the tests run: it samples with our own KV-cached decode loop
(``decode.py``) rather than ``model.generate``, because we need the log-prob of each sampled
token under the final sampling distribution (after temperature, top-k, top-p and min-p).

Concurrency: ``generate`` splits a request into rows (prompt x sample) and queues them; one
batcher task drains the queue into batches that a single worker thread decodes, so concurrent
requests share forward passes and the event loop never blocks. Weight loads and sleep/wake run
on the same worker thread, after the app has paused generation.

Sleep on this engine is honest about the hardware: level 1 moves the weights to CPU (a no-op for
a CPU model, which simply reports itself asleep) and there is no persistent KV cache to drop;
level 2 frees the parameter storage, and wake-up reallocates it zero-filled, so the weights must
be synced again before generating (a served LoRA adapter is small: its values are kept and
restored).

LoRA adapter updates are served through PEFT (``peft_adapter.ServedAdapter``).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import random
import threading
from collections import deque
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from grpo_common.moe import find_routers
from rollout_server.engine.base import (
    Engine,
    EngineError,
    EngineInfo,
    HFTokenizerMixin,
    SampleOutput,
    TensorMeta,
)
from rollout_server.engine.decode import Row, decode_rows
from rollout_server.engine.peft_adapter import ServedAdapter

if TYPE_CHECKING:
    from rollout_server.protocol import LoraAdapterSpec, SamplingParams
    from rollout_server.settings import ServerSettings

log = logging.getLogger(__name__)

# Batch limits when the settings give none (rows decoded together, padded prompt tokens).
DEFAULT_MAX_NUM_SEQS = 256
DEFAULT_MAX_BATCH_TOKENS = 32768


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, dtype)


class _Job:
    """One ``generate`` call: its rows finish independently, the future resolves with all."""

    def __init__(self, num_rows: int) -> None:
        self.future: asyncio.Future[list[SampleOutput]] = asyncio.get_running_loop().create_future()
        self.outputs: list[SampleOutput | None] = [None] * num_rows
        self.remaining = num_rows

    def put(self, index: int, output: SampleOutput) -> None:
        self.outputs[index] = output
        self.remaining -= 1
        if self.remaining == 0 and not self.future.done():
            self.future.set_result([o for o in self.outputs if o is not None])

    def cancelled(self) -> bool:
        """Its caller was cancelled (read by the decode thread between steps)."""
        return self.future.cancelled()

    def fail(self, exc: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(exc)


@dataclass
class _Queued:
    row: Row
    job: _Job
    index: int


class TransformersEngine(HFTokenizerMixin, Engine):
    name = "transformers"

    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        self.device = resolve_device(settings.device)
        self.dtype = resolve_dtype(settings.dtype, self.device)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="transformers-engine")
        self._tokenizer_lock = threading.Lock()  # HF fast tokenizers are not thread-safe
        self._client_lock = threading.Lock()  # client prompts: a copy of the tokenizer
        self._rng = random.Random(settings.seed)
        self.max_num_seqs = settings.max_num_seqs or DEFAULT_MAX_NUM_SEQS
        self.max_batch_tokens = settings.max_batch_tokens or DEFAULT_MAX_BATCH_TOKENS
        self._queue: deque[_Queued] = deque()
        self._wakeup = asyncio.Event()
        self._batcher: asyncio.Task[None] | None = None
        self._closing = False  # read by the decode thread: stop every row at the next step
        self._asleep: set[str] = set()
        self._sleep_level = 0
        self.model: Any = None
        self.tokenizer: Any = None
        self._adapter: ServedAdapter | None = None
        self._freed_shapes: dict[str, tuple[int, ...]] = {}  # level 2: each parameter's shape

    # --- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        await self._run(self._load)
        self._wakeup = asyncio.Event()
        self._batcher = asyncio.create_task(self._batch_loop(), name="transformers-batcher")

    def _load(self) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        s = self.settings
        self.tokenizer = AutoTokenizer.from_pretrained(
            s.model, trust_remote_code=s.trust_remote_code
        )
        model = AutoModelForCausalLM.from_pretrained(
            s.model, trust_remote_code=s.trust_remote_code, **_dtype_kwarg(self.dtype)
        )
        self.model = model.to(self.device).eval().requires_grad_(False)
        _own_weights(model)
        self._adapter = ServedAdapter(self.model)
        config = model.config.get_text_config()
        self.vocab_size = int(config.vocab_size)
        self.max_model_len = s.max_model_len or int(config.max_position_embeddings)
        self.eos_token_ids = _eos_ids(model, self.tokenizer)
        self.pad_id = self.tokenizer.pad_token_id
        if self.pad_id is None:
            self.pad_id = self.eos_token_ids[0] if self.eos_token_ids else 0
        self._metadata = {
            name: TensorMeta(dtype_name(t.dtype), tuple(t.shape))
            for name, t in model.state_dict().items()
        }
        self._param_names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
        self._required = {n for n, _ in model.named_parameters()}  # tied ones once, no buffers

    async def close(self) -> None:
        self._closing = True  # the batch being decoded stops at its next step
        if self._batcher is not None:
            self._batcher.cancel()
            await asyncio.gather(self._batcher, return_exceptions=True)
        while self._queue:
            self._queue.popleft().job.fail(EngineError("the engine was shut down"))
        self._executor.shutdown(wait=True, cancel_futures=True)  # the decode stops at a step
        self.model = None

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def info(self) -> EngineInfo:
        return EngineInfo(
            model=self.settings.name,
            engine=self.name,
            dtype=dtype_name(self.dtype),
            device=str(self.device),
            max_model_len=self.max_model_len,
            vocab_size=self.vocab_size,
            eos_token_ids=list(self.eos_token_ids),
            weight_transports=["http", "file"],
            max_num_seqs=self.max_num_seqs,
            max_batch_tokens=self.max_batch_tokens,
        )

    def routed_experts_refusal(self) -> str | None:
        if not find_routers(self.model):
            return "the served model has no mixture-of-experts routers (a dense model)"
        return None

    # --- tokens ----------------------------------------------------------------------------

    # --- generation ------------------------------------------------------------------------

    async def generate(
        self, prompts: list[list[int]], n: int, params: SamplingParams
    ) -> list[list[SampleOutput]]:
        if self._asleep:
            raise EngineError("the engine is asleep; POST /wake_up first")
        stop_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else frozenset(self.eos_token_ids)
        )
        job = _Job(len(prompts) * n)

        def stopped() -> bool:  # the call was cancelled (client gone) or the server is stopping
            return self._closing or job.cancelled()

        rows = []
        for k, prompt in enumerate(prompts):
            for i in range(n):  # prompt k's sample i: seed + k * n + i (docs/api.md)
                seed = (
                    params.seed + k * n + i
                    if params.seed is not None
                    else self._rng.getrandbits(63)
                )
                budget = min(params.max_tokens, self.max_model_len - len(prompt))
                rows.append(Row(prompt, params, seed, max(budget, 1), stop_ids, stopped))
        self._queue.extend(_Queued(row, job, i) for i, row in enumerate(rows))
        self._wakeup.set()
        outputs = await job.future
        return [outputs[k * n : (k + 1) * n] for k in range(len(prompts))]

    async def _batch_loop(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while self._queue:
                batch = self._take_batch()
                if not batch:
                    continue
                try:
                    outputs = await self._run(self._decode, [q.row for q in batch])
                except Exception as exc:  # a fault of the engine: fail those requests, go on
                    log.exception("generation failed")
                    error = EngineError(f"generation failed: {type(exc).__name__}: {exc}")
                    for q in batch:
                        q.job.fail(error)
                else:
                    for q, out in zip(batch, outputs, strict=True):
                        q.job.put(q.index, out)

    def _take_batch(self) -> list[_Queued]:
        """FIFO rows up to ``max_num_seqs`` rows and ``max_batch_tokens`` padded prompt tokens
        (rows sharing a prompt prefill it once)."""
        batch: list[_Queued] = []
        prompts: set[int] = set()
        width = 0
        while self._queue:
            q = self._queue[0]
            if q.job.future.done():  # cancelled by its caller
                self._queue.popleft()
                continue
            new_width = max(width, len(q.row.prompt))
            num_prompts = len(prompts | {id(q.row.prompt)})
            too_many = len(batch) >= self.max_num_seqs
            too_long = num_prompts * new_width > self.max_batch_tokens
            if batch and (too_many or too_long):
                break
            batch.append(self._queue.popleft())
            prompts.add(id(q.row.prompt))
            width = new_width
        return batch

    def _decode(self, rows: list[Row]) -> list[SampleOutput]:
        return decode_rows(self.model, rows, pad_id=self.pad_id, detokenize=self.decode)

    # --- weights ---------------------------------------------------------------------------

    def weight_metadata(self) -> dict[str, TensorMeta]:
        return self._metadata

    def required_weights(self) -> set[str]:
        """Level 2 frees the parameters (buffers stay), tied ones once."""
        return set(self._required)

    async def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        await self._run(self._copy_weights, list(tensors))

    def _target(self, name: str, adapter: ServedAdapter) -> torch.Tensor:
        if name in self._param_names:
            return self.model.get_parameter(adapter.param_path(name)).data
        return self.model.get_buffer(name)

    def _copy_weights(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        adapter = self._served_adapter()
        with torch.no_grad():
            for name, tensor in tensors:
                self._target(name, adapter).copy_(tensor)
        adapter.drop()  # full weights: the policy they are is served alone

    async def snapshot_weights(self, names: Iterable[str]) -> object | None:
        """A copy of the named tensors (in the model's memory: a full update's doubles it
        while it loads); None while an adapter is served (a full update drops it, and the copy
        would bring back the base weights without it)."""
        adapter = self._served_adapter()
        if adapter.rank is not None:
            return None

        def copy() -> dict[str, torch.Tensor]:
            with torch.no_grad():
                return {name: self._target(name, adapter).clone() for name in set(names)}

        return await self._run(copy)

    async def restore_weights(self, snapshot: object) -> None:
        assert isinstance(snapshot, dict)
        await self._run(self._copy_weights, list(snapshot.items()))

    async def load_adapter(
        self, spec: LoraAdapterSpec, tensors: dict[str, torch.Tensor], version: int
    ) -> None:
        await self._run(self._served_adapter().load, spec, tensors, version)

    def check_adapter(self, spec: LoraAdapterSpec) -> None:
        return None  # PEFT serves any adapter the validation let through

    def served_lora_rank(self) -> int | None:
        return self._adapter.rank if self._adapter is not None else None

    def _served_adapter(self) -> ServedAdapter:
        if self._adapter is None:
            raise EngineError("the transformers engine has not started")
        return self._adapter

    async def weights_checksum(self) -> float:
        """Of the weights served with: an adapter's delta merged into its base weights (what
        the learner's merged model holds)."""
        from rollout_server.weight_digest import named_checksum

        def digest() -> float:
            with torch.no_grad():
                return named_checksum(self._served_adapter().effective_weights())

        return await self._run(digest)

    # --- sleep -----------------------------------------------------------------------------

    async def sleep(self, level: int) -> None:
        await self._run(self._sleep, level)

    def _sleep(self, level: int) -> None:
        if level == 2:
            if self._sleep_level < 2:
                self._freed_shapes = {n: tuple(p.shape) for n, p in self.model.named_parameters()}
            for p in self.model.parameters():  # tied weights are one Parameter: freed once
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        elif self.device.type != "cpu":
            self.model.to("cpu")
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self._sleep_level = max(self._sleep_level, level)
        self._asleep = {"weights", "kv_cache"}

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self._run(self._wake_up, tags)

    def _wake_up(self, tags: list[str] | None) -> None:
        tags = list(tags or ["weights", "kv_cache"])
        if "weights" in tags and "weights" in self._asleep:
            if self._sleep_level == 2:
                for name, p in self.model.named_parameters():
                    shape = self._freed_shapes[name]
                    p.data = torch.zeros(shape, dtype=p.dtype, device=self.device)
                self._served_adapter().restore()  # the adapter is small: kept, not discarded
            else:
                self.model.to(self.device)
        self._asleep -= set(tags)
        if not self._asleep:
            self._sleep_level = 0

    def is_sleeping(self) -> bool:
        return bool(self._asleep)


def _own_weights(model: torch.nn.Module) -> None:
    """Copy into memory of their own the CPU parameters that still map the checkpoint file.

    transformers (5.2x) leaves a CPU model's parameters on the safetensors file's mapping, at the
    file's offsets (8-byte aligned), while a weight update after a level-2 sleep (and the
    learner's tensors) sit in PyTorch's 64-byte-aligned allocations; the CPU matmul kernels
    take other paths for the two, so the same weights served log-probs that differed in the
    last bits once reloaded. Owned, aligned copies make every load serve what the first did."""
    with torch.no_grad():
        for p in model.parameters():
            if p.device.type == "cpu" and p.data_ptr() % 64:
                p.data = p.data.clone()


def _dtype_kwarg(dtype: torch.dtype) -> dict[str, torch.dtype]:
    """transformers renamed ``torch_dtype`` to ``dtype`` in 4.56."""
    import transformers

    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    return {"dtype": dtype} if (major, minor) >= (4, 56) else {"torch_dtype": dtype}


def _eos_ids(model: Any, tokenizer: Any) -> list[int]:
    ids: list[int] = []
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for value in (gen_eos, model.config.get_text_config().eos_token_id, tokenizer.eos_token_id):
        for token in value if isinstance(value, list) else [value]:
            if token is not None and int(token) not in ids:
                ids.append(int(token))
    return ids
