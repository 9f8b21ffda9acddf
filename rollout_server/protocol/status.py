"""The wire models of the status routes: health, readiness, and what ``/info`` reports."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rollout_server.protocol.base import WireModel


class Limits(WireModel):
    """Input limits the server enforces; a violation is a 4xx that names the limit."""

    max_n: int = Field(64, ge=1)
    max_tokens: int = Field(4096, ge=1)
    max_prompt_len: int = Field(8192, ge=1, description="prompt tokens")
    max_batch_size: int = Field(512, ge=1, description="prompts per request")
    max_body_mb: int = Field(
        4096,
        ge=1,
        description="request body size of the weight uploads, MB (/weights/update, "
        "/weights/bucket)",
    )
    max_json_body_mb: int = Field(
        64, ge=1, description="request body size of every other route, MB (/generate ...)"
    )


class InfoResponse(WireModel):
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
    lora_rank: int | None = Field(
        None, description="the rank of the LoRA adapter served on the base weights (none: null)"
    )
    weight_transfer_backend: str | None = Field(
        None,
        description="what vLLM's RL routes (/init_weight_transfer_engine ...) transfer over: "
        "gloo (transformers engine), nccl or ipc (vllm engine); null: not served",
    )


class HealthResponse(WireModel):
    status: Literal["ok"] = "ok"
