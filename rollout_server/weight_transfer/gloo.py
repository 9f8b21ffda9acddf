"""The CPU twin of vLLM's NCCL weight-transfer engine: the same ``init_info`` and
``update_info`` fields, the same wire (one broadcast per tensor from rank 0, in the order of
``names``), over Gloo so that a learner and a rollout server without GPUs can speak vLLM's RL
interface (``/init_weight_transfer_engine``, ``/update_weights``) to each other.

The group is a ``ProcessGroupGloo`` built directly on its own ``TCPStore``, never the default
process group: the learner already has one (accelerate's) that this must not disturb. Every
collective waits at most the group's timeout, so a peer that dies is an error, not a hang.
"""

from __future__ import annotations

import contextlib
import datetime
import socket
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future, InvalidStateError
from typing import Any

import torch
import torch.distributed as dist

_PREFIX = "weight_transfer_gloo"


class GlooGroup:
    """One Gloo process group between the trainer (rank 0) and the inference workers."""

    def __init__(
        self,
        store: dist.Store,
        pg: dist.ProcessGroupGloo,
        rank: int,
        world_size: int,
        timeout_s: float,
    ) -> None:
        self._store: dist.Store | None = store
        self._pg: dist.ProcessGroupGloo | None = pg
        self.rank = rank
        self.world_size = world_size
        self.timeout = datetime.timedelta(seconds=timeout_s)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """Broadcast ``tensor`` (CPU, contiguous) in place from ``src``; raises on a dead peer
        or after the timeout."""
        if self._pg is None:
            raise RuntimeError("the weight-transfer group is closed")
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        opts.timeout = self.timeout
        self._pg.broadcast([tensor], opts).wait(self.timeout)

    def close(self) -> None:
        """Drop the group: its peers' next collective fails at once (the sockets close)."""
        pg, self._pg, self._store = self._pg, None, None
        if pg is not None:
            with contextlib.suppress(RuntimeError):  # already broken: closing is all that is left
                pg.abort()

    @property
    def closed(self) -> bool:
        return self._pg is None


def _local_address(master_address: str, master_port: int) -> str:
    """The address of this host that reaches the master (what Gloo listens on and announces)."""
    if master_address in ("localhost", "127.0.0.1", "::1"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((master_address, master_port))  # UDP: picks the route, sends nothing
        return s.getsockname()[0]


def _parse_init_info(init_info: dict[str, Any]) -> tuple[str, int, int]:
    """master_address, master_port and world_size (the trainer, like vLLM's
    ``trainer_init``, needs no ``rank_offset``: it is rank 0)."""
    try:
        address = str(init_info["master_address"])
        port = int(init_info["master_port"])
        world_size = int(init_info["world_size"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(
            f"init_info needs master_address, master_port, world_size: {exc!r}"
        ) from exc
    return address, port, world_size


def _join(init_info: dict[str, Any], rank: int, timeout_s: float) -> GlooGroup:
    address, port, world_size = _parse_init_info(init_info)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside the group's world_size {world_size}")
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(
        address,
        port,
        world_size,
        is_master=rank == 0,
        timeout=timeout,
        wait_for_workers=False,
        use_libuv=True,
    )
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=_local_address(address, port))]
    # Gloo's constructor connects the full mesh: it returns once every rank joined
    pg = dist.ProcessGroupGloo(dist.PrefixStore(_PREFIX, store), rank, world_size, opts)
    return GlooGroup(store, pg, rank, world_size, timeout_s)


def trainer_init(init_info: dict[str, Any], timeout_s: float = 60.0) -> GlooGroup:
    """The trainer's side (rank 0): hosts the TCPStore at ``master_address:master_port`` and
    returns once all ``world_size`` ranks joined (call it while the server's
    ``/init_weight_transfer_engine`` is in flight)."""
    return _join(init_info, 0, timeout_s)


def trainer_send_weights(iterator: Iterable[tuple[str, torch.Tensor]], group: GlooGroup) -> None:
    """One broadcast per tensor from rank 0, in the iterator's order (that of ``names`` in the
    ``update_info`` posted to ``/update_weights``); tensors go over as CPU copies."""
    for _, tensor in iterator:
        group.broadcast(tensor.detach().to("cpu").contiguous(), src=0)


def receiver_init(init_info: dict[str, Any], rank: int, timeout_s: float = 60.0) -> GlooGroup:
    """An inference worker's side: ``rank`` is ``rank_offset`` + the worker's own rank."""
    return _join(init_info, rank, timeout_s)


def receiver_join(init_info: dict[str, Any], rank: int, timeout_s: float) -> Future[GlooGroup]:
    """``receiver_init`` on a daemon thread of its own: the future resolves with the group, or
    with the join's error. A caller that stops waiting (its deadline, a cancellation) abandons
    it with ``abandon``: the thread is left to end on its own, and a group it forms afterwards
    is closed at once.

    Why a thread with a deadline: ``TCPStore``'s own timeout does not cover every wait of a
    join (a peer that accepts the connection and never answers keeps it waiting for good, and a
    closed port takes longer than the timeout given), so only the caller's clock bounds it."""
    future: Future[GlooGroup] = Future()
    future.set_running_or_notify_cancel()

    def run() -> None:
        try:
            group = receiver_init(init_info, rank, timeout_s)
        except BaseException as exc:  # handed to the waiter, or dropped if it gave up
            with contextlib.suppress(InvalidStateError):
                future.set_exception(exc)
            return
        try:
            future.set_result(group)
        except InvalidStateError:  # abandoned: nobody will use this group
            group.close()

    threading.Thread(target=run, name="weight-transfer-join", daemon=True).start()
    return future


def abandon(future: Future[GlooGroup], why: str) -> GlooGroup | None:
    """Give up a ``receiver_join``; the group if it joined in the meantime (None otherwise)."""
    try:
        future.set_exception(TimeoutError(why))
    except InvalidStateError:  # it ended just now
        return future.result() if future.exception() is None else None
    return None


def receive_weights(
    update_info: dict[str, Any],
    group: GlooGroup,
    load: Callable[[list[tuple[str, torch.Tensor]]], None],
) -> None:
    """Receive the tensors ``update_info`` announces (``names``, ``dtype_names``, ``shapes``,
    dense and unpacked), one broadcast each, handing each to ``load`` as it arrives."""
    if update_info.get("packed") or update_info.get("update_kind", "dense") != "dense":
        raise ValueError("the gloo backend receives dense, unpacked updates only")
    names, dtypes, shapes = (update_info[k] for k in ("names", "dtype_names", "shapes"))
    if not len(names) == len(dtypes) == len(shapes):
        raise ValueError("names, dtype_names and shapes must have the same length")
    for name, dtype_name, shape in zip(names, dtypes, shapes, strict=True):
        tensor = torch.empty(list(shape), dtype=getattr(torch, dtype_name))
        group.broadcast(tensor, src=0)
        load([(name, tensor)])
