"""The protocol every weight transport follows, as the trainer drives it."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar

from learner.sync.tensors import follow

if TYPE_CHECKING:
    from torch import nn

    from rollout_server.client import RolloutClient
    from rollout_server.protocol import WeightUpdateResponse


class WeightTransport(ABC):
    """Pushes the policy's weights to every rollout server. One per run, made by
    ``learner.sync.make_transport`` from [rollout.sync].

    The main process calls ``connect`` once before the first generation, ``prepare`` while it
    trains, ``push`` after each optimizer step and ``close`` at the end; where it pushes, the
    other ranks call ``follow`` (the ZeRO-3 gathers are collective). Every push is atomic on
    the servers: their version moves only once every tensor loaded."""

    #: Whether a push that failed because a server went away (a restart) may simply be pushed
    #: again once the servers are ready.
    retries_pushes: ClassVar[bool] = True
    #: Whether what ``connect`` forms spans the servers it was formed with (NCCL's group): a
    #: change of the rotation then forms it again over the new one (``close``, then push).
    group_bound: ClassVar[bool] = False

    def __init__(self, client: RolloutClient, *, ready_timeout_s: float) -> None:
        self.client = client
        self.ready_timeout_s = ready_timeout_s  # how long a retried push waits for the servers
        self._server_dtype: str | None = None

    async def server_dtype(self) -> str:
        """The dtype the servers hold their weights in (``/info``), asked once: the weights
        go out in it."""
        if self._server_dtype is None:
            self._server_dtype = (await self.client.info())[0].dtype
        return self._server_dtype

    async def connect(self) -> None:
        """Form what the transport needs before the first push (nothing, by default)."""
        return None

    async def prepare(self, model: nn.Module) -> bool:
        """Have the servers get ready for the next ``push`` of ``model`` while the learner
        trains; returns whether it is prepared (never, by default)."""
        return False

    @abstractmethod
    async def push(
        self, model: nn.Module, version: int | None = None
    ) -> list[WeightUpdateResponse]:
        """Main process only. ``model`` is the HF model (under ZeRO-3: still partitioned);
        ``version``: the weight version the servers are to serve (default: theirs + 1)."""

    @property
    def last_stats(self) -> dict[str, Any]:
        """The learner side's account of the last push, where the transport keeps one (NCCL,
        CUDA IPC: its phases in seconds, NCCL's broadcast marks in ``sender_ms``); else empty."""
        return {}

    def follow(self, model: nn.Module) -> None:
        """Non-main ranks, where the main process pushes: the same ZeRO-3 gathers."""
        follow(model)

    def close(self) -> None:
        """Let go of what ``connect`` formed (nothing, by default)."""
        return None
