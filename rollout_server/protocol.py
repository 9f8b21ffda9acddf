"""The wire contract of the rollout server: typed pydantic models shared by server and client.

Everything that crosses the HTTP boundary is defined here and nowhere else. Importing this module
must stay cheap: no torch, no vLLM, no engine code (the learner imports it on every rank).

Token ids are the source of truth: a prompt given as text or chat messages is tokenized once by the
server, and its ids are returned so the learner never re-tokenizes.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

FinishReason = Literal["stop", "length", "abort"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ChatMessage(BaseModel):
    """One chat message. Extra keys (``tool_calls``, ``name``, ``tool_call_id``) pass through to
    the chat template unchanged."""

    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = ""


PromptInput = Annotated[
    list[int] | str | list[ChatMessage],
    Field(description="token ids, raw text, or a list of chat messages"),
]


class SamplingParams(_Model):
    """Sampling parameters, with vLLM's meaning. ``top_k`` <= 0 and ``min_p`` = 0 disable them.

    Strict types (JSON's, with ints allowed where floats are meant): ``"n": true`` or
    ``"max_tokens": 2.0`` is a 422, not a silent 1 or 2."""

    model_config = ConfigDict(extra="forbid", strict=True)

    temperature: float = Field(1.0, ge=0.0, le=100.0, description="0 means greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1, description="-1 or 0 disables top-k")
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    max_tokens: int = Field(256, ge=1, description="completion tokens per sample")
    stop: list[str] = Field(default_factory=list, description="stop strings (not included)")
    stop_token_ids: list[int] = Field(default_factory=list, description="extra stop token ids")
    ignore_eos: bool = False
    seed: int | None = Field(
        None,
        description="same seed + same weights + same request = same output; prompt k's "
        "sample i draws from seed + k * n + i",
    )
    logprobs: bool = Field(
        True,
        description="return each sampled token's log-prob; false spares vLLM the work and "
        "returns empty logprobs lists",
    )

    @model_validator(mode="before")
    @classmethod
    def _stop_as_list(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("stop"), str):
            data = {**data, "stop": [data["stop"]]}
        return data


class GenerateRequest(SamplingParams):
    """``POST /generate``: ``n`` samples for each prompt of a batch."""

    prompts: list[PromptInput] = Field(min_length=1)
    n: int = Field(1, ge=1, description="samples per prompt")
    add_generation_prompt: bool = Field(True, description="for chat prompts")
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    tools: list[dict[str, Any]] | None = Field(
        None, description="tool schemas passed to the chat template (chat prompts only)"
    )

    def sampling(self) -> SamplingParams:
        return SamplingParams.model_validate(
            self.model_dump(include=set(SamplingParams.model_fields))
        )


class Sample(_Model):
    token_ids: list[int]
    logprobs: list[float] = Field(
        description="log-prob of each sampled token under the sampling distribution; "
        "empty when the request set logprobs=false"
    )
    text: str
    finish_reason: FinishReason
    weight_version: int


class PromptResult(_Model):
    prompt_token_ids: list[int]
    samples: list[Sample]


class GenerateResponse(_Model):
    results: list[PromptResult]
    weight_version: int = Field(description="version of the weights that produced every sample")
    server: str | None = Field(None, description="filled in by the client: which server answered")


class Limits(_Model):
    """Input limits the server enforces; a violation is a 4xx that names the limit."""

    max_n: int = Field(64, ge=1)
    max_tokens: int = Field(4096, ge=1)
    max_prompt_len: int = Field(8192, ge=1, description="prompt tokens")
    max_batch_size: int = Field(512, ge=1, description="prompts per request")
    max_body_mb: int = Field(4096, ge=1, description="request body size, MB (weight buckets)")


class InfoResponse(_Model):
    model: str
    engine: str
    dtype: str
    device: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    weight_version: int
    sleeping: bool
    sleep_level: int
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    max_num_seqs: int | None = Field(None, description="sequences the engine decodes together")
    max_batch_tokens: int | None = Field(None, description="prompt tokens prefilled in one step")
    limits: Limits
    weight_transports: list[str]


class SleepRequest(_Model):
    level: Literal[1, 2] = Field(
        1, description="1: weights to CPU, KV cache dropped; 2: both dropped (re-sync weights)"
    )


class WakeUpRequest(_Model):
    tags: list[Literal["weights", "kv_cache"]] | None = None


class SleepStatus(_Model):
    is_sleeping: bool
    level: int = 0


class TensorSpec(_Model):
    name: str
    dtype: str = Field(description="torch dtype name without the prefix, e.g. 'bfloat16'")
    shape: list[int]


class WeightFileRequest(_Model):
    """``POST /weights/load_file``: a safetensors file, or a directory of them, on a disk the
    server can read (shared volume)."""

    path: str
    version: int | None = Field(None, description="version to set; default current + 1")


class WeightUpdateBegin(_Model):
    """Open an HTTP update sent in several buckets; nothing is applied until commit.

    The bucket count may be unknown here (the learner streams buckets out of a ZeRO-3 gather);
    the commit names it, and the server refuses the commit if any bucket is missing."""

    version: int | None = None


class WeightUpdateId(_Model):
    update_id: str


class WeightUpdateCommit(WeightUpdateId):
    num_buckets: int = Field(ge=1, description="buckets 0..num_buckets-1 must all be staged")


class NcclInitRequest(_Model):
    """Join the weight-sync process group: the learner is rank 0, server workers follow."""

    master_address: str
    master_port: int = Field(ge=1, le=65535)
    world_size: int = Field(ge=2)
    rank_offset: int = Field(
        1, ge=1, description="this server's first worker rank (1 + workers of earlier servers)"
    )
    timeout_s: float = Field(300.0, gt=0)


class NcclUpdateRequest(_Model):
    """One announce for a whole NCCL update: every tensor and the bucket layout. Bucket ``b``
    is a flat buffer of ``dtype`` holding the listed tensors back to back, in order."""

    tensors: list[TensorSpec]
    buckets: list[list[int]] = Field(description="indices into tensors, per bucket")
    bucket_dtypes: list[str]
    version: int | None = None
    checksum: bool = Field(False, description="return a float64 checksum of the loaded weights")
    segment_bytes: int = Field(
        64 << 20,
        ge=1 << 16,
        description="NCCL: each bucket is broadcast in runs of whole tensors of at most this "
        "many bytes (a larger tensor alone), so that packing, the wire and loading overlap",
    )
    ack: bool = Field(
        False,
        description="NCCL: after the commit word, every worker and the learner join one int32 "
        "sum all-reduce: a worker adds 1 once the update is in its parameters (0 if it failed "
        "to load it), so the learner knows the weights are loaded without the HTTP answer",
    )


class NcclPrepared(_Model):
    """``POST /weights/nccl/prepare``'s answer: the workers wait for this update's broadcast,
    generation paused; ``POST /weights/nccl/commit`` with this id loads it."""

    prepared_id: str
    num_bytes: int
    expires_s: float = Field(description="dropped (and the group aborted) if not committed by then")


class NcclCommitRequest(_Model):
    prepared_id: str


class IpcHandle(_Model):
    """A CUDA IPC handle to one flat bucket in the learner's GPU memory (``rollout_server.
    cuda_ipc``); byte strings in base64."""

    dtype: str
    numel: int = Field(ge=1)
    stride: int = Field(1, ge=1)
    tensor_offset: int = Field(0, ge=0)
    handle: str
    storage_bytes: int = Field(ge=1)
    storage_offset_bytes: int = Field(0, ge=0)
    ref_counter_handle: str
    ref_counter_offset: int = Field(0, ge=0)
    event_handle: str | None = None
    event_sync_required: bool = False


class IpcUpdateRequest(NcclUpdateRequest):
    """``POST /weights/ipc/update``: an update whose buckets are CUDA IPC handles to the
    learner's memory on the server's own GPU (colocated mode). Same layout as an NCCL announce;
    ``handles[b]`` holds bucket ``b``."""

    handles: list[IpcHandle]
    gpu_uuid: str = Field(description="the learner's GPU (torch.cuda.get_device_properties.uuid)")


class WeightUpdateResponse(_Model):
    weight_version: int
    num_tensors: int
    num_bytes: int
    seconds: float
    checksum: float | None = None
    # NCCL / CUDA IPC updates: where the server's ``seconds`` went, and how it loaded
    received_s: float | None = None
    loaded_s: float | None = None
    loader: str | None = None
    # wall-clock time (time.time()) of each stage on the server, for profiling a sync
    timeline: dict[str, float] | None = None


class WeightChecksum(_Model):
    """``GET /weights/checksum``: float64 sum(x) + sum(x*x) over every served parameter (a
    shared one once), layout-independent: compare it with the learner's over its parameters
    (``rollout_server.nccl_wire.params_checksum``)."""

    weight_version: int
    checksum: float


class ErrorResponse(_Model):
    detail: str


class HealthResponse(_Model):
    status: Literal["ok"] = "ok"
