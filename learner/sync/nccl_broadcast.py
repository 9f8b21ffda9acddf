"""The NCCL half of ``learner.sync.nccl_sender.NcclWeightSender``: the group's communicator and
what runs on it, off the event loop.

``Broadcaster`` owns the communicator of the weight group the sender formed, one kept daemon
thread (``DaemonWorker``), the learner's fill and wire streams and the packing buffers kept
between sends (``_Slots``). On that thread every bucket is filled and broadcast segment by
segment, then the commit word goes out and the thread waits for the workers'
acknowledgement. The sender (group formation over HTTP, announce, prepare, answers) holds one
``Broadcaster`` and hands it each group it forms; torch is imported only inside the methods.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from learner.sync.nccl_buckets import drain, segment_views, take_tensors
from rollout_server.nccl_wire import (
    Bucket,
    NcclGroupError,
    Segment,
    copy_all,
    nccl_abort,
    wait_event,
)
from rollout_server.weight_digest import flat_checksum

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


class DaemonWorker:
    """One daemon thread kept for a sender's broadcasts, so that no thread starts on a sync's
    critical path; jobs run in turn. A daemon, as in ``run_in_daemon_thread``: a broadcast that
    can never finish must not keep the interpreter alive at exit."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future:
        future: Future = Future()
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="nccl-weight-sync", daemon=True)
            self._thread.start()
        self._jobs.put((future, fn, args))
        return asyncio.wrap_future(future)

    def _run(self) -> None:
        while True:
            future, fn, args = self._jobs.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:
                future.set_exception(exc)


