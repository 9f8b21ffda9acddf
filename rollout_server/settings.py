"""Server settings: one pydantic model that the CLI fills from flags and tests build directly.

Cheap to import (no torch): the CLI parses and validates before any heavy import.
"""

from __future__ import annotations

import ipaddress
import os
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rollout_server.protocol import Limits

API_KEY_ENV = "ROLLOUT_API_KEY"


def is_loopback(host: str) -> bool:
    """True when ``host`` only accepts connections from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a hostname other than localhost: assume it is reachable from outside


def check_model_ref(ref: str) -> None:
    """Refuse a ``ref`` that is written as a local path (absolute, ``./``, ``../``, ``~``, or more
    than one ``/``) but names no directory: transformers would otherwise report it as a malformed
    hub id. A hub id (``Qwen/Qwen3-0.6B``) passes unchecked."""
    looks_local = os.path.isabs(ref) or ref.startswith((".", "~")) or ref.count("/") > 1
    if looks_local and not os.path.isdir(os.path.expanduser(ref)):
        raise ValueError(
            f"{ref!r}: no such model directory; give an existing directory "
            "(config.json and weights) or a Hugging Face hub id such as 'Qwen/Qwen3-0.6B'"
        )


class ServerSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(description="a local model directory or a Hugging Face hub id")
    served_model_name: str | None = Field(
        None, description="name reported by /info and /v1/models (default: `model`)"
    )
    engine: Literal["transformers", "vllm"] = "transformers"
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="auto: float32 on CPU, bfloat16 on GPU"
    )
    device: str = Field("auto", description="auto: cuda when available, else cpu")
    seed: int = Field(0, description="seeds the draws for requests that give no seed")
    limits: Limits = Field(default_factory=Limits)
    api_key: str | None = Field(
        default_factory=lambda: os.environ.get(API_KEY_ENV) or None,
        repr=False,
        description=f"required as `Authorization: Bearer` on every endpoint (env {API_KEY_ENV}, "
        "or the CLI's --api-key-file)",
    )
    ssl_keyfile: str | None = Field(None, description="TLS private key (PEM): serve HTTPS")
    ssl_certfile: str | None = Field(None, description="TLS certificate chain (PEM)")
    weights_dir: str | None = Field(
        None,
        description="the directory /weights/load_file may read from, besides the model's own "
        "directory; paths are resolved (symlinks, '..') before the check",
    )
    shutdown_timeout: float = Field(
        10.0,
        ge=0,
        description="seconds SIGTERM waits for requests in flight before cancelling them",
    )
    disable_admin_endpoints: bool = Field(
        False, description="serve generation only: no weight, sleep or NCCL routes"
    )
    max_model_len: int | None = Field(
        None, ge=2, description="prompt + completion tokens (default: the model's)"
    )
    trust_remote_code: bool = False
    # Batching: sequences (prompt x sample) decoded together, prompt tokens prefilled in one
    # step. None: the engine's batch default (transformers 256 / 32768; vLLM the defaults of its
    # offline LLM class for the GPU, 1024 / 16384 on a >= 70 GB GPU).
    max_num_seqs: int | None = Field(
        None, ge=1, description="sequences decoded in one batch (vLLM: max_num_seqs)"
    )
    max_batch_tokens: int | None = Field(
        None,
        ge=1,
        description="prompt tokens prefilled in one batch (vLLM: max_num_batched_tokens; "
        "transformers: padded prompt tokens)",
    )
    # vLLM engine options (ignored by the transformers engine).
    gpu_memory_utilization: float = Field(0.9, gt=0.0, le=1.0)
    tensor_parallel_size: int = Field(1, ge=1)
    data_parallel_size: int = Field(1, ge=1)
    enable_sleep_mode: bool = Field(
        True, description="vLLM: reserve memory so /sleep can offload (transformers: always)"
    )
    enable_prefix_caching: bool = True
    direct_weight_copy: bool = Field(
        True,
        description="vLLM, NCCL/IPC sync: copy updates straight into the parameters once the "
        "first update of a layout has verified the copy plan against load_weights (off: "
        "always load_weights)",
    )
    enable_lora: bool = Field(
        False,
        description="vLLM: start with LoRA support, so that adapter updates can be served "
        "(transformers: always, wrapped in PEFT on the first adapter update)",
    )
    max_lora_rank: int = Field(
        64, ge=1, description="vLLM with enable_lora: the largest adapter rank it can serve"
    )
    weight_transfer_backend: Literal["nccl", "ipc"] | None = Field(
        None,
        description="vLLM: the weight-transfer engine behind vLLM's RL routes "
        "(/init_weight_transfer_engine, /update_weights ...), passed as vLLM's "
        "weight_transfer_config; unset, those routes answer 501 on the vllm engine "
        "(the transformers engine always serves them over gloo)",
    )
    vllm_engine_args: dict[str, Any] = Field(
        default_factory=dict,
        description="more vLLM AsyncEngineArgs, e.g. {'enforce_eager': True, "
        "'max_num_batched_tokens': 4096}; they override the ones derived above",
    )
    gc_freeze: bool = Field(
        True,
        description="once the engine is ready, move everything allocated while starting out of "
        "Python's garbage collector (gc.freeze, as vLLM's own server does): collections while "
        "serving then walk only what serving allocates",
    )
    log_level: Literal["debug", "info", "warning", "error"] = "info"

    @model_validator(mode="after")
    def _check_secrets(self) -> ServerSettings:
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError(
                f"--api-key: the key is empty or only whitespace (from --api-key, "
                f"--api-key-file or env {API_KEY_ENV}); give a real key"
            )
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("--ssl-keyfile and --ssl-certfile go together: give both or neither")
        return self

    @model_validator(mode="after")
    def _admin_needs_auth_off_loopback(self) -> ServerSettings:
        if not is_loopback(self.host) and not self.api_key and not self.disable_admin_endpoints:
            raise ValueError(
                f"refusing to serve the weight and sleep endpoints without an API key on the "
                f"non-loopback address {self.host!r}: set env {API_KEY_ENV} or --api-key-file "
                "(or --api-key), bind to 127.0.0.1, or pass --disable-admin-endpoints"
            )
        return self

    @property
    def name(self) -> str:
        return self.served_model_name or self.model
