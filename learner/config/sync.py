"""[rollout.sync]: one table per weight transport, chosen by its ``type`` (a discriminated
union), each with its own settings; the transports themselves are ``learner.sync``.

``RolloutConfig.sync`` (``learner.config``) validates it with the helpers here: the string
shorthand (``sync = "nccl"``), the flat keys of [rollout] that belong in this table, and
errors that name the field as written (``rollout.sync.dir``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError, ValidatorFunctionWrapHandler, model_validator

from learner.config.base import FieldError, Section

LORA_SYNC = (
    'with model.lora: "merged" sends the whole model with the adapters merged in; "adapter" '
    "sends only the adapters' tensors (MBs instead of GBs), which the servers serve on their "
    "base weights (over http, file, nccl and ipc; the vllm engine needs --enable-lora, and "
    'serves them unmerged: slower generation). Not with type = "vllm": vLLM\'s engines sync '
    "full weights"
)


class _SyncSection(Section):
    """[rollout.sync]: the weight transport (``type``) and its own settings."""

    lora: Literal["merged", "adapter"] = Field("merged", description=LORA_SYNC)

    @model_validator(mode="after")
    def _adapter_transport(self) -> _SyncSection:
        kind = getattr(self, "type", "")
        if self.lora == "adapter" and kind == "vllm":
            raise FieldError(
                "lora",
                '"adapter" goes over type = "http", "file", "nccl" or "ipc"; vLLM\'s own '
                'weight-transfer engines (type = "vllm") send full weights (lora = "merged")',
            )
        return self

    @property
    def prepares(self) -> bool:
        """Whether the trainer prepares each sync while it trains (NCCL only)."""
        return False


class HttpSyncConfig(_SyncSection):
    """Safetensors buckets in HTTP request bodies: needs nothing but the servers' URLs (CPU,
    tests)."""

    type: Literal["http"] = Field("http", description="selects this table's transport")
    bucket_mb: int = Field(256, ge=1, description="weight-sync bucket size")


class FileSyncConfig(_SyncSection):
    """One safetensors file on a disk the learner and every server share."""

    type: Literal["file"] = Field("file", description="selects this table's transport")
    dir: str = Field(description="the shared directory the weights file is written to")


class NcclSyncConfig(_SyncSection):
    """Flat buckets broadcast from learner rank 0 to the servers' workers (servers on other
    GPUs)."""

    type: Literal["nccl"] = Field("nccl", description="selects this table's transport")
    bucket_mb: int = Field(256, ge=1, description="weight-sync bucket size (~1024 for speed)")
    master_address: str = Field(
        "127.0.0.1", description="an address of the learner's host that the servers can reach"
    )
    master_port: int = Field(0, ge=0, le=65535, description="0 = a free port")
    prepare: bool = Field(
        True,
        description="while the learner trains on a step whose rollouts are all in, have the "
        "servers queue the next sync's receives (the sync then broadcasts at once)",
    )

    @property
    def prepares(self) -> bool:
        return self.prepare and self.lora == "merged"  # an adapter's MBs are not prepared


class IpcSyncConfig(_SyncSection):
    """Flat buckets shared as CUDA IPC handles with a server on the learner's own GPU
    (colocated mode)."""

    type: Literal["ipc"] = Field("ipc", description="selects this table's transport")
    bucket_mb: int = Field(256, ge=1, description="weight-sync bucket size")


class VllmSyncConfig(_SyncSection):
    """vLLM's own weight-transfer routes (``/init_weight_transfer_engine``,
    ``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``) driving one of
    vLLM's engines: what a stock ``vllm serve --weight-transfer-config`` speaks (our server
    answers them too)."""

    type: Literal["vllm"] = Field("vllm", description="selects this table's transport")
    backend: Literal["nccl", "ipc", "gloo"] = Field(
        "nccl",
        description="the servers' weight-transfer backend (vllm serve --weight-transfer-config "
        "'{\"backend\": ...}'): nccl (servers on other GPUs), ipc (a server on the learner's "
        "GPU), gloo (CPU: our server's transformers engine)",
    )
    master_address: str = Field(
        "127.0.0.1", description="nccl/gloo: an address of the learner's host the servers reach"
    )
    master_port: int = Field(0, ge=0, le=65535, description="nccl/gloo: 0 = a free port")
    packed: bool = Field(
        True, description="nccl/ipc: vLLM's packed transfer (weights batched into buffers)"
    )


SyncConfig = Annotated[
    HttpSyncConfig | FileSyncConfig | NcclSyncConfig | IpcSyncConfig | VllmSyncConfig,
    Field(discriminator="type"),
]
SYNC_SECTIONS: dict[str, type[_SyncSection]] = {
    "http": HttpSyncConfig,
    "file": FileSyncConfig,
    "nccl": NcclSyncConfig,
    "ipc": IpcSyncConfig,
    "vllm": VllmSyncConfig,
}

# Sync settings written flat in [rollout]: where each belongs in [rollout.sync].
FLAT_SYNC_KEYS = {
    "sync_dir": 'rollout.sync.dir (with [rollout.sync] type = "file")',
    "bucket_mb": 'rollout.sync.bucket_mb (with [rollout.sync] type = "http", "nccl" or "ipc")',
    "nccl_master_address": 'rollout.sync.master_address (with [rollout.sync] type = "nccl")',
    "nccl_master_port": 'rollout.sync.master_port (with [rollout.sync] type = "nccl")',
    "prepare_sync": 'rollout.sync.prepare (with [rollout.sync] type = "nccl")',
}


def _sync_table(value: Any) -> Any:
    """``"nccl"`` is short for ``{type = "nccl"}`` (the transport's defaults); a table's type
    must name a transport."""
    if isinstance(value, str):
        value = {"type": value}
    if isinstance(value, dict):
        kind = value.get("type")
        if not isinstance(kind, str) or kind not in SYNC_SECTIONS:
            given = "required" if kind is None else f"{kind!r} is not a transport"
            raise FieldError("type", f"{given}: give 'http', 'file', 'nccl', 'ipc' or 'vllm'")
    return value


def _sync_field_error(err: ValidationError) -> FieldError:
    """The first error inside [rollout.sync], under the field's own name, saying what to do."""
    e = err.errors()[0]
    tag, path = e["loc"][0], e["loc"][1:]
    inner = e.get("ctx", {}).get("error")
    if isinstance(inner, FieldError):
        return FieldError(".".join(map(str, (*path, inner.field))), inner.message)
    field = ".".join(map(str, path))
    if e["type"] == "extra_forbidden":
        fields = [n for n in SYNC_SECTIONS[str(tag)].model_fields if n != "type"]
        shared = [n for n in fields if n in _SyncSection.model_fields]  # every transport's last
        takes = ", ".join([n for n in fields if n not in shared] + shared)
        return FieldError(
            field, f'unknown field for type = "{tag}", which takes: {takes or "nothing else"}'
        )
    if e["type"] == "missing":
        return FieldError(field, f'required with type = "{tag}" — add it to [rollout.sync]')
    return FieldError(field, e["msg"])


def refuse_flat_sync_keys(data: Any) -> Any:
    """[rollout]'s raw data, unless it holds a sync setting written flat: the error names
    where it goes in [rollout.sync]."""
    if isinstance(data, dict):
        for key, new in FLAT_SYNC_KEYS.items():
            if key in data:
                raise FieldError(key, f"is now {new}")
    return data


def validate_sync(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    """``RolloutConfig.sync``'s wrap validator: the shorthand expanded, then the table; an
    error inside it names the field as written (``rollout.sync.dir``), not with the union's
    tag pydantic puts in its path (``rollout.sync.file.dir``)."""
    try:
        return handler(_sync_table(value))
    except ValidationError as err:
        if not err.errors()[0]["loc"]:  # not a table at all: pydantic's message says so
            raise
        raise _sync_field_error(err) from None