class Broadcaster:
    """The communicator of the learner's weight group and the thread that broadcasts on it.

    ``attach`` hands it a group just formed; ``abort`` leaves it, ``forget`` drops one that a
    failed broadcast already aborted (the sender forms the group again). The streams and the
    packing buffers outlive the groups: they are the learner's, made once."""

    def __init__(self) -> None:
        self.comm: Any = None  # the group's PyNcclCommunicator; None: no group
        self.device: torch.device | None = None
        self.timeout_s = 300.0  # no progress for this long: the group is aborted
        self._streams: tuple[Any, Any] | None = None  # (fill, wire) on the learner's GPU
        self._slots: dict[int, _Slots] = {}  # packing buffers by segment size, kept
        self._thread = DaemonWorker()  # runs the broadcasts

    @property
    def ready(self) -> bool:
        return self.comm is not None

    def attach(self, comm: Any, device: torch.device, timeout_s: float) -> None:
        self.comm, self.device, self.timeout_s = comm, device, float(timeout_s)

    def abort(self) -> None:
        """Leave the group (``ncclCommAbort``: returns even when a peer is gone)."""
        if self.comm is not None:
            nccl_abort(self.comm)
            self.comm = None

    def forget(self) -> None:
        """A broadcast failed with ``NcclGroupError``: it aborted the group already."""
        self.comm = None

    def run(
        self,
        layout: list[Bucket],
        tensor_iter: Iterable[tuple[str, torch.Tensor]],
        stop: threading.Event,
        checksum: bool,
        segment_bytes: int,
        on_bucket: Callable[[int], None] | None,
        marks: dict[str, float],
        worded: threading.Event,
    ) -> asyncio.Future:
        """One update's broadcasts on the kept thread; the future's result is ``(checksum, the
        workers' sum of acknowledgements)``. ``stop`` ends a wait (the announce failed);
        ``worded`` is set once the commit word is out; ``marks`` gets the thread's progress."""
        return self._thread.submit(
            self._broadcast,
            layout,
            tensor_iter,
            stop,
            checksum,
            segment_bytes,
            on_bucket,
            marks,
            worded,
        )

    def _broadcast(
        self,
        layout: list[Bucket],
        tensor_iter: Iterable[tuple[str, torch.Tensor]],
        stop: threading.Event,
        checksum: bool,
        segment_bytes: int,
        on_bucket: Callable[[int], None] | None,
        marks: dict[str, float],
        worded: threading.Event,
    ) -> tuple[float, int]:
        """Fill and broadcast every bucket, then the commit word; wait for the workers' sum of
        acknowledgements. Returns the checksum and that sum.

        If the stream fails or disagrees with ``specs``, the remaining buckets go out as zeros
        with commit word 0: the servers discard everything and the group stays usable. Any
        other failure (no memory, a dead peer) aborts the group; the next send forms it again.
        """
        import torch

        marks["thread"] = time.perf_counter()
        torch.cuda.set_device(self.device)
        it = iter(tensor_iter)
        try:
            total, failure, acked = self._stream_buckets(
                layout, it, stop, checksum, segment_bytes, on_bucket, marks, worded
            )
        except NcclGroupError:
            drain(it, quiet=True)
            raise
        except BaseException as exc:
            nccl_abort(self.comm)
            drain(it, quiet=True)
            raise NcclGroupError(f"the broadcast stopped part way ({exc!r})") from exc
        drain(it, quiet=failure is not None)
        if failure is not None:
            raise failure
        return total, acked

    def _stream_buckets(
        self,
        layout: list[Bucket],
        it: Iterator[tuple[str, torch.Tensor]],
        stop: threading.Event,
        checksum: bool,
        segment_bytes: int,
        on_bucket: Callable[[int], None] | None,
        marks: dict[str, float],
        worded: threading.Event,
    ) -> tuple[float, Exception | None, int]:
        """Every bucket goes out segment by segment (``Bucket.segments``) on a wire stream.

        This thread runs on a fill stream, so the stream's tensors (a ZeRO-3 gather's copies)
        are made there too. A segment of one tensor that already has the bucket's dtype leaves
        from that tensor; the others are packed (one fused multi-tensor copy into kept views)
        into one of two buffers per dtype while the previous segment is on the wire. The two
        streams wait on each other on the GPU (a few reused events per segment): this thread
        only launches, and blocks once, for the workers' acknowledgement after the commit word,
        unless ``on_bucket`` asks it to wait for every bucket. Returns the checksum, the failure if the stream failed (then
        the word was 0) and the sum of acknowledgements."""
        import torch

        comm, timeout_s, device = self.comm, self.timeout_s, self.device
        fill, wire, slots = self._streams_and_slots(layout, segment_bytes)
        failure: Exception | None = None
        total = torch.zeros((), dtype=torch.float64, device=device) if checksum else None
        ready = torch.cuda.Event()  # the segment just packed (or made) on the fill stream
        fill.wait_stream(torch.cuda.current_stream(device))  # the caller's last writes
        marks["setup"] = time.perf_counter()
        with torch.cuda.stream(fill):
            for b, (bucket, segs) in enumerate(zip(layout, slots.cut, strict=True)):
                for i, g in enumerate(segs):
                    parts = None
                    if failure is None:
                        parts, failure = _take_segment(bucket, g, it, b, marks)
                    direct = (
                        parts is not None
                        and len(parts) == 1
                        and parts[0].dtype == bucket.dtype
                        and parts[0].device == device
                        and parts[0].is_contiguous()
                    )
                    if direct:
                        flat = parts[0]  # type: ignore[index]
                        flat.record_stream(wire)  # a gathered copy may be freed before it left
                    else:
                        flat, slot, views = slots.take(b, i, wire)
                        if parts is None:
                            flat.zero_()
                        else:
                            copy_all(views, parts)
                    ready.record(fill)
                    wire.wait_event(ready)
                    if total is not None and failure is None:
                        with torch.cuda.stream(wire):
                            total += flat_checksum(flat.view(-1), b, g.offset)
                    comm.broadcast(flat, src=0, stream=wire)
                    if not direct:
                        slots.sent(bucket.dtype, slot, wire)
                    del flat, parts
                    if "first" not in marks:
                        marks["first"] = time.perf_counter()
                marks[f"launched{b}"] = time.perf_counter()
                if on_bucket is not None:
                    left = torch.cuda.Event()
                    left.record(wire)
                    wait_event(left, comm, timeout_s, f"bucket {b + 1}", stop)
                    on_bucket(b)
            if failure is None and next(it, None) is not None:
                failure = ValueError(
                    "the tensor stream yielded more tensors than the specs announce"
                )
        acked = self._commit_word(comm, wire, failure, stop, marks, worded)
        return (float(total) if total is not None else 0.0), failure, acked

    def _streams_and_slots(
        self, layout: list[Bucket], segment_bytes: int
    ) -> tuple[Any, Any, _Slots]:
        """The fill and wire streams (made once) and the packing buffers for this layout."""
        import torch

        device = self.device
        if self._streams is None:
            self._streams = (torch.cuda.Stream(device), torch.cuda.Stream(device))
        fill, wire = self._streams
        slots = self._slots.get(segment_bytes)
        if slots is None or not slots.serves(layout):
            if len(self._slots) >= 4:  # one per segment size in use; a few at most
                self._slots.clear()
            slots = self._slots[segment_bytes] = _Slots(layout, segment_bytes, device)
        slots.reset()
        return fill, wire, slots

    def _commit_word(
        self,
        comm: Any,
        wire: Any,
        failure: Exception | None,
        stop: threading.Event,
        marks: dict[str, float],
        worded: threading.Event,
    ) -> int:
        """The commit word (1: load the update; 0, after a ``failure``: discard it) after the
        last segment, then the workers' sum of acknowledgements, waited for."""
        import torch

        device = self.device
        with torch.cuda.stream(wire):
            # filled on the GPU: a copy from pageable host memory would first wait for the stream
            word = torch.full((1,), 0 if failure else 1, dtype=torch.int32, device=device)
            acks = torch.zeros(1, dtype=torch.int32, device=device)
        comm.broadcast(word, src=0, stream=wire)
        # each worker adds 1 once the update is in its parameters (its HTTP commit got there)
        comm.all_reduce(acks, acks, stream=wire)
        done = torch.cuda.Event()
        done.record(wire)
        marks["word"] = time.perf_counter()
        worded.set()
        wait_event(done, comm, self.timeout_s, "the servers' acknowledgement of the load", stop)
        marks["acked"] = time.perf_counter()
        return int(acks.item())


