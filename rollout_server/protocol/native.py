"""The wire models of vLLM's RL routes (``/init_weight_transfer_engine``, ``/update_weights``,
``/pause`` ...), as vLLM 0.24's ``api_router`` and NCCL weight-transfer engine define them, so
that a trainer written for vLLM drives this server unchanged."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from rollout_server.protocol.base import WireModel

MAX_TENSOR_DIMS = 8  # no model parameter has more; bounds what a shape may announce


class WeightTransferInitInfo(WireModel):
    """vLLM's ``NCCLWeightTransferInitInfo``: the trainer is rank 0 and hosts the store."""

    master_address: str = Field(min_length=1, max_length=255)
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1, le=65535, description="this server's first worker's rank")
    world_size: int = Field(ge=2, le=65536, description="trainer + every inference worker")
    timeout_s: float = Field(
        60.0, gt=0, le=3600, description="ours (not vLLM's): how long any receive may wait"
    )


class WeightTransferInitRequest(WireModel):
    init_info: dict[str, Any] = Field(
        description="gloo: WeightTransferInitInfo's fields (and an optional timeout_s, default "
        "60); the vLLM engine is given it as sent (its backend's fields)"
    )


class StartWeightUpdateRequest(WireModel):
    is_checkpoint_format: bool = Field(
        True, description="names as in the checkpoint (ours always are: the served model's)"
    )


class WeightTransferUpdateInfo(WireModel):
    """vLLM's ``NCCLWeightTransferUpdateInfo``: one broadcast per tensor, in ``names``' order."""

    names: list[str] = Field(max_length=1_000_000)
    dtype_names: list[str] = Field(max_length=1_000_000)
    shapes: list[list[int]] = Field(max_length=1_000_000)
    packed: bool = False
    packed_buffer_size_bytes: int | None = Field(None, ge=1)
    packed_num_buffers: int | None = Field(None, ge=1)
    update_kind: Literal["dense", "sparse_flat"] = "dense"
    num_updates_list: list[int] | None = Field(None, max_length=1_000_000)


class UpdateWeightsRequest(WireModel):
    update_info: dict[str, Any] = Field(
        description="gloo: WeightTransferUpdateInfo's fields; the vLLM engine is given it as sent"
    )


class WeightTransferMessage(WireModel):
    message: str


class PauseStatus(WireModel):
    status: Literal["paused", "resumed"]


class IsPaused(WireModel):
    is_paused: bool


class WorldSize(WireModel):
    world_size: int
