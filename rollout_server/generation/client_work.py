"""A worker thread for the work a client's prompt costs before generation (rendering the chat
template, encoding text), apart from the engine's decode thread.

Why not ``asyncio.to_thread``: the event loop's default executor is joined when the loop
closes, so a render that ran long would hold up the server's exit; and work queued there for a
client that already left still runs. Here the thread is a daemon that nothing waits for, work
whose caller was cancelled (its client disconnected) is dropped before it starts, and the work
running when its caller is cancelled is told to stop at its next prompt (``stop``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

_Item = tuple[concurrent.futures.Future[Any], Callable[..., Any], tuple[Any, ...]]


class ClientWork:
    """Runs ``fn(stop, *args)`` calls one at a time, in order, on one daemon thread."""

    def __init__(self, name: str = "client-prompts") -> None:
        self._name = name
        self._queue: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(stop, *args)`` on the worker; ``stop`` (a ``threading.Event``) is set if this
        call is cancelled while ``fn`` runs, so that it can end early."""
        stop = threading.Event()
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("the server is shutting down")
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()
            self._queue.put((future, fn, (stop, *args)))
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            future.cancel()  # dropped unless it started
            stop.set()
            raise

    def _loop(self) -> None:
        while (item := self._queue.get()) is not None:
            future, fn, args = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args)
            except BaseException as exc:  # handed to the caller, whatever it is
                future.set_exception(exc)
            else:
                future.set_result(result)

    def close(self) -> None:
        """Cancel the work not started; the running one is left to end on its own (nothing
        joins the thread, so it cannot hold up the exit)."""
        with self._lock:
            self._closed = True
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    item[0].cancel()
            self._queue.put(None)
