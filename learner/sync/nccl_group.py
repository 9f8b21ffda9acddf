"""Forming the learner's NCCL weight group: rank 0 here, then every worker of every rollout
server, invited over HTTP (``POST /weights/nccl/init``) while this process hosts the TCP
rendezvous. ``learner.sync.nccl_sender.NcclWeightSender`` forms it (again after a failure) and
hands the communicator to its ``Broadcaster``."""

from __future__ import annotations

import asyncio
import logging
import os
from typing import TYPE_CHECKING, Any

from grpo_common.threads import run_in_daemon_thread
from rollout_server.client import RolloutClient, RolloutError, WeightSyncError
from rollout_server.nccl_wire import join_group
from rollout_server.protocol import NcclInitRequest

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


def joining_device(device: torch.device | int | str) -> torch.device:
    """The CUDA device the learner joins the group from, once it can join one at all (a GPU,
    vLLM's NCCL wrapper, the rollout workers' ``NCCL_CUMEM_ENABLE``)."""
    import importlib.util

    from learner.sync.tensors import learner_cuda_device

    dev = learner_cuda_device(device, "nccl", "the learner on a CUDA GPU")
    if importlib.util.find_spec("vllm") is None:
        raise ImportError(
            'rollout.sync = "nccl": the learner joins the group through vLLM\'s NCCL '
            "wrapper, and vllm is not installed here: pip install 'grpo-service[vllm]' "
            '(or use sync = "http" / "file")'
        )
    if os.environ.get("NCCL_CUMEM_ENABLE") != "0":
        log.warning(
            "NCCL_CUMEM_ENABLE is not 0 in the learner; the rollout workers use 0. Export "
            "NCCL_CUMEM_ENABLE=0 before the learner starts if the first sync hangs."
        )
        os.environ["NCCL_CUMEM_ENABLE"] = "0"  # enough if NCCL is not initialized yet
    return dev


async def form_group(
    client: RolloutClient,
    *,
    master_address: str,
    master_port: int,
    device: torch.device,
    timeout_s: float,
) -> tuple[Any, torch.device, int]:
    """Join every server's workers (from ``/info``) into one group with this process as rank
    0. Returns the communicator, the device it sends from (with its index) and the number of
    workers (each acknowledges a load)."""
    import torch

    if unreachable := loopback_master(master_address, client.servers):
        log.warning(unreachable)
    infos = await client.info()
    sizes = [i.tensor_parallel_size * i.data_parallel_size for i in infos]
    multi = len(client.servers) > 1
    if multi and "rank_offset" not in NcclInitRequest.model_fields:
        raise ValueError(
            "NCCL sync to several servers needs NcclInitRequest.rank_offset in the protocol; "
            "use one server, or the http/file transport"
        )
    world_size = 1 + sum(sizes)
    offsets = [1 + sum(sizes[:k]) for k in range(len(sizes))]
    dev = device
    if dev.type == "cuda" and dev.index is None:
        # accelerate's device without a launcher is a bare "cuda"; the communicator needs
        # the index its tensors will carry
        dev = torch.device("cuda", torch.cuda.current_device())

    async def post(server: str, offset: int) -> None:
        fields: dict[str, Any] = dict(
            master_address=master_address,
            master_port=master_port,
            world_size=world_size,
            timeout_s=timeout_s,
        )
        if multi:
            fields["rank_offset"] = offset
        body = NcclInitRequest(**fields)
        try:
            await client.nccl_init(server, body)
        except RolloutError as e:
            raise WeightSyncError(server, f"could not join the NCCL weight group: {e}") from e

    posts = [
        asyncio.ensure_future(post(s, o)) for s, o in zip(client.servers, offsets, strict=True)
    ]
    join = run_in_daemon_thread(
        join_group, master_address, master_port, 0, world_size, dev, timeout_s
    )
    try:
        # A refused POST or a failed join ends the wait at once (the other side would only
        # time out); the join thread is a daemon, left to its own store timeout.
        await _first_failure([*posts, join])
        comm = join.result()
    finally:
        for p in posts:
            p.cancel()
    log.info(
        "NCCL weight group ready: world size %d at %s:%d",
        world_size,
        master_address,
        master_port,
    )
    return comm, dev, world_size - 1


def loopback_master(master_address: str, servers: list[str]) -> str | None:
    """Why servers on other hosts cannot join a group whose rendezvous is a loopback address
    (the default ``rollout.sync.master_address``), or None: the join would otherwise only time
    out. A warning, not an error: a server URL may name this host by another address."""
    from urllib.parse import urlsplit

    from rollout_server.settings import is_loopback

    remote = [url for url in servers if not is_loopback(urlsplit(url).hostname or "")]
    if not is_loopback(master_address) or not remote:
        return None
    return (
        f"rollout.sync.master_address = {master_address} is a loopback address, which the "
        f"rollout servers {remote} cannot reach from another host: set it to an address of "
        "the learner's main machine (machine_rank 0) that they can reach (docs/multi-node.md)"
    )


async def _first_failure(futures: list[asyncio.Future]) -> None:
    """Wait for all; raise the first exception as soon as it happens."""
    done, pending = await asyncio.wait(futures, return_when=asyncio.FIRST_EXCEPTION)
    for f in done:
        if not f.cancelled() and f.exception() is not None:
            raise f.exception()
    assert not pending