def _take_segment(
    bucket: Bucket, g: Segment, it: Iterator[tuple[str, Any]], b: int, marks: dict[str, float]
) -> tuple[list[Any] | None, Exception | None]:
    """Segment ``g``'s tensors from the stream, or the stream's failure (the update is then
    abandoned: the remaining segments go out as zeros)."""
    try:
        parts = take_tensors(bucket.entries[g.first : g.stop], it)
    except Exception as exc:
        log.error("weight sync abandoned at bucket %d: %s", b, exc)
        return None, exc
    if "taken" not in marks:
        marks["taken"] = time.perf_counter()
    return parts, None


class _Slots:
    """Two packing buffers per dtype, taken in turn on the (current) fill stream, with the
    views that the segments' tensors are copied into (made once per layout and kept, with the
    buffers, for the next send of it). A buffer is refilled only after the segment last sent
    from it has left (a wait on the GPU, not here); a segment larger than the buffers (one
    tensor that needs a cast) gets one of its own."""

    def __init__(self, layout: list[Bucket], segment_bytes: int, device: torch.device) -> None:
        import torch

        self.layout, self.segment_bytes = layout, segment_bytes
        self.cut = [bucket.segments(segment_bytes) for bucket in layout]
        numel: dict[torch.dtype, int] = {}
        for bucket, segs in zip(layout, self.cut, strict=True):
            for g in segs:
                if g.stop - g.first > 1:
                    numel[bucket.dtype] = max(numel.get(bucket.dtype, 0), g.numel)
        self._buffers = {
            d: [torch.empty(n, dtype=d, device=device) for _ in range(2)] for d, n in numel.items()
        }
        self._left = {d: [torch.cuda.Event(), torch.cuda.Event()] for d in numel}
        self._used = {d: [False, False] for d in numel}
        self._turn: dict[torch.dtype, int] = dict.fromkeys(numel, 0)
        self._views: dict[tuple[int, int, int], list[torch.Tensor]] = {}
        self._device = device

    def serves(self, layout: list[Bucket]) -> bool:
        return layout is self.layout or layout == self.layout

    def reset(self) -> None:
        """A new send: the previous one's segments have all left."""
        for used in self._used.values():
            used[:] = [False, False]

    def take(
        self, b: int, i: int, wire: torch.cuda.Stream
    ) -> tuple[torch.Tensor, int, list[torch.Tensor]]:
        """Segment ``i`` of bucket ``b``: its buffer, slot (-1: a buffer of its own) and the
        views of its tensors into the buffer."""
        import torch

        bucket, g = self.layout[b], self.cut[b][i]
        buffers = self._buffers.get(bucket.dtype)
        if buffers is None or g.numel > buffers[0].numel():
            out = torch.empty(g.numel, dtype=bucket.dtype, device=self._device)
            out.record_stream(wire)
            return out, -1, segment_views(out, bucket, g)
        k = self._turn[bucket.dtype]
        self._turn[bucket.dtype] = 1 - k
        if self._used[bucket.dtype][k]:
            torch.cuda.current_stream(self._device).wait_event(self._left[bucket.dtype][k])
        flat = buffers[k][: g.numel]
        views = self._views.get((k, b, i))
        if views is None:
            views = self._views[(k, b, i)] = segment_views(flat, bucket, g)
        return flat, k, views

    def sent(self, dtype: torch.dtype, slot: int, wire: torch.cuda.Stream) -> None:
        if slot >= 0:
            self._left[dtype][slot].record(wire)
            self._used[dtype][slot] = True
