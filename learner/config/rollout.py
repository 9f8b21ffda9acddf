"""[rollout]: the rollout servers the learner generates with (or the embedded one it starts),
how it reaches them, authenticates, and rides out one that goes away; [rollout.sync] is
``learner.config.sync``'s.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidatorFunctionWrapHandler, field_validator, model_validator

from learner.config.base import FieldError, Section
from learner.config.sync import HttpSyncConfig, SyncConfig, refuse_flat_sync_keys, validate_sync
from rollout_server.settings import API_KEY_ENV


class EmbeddedServerConfig(Section):
    engine: Literal["transformers", "vllm"] = Field(
        "transformers", description="vllm: the server shares the learner's GPU (colocated)"
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="the dtype the embedded server loads the model in"
    )
    startup_timeout_s: float = Field(
        120.0, gt=0, description="how long the embedded server may take to become ready"
    )
    extra_args: list[str] = Field(default_factory=list, description="more rollout-server flags")
    per_rank: bool = Field(
        False,
        description="every learner process starts its own server on its own device (its GPU: "
        "colocated on every rank), generates its share of the prompts there and syncs the "
        'weights to it alone (sync "http" or "ipc"); false: the main process starts one',
    )


class RolloutConfig(Section):
    servers: list[str] = Field(
        default_factory=list,
        description="rollout server URLs; empty = start an embedded server as a subprocess",
    )
    servers_file: str | None = Field(
        None,
        description="a file of rollout server URLs, one per line (# comments), re-read after "
        "every step: a server added joins once it serves the learner's weights, a removed one "
        "leaves (an elastic fleet; instead of servers)",
    )
    server_api: Literal["rollout-server", "vllm"] = Field(
        "rollout-server",
        description='what the servers speak: "rollout-server" (ours), or "vllm" for a stock '
        "`vllm serve` (VLLM_SERVER_DEV_MODE=1, --weight-transfer-config): generation through "
        '/v1/completions, weights over [rollout.sync] type = "vllm", no versions or rollback '
        "on the server (docs/vllm-serve.md)",
    )
    api_key: str | None = Field(
        None,
        description="the servers' API key; better api_key_file or the ROLLOUT_API_KEY "
        "environment variable (a key here shows in the config file and on command lines); "
        'written as "***" to RUN_DIR/config.json',
    )
    api_key_file: str | None = Field(
        None, description="a file holding the servers' API key (its content, stripped)"
    )
    timeout_s: float = Field(
        600.0, gt=0, description="the longest one request to a server may take (a generation)"
    )
    max_retries: int = Field(
        3,
        ge=0,
        description="retries, with backoff, of a request that timed out, failed to connect or "
        "got a 502, 503 or 504",
    )
    ready_timeout_s: float = Field(
        300.0, gt=0, description="how long to wait at the start for every server to be ready"
    )
    reconnect_timeout_s: float = Field(
        600.0,
        gt=0,
        description="how long to wait for a rollout server that went away during the run "
        "(killed, restarted) before stopping it; once back, it gets the learner's weights and "
        "the step's prompts are generated again",
    )
    sync: SyncConfig = Field(
        default_factory=HttpSyncConfig,
        description="how the weights reach the servers: http (CPU/tests), file (shared disk), "
        "nccl (servers on other GPUs) or ipc (a server on the learner's own GPU: colocated "
        'mode); sync = "nccl" is short for the table with that type and its defaults',
    )
    max_staleness: int = Field(
        0,
        ge=0,
        description="overlap: generate up to this many steps ahead with older weights "
        "(0 = synchronous); samples are importance-weighted for the lag",
    )
    sleep_while_training: Literal[1, 2] | None = Field(
        None,
        description="colocated mode: put the servers to sleep at this level while the learner "
        "trains (frees their GPU memory), wake them for the weight sync and generation",
    )
    embedded: EmbeddedServerConfig = Field(
        default_factory=EmbeddedServerConfig,
        description="the server the learner starts when rollout.servers is empty",
    )

    @model_validator(mode="before")
    @classmethod
    def _flat_sync_keys(cls, data: Any) -> Any:
        return refuse_flat_sync_keys(data)

    @field_validator("sync", mode="wrap")
    @classmethod
    def _sync_section(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        return validate_sync(value, handler)

    @model_validator(mode="after")
    def _check(self) -> RolloutConfig:
        if self.max_staleness and self.sleep_while_training:
            raise ValueError(
                "rollout.max_staleness > 0 overlaps generation with training, which a server "
                "asleep during training cannot do: unset one of them"
            )
        if self.api_key is not None and not self.api_key.strip():
            raise FieldError("api_key", "is blank: give the servers' key, or leave it unset")
        if self.api_key is not None and self.api_key_file is not None:
            raise FieldError("api_key_file", "set api_key or api_key_file, not both")
        if self.api_key_file is not None:
            read_key_file(self.api_key_file)
        if self.embedded.per_rank and (self.external or self.sync.type in ("nccl", "file")):
            raise FieldError(
                "embedded.per_rank",
                "starts a server on every rank: it takes no rollout.servers or servers_file, "
                'and its weights go over sync = "http" or "ipc"',
            )
        if self.server_api == "vllm" and not (self.external and self.sync.type == "vllm"):
            raise FieldError(
                "server_api",
                '"vllm" is for stock vllm serve servers: list them in rollout.servers (or '
                'servers_file) and sync their weights with [rollout.sync] type = "vllm"',
            )
        if self.servers_file is not None:
            if self.servers:
                raise FieldError("servers_file", "set servers or servers_file, not both")
            read_servers_file(self.servers_file)
        return self

    @property
    def external(self) -> bool:
        """Whether the learner uses servers it did not start (else it starts an embedded one)."""
        return bool(self.servers) or self.servers_file is not None

    def listed(self) -> list[str]:
        """The server URLs as configured now: ``servers``, or ``servers_file``'s lines."""
        if self.servers_file is None:
            return list(self.servers)
        return read_servers_file(self.servers_file)

    def key(self) -> str | None:
        """The servers' API key: ``api_key``, ``api_key_file``'s, else ``ROLLOUT_API_KEY``'s."""
        if self.api_key is not None:
            return self.api_key
        if self.api_key_file is not None:
            return read_key_file(self.api_key_file)
        return os.environ.get(API_KEY_ENV) or None


def read_key_file(path: str) -> str:
    """The API key in ``path``, stripped; a ``FieldError`` naming ``api_key_file`` when it cannot
    be read or holds only whitespace."""
    try:
        key = Path(path).read_text().strip()
    except OSError as e:
        raise FieldError("api_key_file", f"cannot read {path}: {e.strerror}") from None
    if not key:
        raise FieldError("api_key_file", f"{path} is blank: write the servers' key into it")
    return key


def read_servers_file(path: str) -> list[str]:
    """The URLs in ``path`` (one per line; blank lines and ``#`` comments skipped), each once;
    a ``FieldError`` naming ``servers_file`` when it cannot be read, names none, or names
    something that is not an http(s) URL."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise FieldError("servers_file", f"cannot read {path}: {e.strerror}") from None
    urls: list[str] = []
    for n, line in enumerate(text.splitlines(), 1):
        url = line.split("#", 1)[0].strip().rstrip("/")
        if not url:
            continue
        if not url.startswith(("http://", "https://")) or " " in url:
            raise FieldError(
                "servers_file", f"{path} line {n}: {url!r} is not a URL like http://host:8000"
            )
        if url not in urls:
            urls.append(url)
    if not urls:
        raise FieldError("servers_file", f"{path} names no server: write one URL per line")
    return urls
