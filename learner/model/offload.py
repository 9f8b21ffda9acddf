"""Activation offloading: saved activations parked in pinned CPU memory, copied on a side stream."""

from __future__ import annotations

import collections
import contextlib
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch


class PinnedArena:
    """Host memory for offloaded activations, handed out from fixed-size chunks one after the
    other and reused from the first chunk once nothing handed out before is alive (the
    backward that read them has ended).

    One pinned block per tensor would do, but PyTorch's pinned-memory cache rounds every block
    up to a power of two and keeps it for that size: ~43 GB of activations a micro-batch took
    117 GB of host memory (0.6B model, 13k-token micro-batches, 2026-11-21). Chunks are a power
    of two themselves, so nothing is rounded; a tensor larger than a chunk gets its own block.
    """

    ALIGN = 512  # bytes: every dtype's alignment, and the DMA engines' liking

    def __init__(self, chunk_bytes: int = 1 << 30, pin: bool | None = None) -> None:
        self.chunk_bytes = chunk_bytes
        self.pin = torch.cuda.is_available() if pin is None else pin
        self.chunks: list[torch.Tensor] = []
        self._index = 0  # chunk being filled
        self._offset = 0  # bytes used in it
        self._live: list[weakref.ref] = []
        self.last_read: Any = None  # CUDA event after the latest copy back from here

    def take(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        nbytes = shape.numel() * dtype.itemsize
        if nbytes > self.chunk_bytes:
            out = torch.empty(shape, dtype=dtype, pin_memory=self.pin)
        else:
            while True:
                if self._index == len(self.chunks):
                    self.chunks.append(
                        torch.empty(self.chunk_bytes, dtype=torch.uint8, pin_memory=self.pin)
                    )
                    self._offset = 0
                start = -(-self._offset // self.ALIGN) * self.ALIGN
                if start + nbytes <= self.chunk_bytes:
                    break
                self._index, self._offset = self._index + 1, 0
            self._offset = start + nbytes
            out = self.chunks[self._index][start : start + nbytes].view(dtype).view(shape)
        if len(self._live) > 4096:
            self._live = [r for r in self._live if r() is not None]
        self._live.append(weakref.ref(out))
        return out

    def rewind(self) -> bool:
        """Hand out from the first chunk again, if nothing handed out is still alive (else go
        on after it). The last copy back is waited for: the next copies out overwrite it."""
        if any(r() is not None for r in self._live):
            return False
        if self.last_read is not None:
            self.last_read.synchronize()
            self.last_read = None
        self._live.clear()
        self._index = self._offset = 0
        return True

    @property
    def nbytes(self) -> int:
        return len(self.chunks) * self.chunk_bytes


class ActivationOffload:
    """Saved-tensor hooks that park activations in (pinned) CPU memory during the forward and
    bring them back for the backward. The copies out run on a side CUDA stream, so the forward
    goes on while activations drain; the copies back run on the consuming stream, as in
    ``torch.autograd.graph.save_on_cpu``. Small tensors (< ``min_bytes``), tensors that are not
    floating point (indices, masks, and the RNG states a compiled checkpointed layer saves) and
    the tensors of ``keep`` (the model's parameters) stay where they are. On CPU the hooks still
    copy into the arena (so tests exercise the same path).

    The forward makes activations faster than PCIe drains them. A GPU tensor is kept until its
    copy out has finished, and at most ``max_in_flight_bytes`` of them are kept at once: past
    that, the forward waits for the oldest copy. Without the bound the caching allocator kept
    taking new blocks for the queued tensors, and the reserved memory grew to the size of all
    the activations (53.5 GB reserved for 6.0 GB allocated, H200, 2026-11-21). The host side
    comes from a `PinnedArena`, reused by every forward of this object."""

    def __init__(
        self,
        min_bytes: int = 1 << 20,
        keep: Iterable[torch.Tensor] = (),
        max_in_flight_bytes: int = 1 << 30,
        arena: PinnedArena | None = None,
    ) -> None:
        self.min_bytes = min_bytes
        self.arena = arena if arena is not None else PinnedArena()
        self.max_in_flight_bytes = max_in_flight_bytes
        self.stream = torch.cuda.Stream() if torch.cuda.is_available() else None
        # The weights a layer saves for its backward live on the GPU anyway: copying them out
        # and back would cost transfers and save nothing.
        self._keep = {t.untyped_storage().data_ptr() for t in keep}
        # (copy-done event, the GPU tensor it reads, its bytes), oldest first
        self._in_flight: collections.deque[tuple[Any, torch.Tensor, int]] = collections.deque()
        self.in_flight_bytes = 0
        self.peak_in_flight_bytes = 0

    def _retire(self, budget: int) -> None:
        """Let go of the GPU tensors whose copy out is done; wait for the oldest copies while
        more than ``budget`` bytes are still queued."""
        while self._in_flight:
            event, _, nbytes = self._in_flight[0]
            if self.in_flight_bytes > budget:
                event.synchronize()
            elif not event.query():
                return
            self._in_flight.popleft()
            self.in_flight_bytes -= nbytes

    def _pack(self, t: torch.Tensor) -> Any:
        nbytes = t.numel() * t.element_size()
        # Not floating point: indices, masks, RNG states. torch.set_rng_state reads an arena
        # view from its storage's start (a segfault or "Invalid mt19937 state", torch 2.13).
        if (
            nbytes < self.min_bytes
            or not t.is_floating_point()
            or t.untyped_storage().data_ptr() in self._keep
        ):
            return t
        if t.is_cuda and self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.stream):
                host = self.arena.take(t.shape, t.dtype)
                host.copy_(t, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self.stream)
            # Holding `t` until the event has passed replaces `t.record_stream(side stream)`,
            # which frees the block to nobody until then while the forward asks for more.
            self._in_flight.append((event, t, nbytes))
            self.in_flight_bytes += nbytes
            self.peak_in_flight_bytes = max(self.peak_in_flight_bytes, self.in_flight_bytes)
            self._retire(self.max_in_flight_bytes)
            return ("cuda", t.device, host, event)
        host = self.arena.take(t.shape, t.dtype)  # CPU tensors: the same arena, unpinned
        host.copy_(t)
        return ("cpu", t.device, host, None)

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        kind, device, host, event = packed
        if kind == "cpu":
            return host
        # Back on the stream that uses it, after its copy out (a GPU-side wait, no host sync).
        # Not on the side stream: a tensor allocated there is handed out again as soon as it is
        # freed, while this stream may still be reading it (the first GPU run computed NaNs).
        stream = torch.cuda.current_stream(device)
        stream.wait_event(event)
        with torch.cuda.stream(stream):
            out = host.to(device, non_blocking=True)
            read = torch.cuda.Event()
            read.record(stream)
        self.arena.last_read = read  # the arena's next rewind waits for it
        return out

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        self.arena.rewind()  # the previous micro-batch's backward is over: reuse its memory
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            # The forward is over: the backward brings back what it needs from the host, so
            # the GPU copies left go as soon as their copies out finish (one wait, here).
            self._retire(0)
