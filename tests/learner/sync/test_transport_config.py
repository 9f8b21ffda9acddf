"""[rollout.sync]: one table per transport, the string shorthand, overrides inside the table,
errors that name the field as written and the fix, and the factory that maps each table to
its transport."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from learner.config import ConfigError, load_config
from learner.config.rollout import RolloutConfig
from learner.config.sync import (
    FileSyncConfig,
    HttpSyncConfig,
    IpcSyncConfig,
    NcclSyncConfig,
    VllmSyncConfig,
)
from learner.run.runtime import SetupError
from learner.sync import make_transport
from rollout_server.client import RolloutClient

DEMO = Path(__file__).resolve().parents[3] / "learner" / "configs" / "demo.toml"


def _sync(*overrides: str):
    return load_config(DEMO, list(overrides)).rollout.sync


def test_the_default_and_the_shorthand_are_tables_with_defaults() -> None:
    default = RolloutConfig().sync
    assert default == HttpSyncConfig(bucket_mb=256)
    assert _sync("rollout.sync=nccl") == NcclSyncConfig(
        bucket_mb=256, master_address="127.0.0.1", master_port=0, prepare=True
    )
    assert _sync('rollout.sync="ipc"') == IpcSyncConfig(bucket_mb=256)


def test_overrides_reach_into_the_table_and_expand_the_shorthand(tmp_path) -> None:
    assert _sync("rollout.sync=file", f"rollout.sync.dir={tmp_path}") == FileSyncConfig(
        dir=str(tmp_path)
    )
    nccl = _sync(
        "rollout.sync.type=nccl", "rollout.sync.prepare=false", "rollout.sync.bucket_mb=1024"
    )
    assert isinstance(nccl, NcclSyncConfig) and not nccl.prepare and nccl.bucket_mb == 1024
    path = tmp_path / "c.toml"
    path.write_text(DEMO.read_text() + '\n[rollout.sync]\ntype = "nccl"\nmaster_port = 29612\n')
    table = load_config(path, ["rollout.sync.master_address=10.0.0.1"]).rollout.sync
    assert table == NcclSyncConfig(master_address="10.0.0.1", master_port=29612)


def test_only_nccl_prepares_and_only_nccl_pushes_are_not_retried() -> None:
    assert NcclSyncConfig().prepares and not NcclSyncConfig(prepare=False).prepares
    assert not any(c.prepares for c in (HttpSyncConfig(), IpcSyncConfig(), FileSyncConfig(dir="d")))
    client = RolloutClient(["http://127.0.0.1:9"])
    kinds = {"http": "HttpTransport", "nccl": "NcclTransport", "ipc": "IpcTransport"}
    for kind, name in {**kinds, "file": "FileTransport"}.items():
        sync = {"type": "file", "dir": "d"} if kind == "file" else kind
        transport = make_transport(RolloutConfig(sync=sync, ready_timeout_s=7.0), client)
        assert type(transport).__name__ == name and transport.ready_timeout_s == 7.0
        assert transport.retries_pushes is (kind != "nccl")
        assert transport.cfg == RolloutConfig(sync=sync).sync


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        (
            ["rollout.sync_dir=/d"],
            'rollout.sync_dir: is now rollout.sync.dir (with [rollout.sync] type = "file")',
        ),
        (["rollout.bucket_mb=64"], "rollout.bucket_mb: is now rollout.sync.bucket_mb"),
        (["rollout.nccl_master_address=h"], "is now rollout.sync.master_address"),
        (["rollout.nccl_master_port=1"], "is now rollout.sync.master_port"),
        (
            ["rollout.prepare_sync=false"],
            'is now rollout.sync.prepare (with [rollout.sync] type = "nccl")',
        ),
        (["rollout.sync=file"], 'rollout.sync.dir: required with type = "file"'),
        (
            ["rollout.sync=shm"],
            "rollout.sync.type: 'shm' is not a transport: give 'http', 'file', 'nccl', 'ipc' or 'vllm'",
        ),
        (
            ["rollout.sync.dir=/d"],
            "rollout.sync.type: required: give 'http', 'file', 'nccl', 'ipc' or 'vllm'",
        ),
        (
            ["rollout.sync=http", "rollout.sync.dir=/d"],
            'rollout.sync.dir: unknown field for type = "http", which takes: bucket_mb',
        ),
        (
            ["rollout.sync=nccl", "rollout.sync.master_port=70000"],
            "rollout.sync.master_port: Input should be less than or equal to 65535",
        ),
        (
            ["rollout.sync=ipc", "rollout.sync.bucket_mb=true"],
            "rollout.sync.bucket_mb: give a number, not true",
        ),
    ],
)
def test_errors_name_the_field_as_written_and_the_fix(overrides, fragment) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(DEMO, overrides)
    assert fragment in str(e.value), str(e.value)


def test_vllms_ipc_engine_without_its_dependency_is_a_setup_error(monkeypatch) -> None:
    """vLLM 0.24's IPC engine module imports ray (seen on the GPU machine: a stock vllm serve
    with the ipc backend died at start on it). The learner says so at connect, naming the
    package and the alternative, instead of failing at its first push."""
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ModuleNotFoundError
    monkeypatch.delitem(sys.modules, "vllm.distributed.weight_transfer.ipc_engine", raising=False)
    rollout = RolloutConfig(
        servers=["http://127.0.0.1:1"], server_api="vllm", sync=VllmSyncConfig(backend="ipc")
    )
    transport = make_transport(rollout, RolloutClient("http://127.0.0.1:1"))
    with pytest.raises(SetupError, match=r"pip install (ray|vllm)") as err:
        asyncio.run(transport.connect())
    assert 'type = "ipc" with our server' in str(err.value)


def test_a_stock_server_refusing_pickled_ipc_handles_is_a_setup_error() -> None:
    """vLLM 0.24's answer to the IPC engine's update when started without
    VLLM_ALLOW_INSECURE_SERIALIZATION (seen on the GPU machine): the learner names the variable
    to set instead of retrying a sync that cannot succeed; other failures stay sync errors."""
    from learner.sync.vllm_native import refused_pickles
    from rollout_server.client_http import RolloutHTTPError

    server = "http://127.0.0.1:8000"
    detail = {"error": {"message": "Call to collective_rpc method failed: Refusing to deserialize "
                        "`ipc_handles_pickled` without VLLM_ALLOW_INSECURE_SERIALIZATION=1",
                        "type": "InternalServerError", "code": 500}}  # fmt: skip
    refused = RolloutHTTPError(server, "POST", "/update_weights", 500, detail)
    setup = refused_pickles([server], refused)
    assert isinstance(setup, SetupError)
    assert "start vllm serve with VLLM_ALLOW_INSECURE_SERIALIZATION=1" in str(setup)
    assert server in str(setup)
    other = RolloutHTTPError(server, "POST", "/update_weights", 500, {"error": "CUDA OOM"})
    assert refused_pickles([server], other) is None
