"""The wire models of weight updates: HTTP buckets, a file, NCCL announces, CUDA IPC handles."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, field_validator

from rollout_server.protocol.base import INT64_MAX, Version, WireModel, refuse_lone_surrogates

INT32_MAX = 2**31 - 1
MAX_BUCKETS = 1 << 20
"""The most buckets one update may have (``num_buckets`` at commit, bucket indices below it):
a count a client names costs the server nothing until that many buckets actually arrived."""


class TensorSpec(WireModel):
    name: str
    dtype: str = Field(description="torch dtype name without the prefix, e.g. 'bfloat16'")
    shape: list[Annotated[int, Field(ge=0, le=INT64_MAX)]]


class LoraAdapterSpec(WireModel):
    """Marks an update as a LoRA adapter: its tensors are the ``lora_A``/``lora_B`` weights under
    PEFT's names (``base_model.model.<module>.lora_A.weight``, as ``get_peft_model_state_dict``
    gives them), served on top of the base weights the server holds instead of replacing them.
    A later full update serves the base weights alone again."""

    r: int = Field(ge=1, le=65536, description="the adapters' rank")
    lora_alpha: float = Field(
        gt=0, allow_inf_nan=False, description="the update is scaled by lora_alpha / r"
    )
    target_modules: list[str] = Field(
        min_length=1,
        description="the adapted modules: full module names or their last components",
    )
    peft_config: dict[str, Any] = Field(
        default_factory=dict,
        description="the PEFT LoraConfig as JSON (adapter_config.json), written with the adapter; "
        "r, lora_alpha and target_modules above take precedence",
    )


class WeightFileRequest(WireModel):
    """``POST /weights/load_file``: a safetensors file, or a directory of them, on a disk the
    server can read (shared volume)."""

    path: str
    version: Version | None = Field(None, description="version to set; default current + 1")
    adapter: LoraAdapterSpec | None = Field(
        None, description="the file holds a LoRA adapter, not base weights"
    )

    @field_validator("path")
    @classmethod
    def _valid_unicode(cls, path: str) -> str:
        refuse_lone_surrogates(path)
        return path


class WeightUpdateBegin(WireModel):
    """Open an HTTP update sent in several buckets; nothing is applied until commit.

    The bucket count may be unknown here (the learner streams buckets out of a ZeRO-3 gather);
    the commit names it, and the server refuses the commit if any bucket is missing."""

    version: Version | None = None
    adapter: LoraAdapterSpec | None = Field(
        None, description="the buckets hold a LoRA adapter, not base weights"
    )


class WeightUpdateId(WireModel):
    update_id: str


class WeightUpdateCommit(WeightUpdateId):
    num_buckets: int = Field(
        ge=1, le=MAX_BUCKETS, description="buckets 0..num_buckets-1 must all be staged"
    )


class NcclInitRequest(WireModel):
    """Join the weight-sync process group: the learner is rank 0, server workers follow."""

    master_address: str
    master_port: int = Field(ge=1, le=65535)
    world_size: int = Field(ge=2, le=INT32_MAX, description="NCCL ranks are int32")
    rank_offset: int = Field(
        1,
        ge=1,
        le=INT32_MAX,
        description="this server's first worker rank (1 + workers of earlier servers)",
    )
    timeout_s: float = Field(300.0, gt=0, le=86400.0, allow_inf_nan=False)


class NcclUpdateRequest(WireModel):
    """One announce for a whole NCCL update: every tensor and the bucket layout. Bucket ``b``
    is a flat buffer of ``dtype`` holding the listed tensors back to back, in order."""

    tensors: list[TensorSpec]
    buckets: list[list[int]] = Field(description="indices into tensors, per bucket")
    bucket_dtypes: list[str]
    version: Version | None = None
    checksum: bool = Field(False, description="return a float64 digest of the received buckets")
    segment_bytes: int = Field(
        64 << 20,
        ge=1 << 16,
        le=INT64_MAX,
        description="NCCL: each bucket is broadcast in runs of whole tensors of at most this "
        "many bytes (a larger tensor alone), so that packing, the wire and loading overlap",
    )
    ack: bool = Field(
        False,
        description="NCCL: after the commit word, every worker and the learner join one int32 "
        "sum all-reduce: a worker adds 1 once the update is in its parameters (0 if it failed "
        "to load it), so the learner knows the weights are loaded without the HTTP answer",
    )
    adapter: LoraAdapterSpec | None = Field(
        None,
        description="the buckets hold a LoRA adapter (PEFT's tensor names), served on the base "
        "weights (the vllm engine: --enable-lora); not with /weights/nccl/prepare",
    )


class NcclPrepared(WireModel):
    """``POST /weights/nccl/prepare``'s answer: the workers wait for this update's broadcast,
    generation paused; ``POST /weights/nccl/commit`` with this id loads it."""

    prepared_id: str
    num_bytes: int
    expires_s: float = Field(description="dropped (and the group aborted) if not committed by then")


class NcclCommitRequest(WireModel):
    prepared_id: str


class IpcHandle(WireModel):
    """A CUDA IPC handle to one flat bucket in the learner's GPU memory (``rollout_server.
    cuda_ipc``); byte strings in base64."""

    dtype: str
    numel: int = Field(ge=1, le=INT64_MAX)
    stride: int = Field(1, ge=1, le=INT64_MAX)
    tensor_offset: int = Field(0, ge=0, le=INT64_MAX)
    handle: str
    storage_bytes: int = Field(ge=1, le=INT64_MAX)
    storage_offset_bytes: int = Field(0, ge=0, le=INT64_MAX)
    ref_counter_handle: str
    ref_counter_offset: int = Field(0, ge=0, le=INT64_MAX)
    event_handle: str | None = None
    event_sync_required: bool = False


class IpcUpdateRequest(NcclUpdateRequest):
    """``POST /weights/ipc/update``: an update whose buckets are CUDA IPC handles to the
    learner's memory on the server's own GPU (colocated mode). Same layout as an NCCL announce;
    ``handles[b]`` holds bucket ``b``."""

    handles: list[IpcHandle]
    gpu_uuid: str = Field(description="the learner's GPU (torch.cuda.get_device_properties.uuid)")


class WeightUpdateResponse(WireModel):
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


class WeightChecksum(WireModel):
    """``GET /weights/checksum``: a float64 digest of the served parameters (a shared one
    once) that depends on every element's position and every tensor's name, so misplaced
    weights change it, but not on vLLM's fusing of q/k/v and gate/up: compare it with the
    learner's over its parameters (``rollout_server.weight_digest.params_checksum``)."""

    weight_version: int
    checksum: float
