"""The wire contract of the rollout server: typed pydantic models shared by server and client.

Everything that crosses the HTTP boundary is defined in this package and nowhere else, one module
per feature (``generation``, ``weights``, ``sleep``, ``status``; the shared base and the error
body in ``base``), and every model is imported from here: by the feature's router and service,
the client, the learner and the engines alike. The contract sits below the engines (they take
its requests), so it cannot live in the feature packages, which sit above them.

Importing it must stay cheap: pydantic only, no torch, no vLLM, no engine code (the learner
imports it on every rank).
"""

from __future__ import annotations

from rollout_server.protocol.base import INT64_MAX, ErrorResponse, Version, WireModel
from rollout_server.protocol.generation import (
    ChatMessage,
    FinishReason,
    GenerateRequest,
    GenerateResponse,
    PromptInput,
    PromptResult,
    Sample,
    SamplingParams,
)
from rollout_server.protocol.native import (
    IsPaused,
    PauseStatus,
    StartWeightUpdateRequest,
    UpdateWeightsRequest,
    WeightTransferInitInfo,
    WeightTransferInitRequest,
    WeightTransferMessage,
    WeightTransferUpdateInfo,
    WorldSize,
)
from rollout_server.protocol.routes import RoutedExperts
from rollout_server.protocol.sleep import SleepRequest, SleepStatus, WakeUpRequest
from rollout_server.protocol.status import HealthResponse, InfoResponse, Limits
from rollout_server.protocol.weights import (
    MAX_BUCKETS,
    IpcHandle,
    IpcUpdateRequest,
    LoraAdapterSpec,
    NcclCommitRequest,
    NcclInitRequest,
    NcclPrepared,
    NcclUpdateRequest,
    TensorSpec,
    WeightChecksum,
    WeightFileRequest,
    WeightUpdateBegin,
    WeightUpdateCommit,
    WeightUpdateId,
    WeightUpdateResponse,
)

__all__ = [
    "INT64_MAX",
    "MAX_BUCKETS",
    "ChatMessage",
    "ErrorResponse",
    "FinishReason",
    "GenerateRequest",
    "GenerateResponse",
    "HealthResponse",
    "InfoResponse",
    "IpcHandle",
    "IpcUpdateRequest",
    "IsPaused",
    "Limits",
    "LoraAdapterSpec",
    "NcclCommitRequest",
    "NcclInitRequest",
    "NcclPrepared",
    "NcclUpdateRequest",
    "PauseStatus",
    "PromptInput",
    "PromptResult",
    "RoutedExperts",
    "Sample",
    "SamplingParams",
    "SleepRequest",
    "SleepStatus",
    "StartWeightUpdateRequest",
    "TensorSpec",
    "UpdateWeightsRequest",
    "Version",
    "WakeUpRequest",
    "WeightChecksum",
    "WeightFileRequest",
    "WeightTransferInitInfo",
    "WeightTransferInitRequest",
    "WeightTransferMessage",
    "WeightTransferUpdateInfo",
    "WeightUpdateBegin",
    "WeightUpdateCommit",
    "WeightUpdateId",
    "WeightUpdateResponse",
    "WireModel",
    "WorldSize",
]
