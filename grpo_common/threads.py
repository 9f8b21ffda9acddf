"""Run user code that may be sync without blocking the event loop, and without being stuck on it.

Sync callables run in a fresh daemon thread per call rather than the loop's default executor: a
call that never returns cannot be killed in Python, but as a daemon it is merely abandoned. It
takes no executor slot that later calls would queue behind, and it does not block interpreter
exit, which the default executor's threads would (``asyncio.run`` joins them).

``start_in_daemon_thread`` goes one step further for code we trust least (reward functions): an
``async def`` runs there too, on a fresh event loop of its own, so one that blocks its loop
(``time.sleep``, ``requests.get``) blocks only its thread, and is abandoned at a timeout like a
sync call instead of freezing the caller's loop, where no timeout could fire.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class DaemonCall(Generic[T]):
    """A call running in its own daemon thread. ``future`` (on the caller's loop) settles with
    its outcome; ``thread`` stays alive while the call runs, also after ``future`` was cancelled
    (a timeout): that is how a caller counts the calls it abandoned."""

    future: asyncio.Future[T]
    thread: threading.Thread


class AbandonedCalls:
    """Threads of calls abandoned at a timeout, by key (a reward function, an environment):
    ``running(key)`` counts those that have not returned yet."""

    def __init__(self) -> None:
        self._threads: dict[Any, list[threading.Thread]] = {}

    def add(self, key: Any, thread: threading.Thread) -> None:
        self._threads.setdefault(key, []).append(thread)

    def running(self, key: Any) -> int:
        alive = [t for t in self._threads.pop(key, []) if t.is_alive()]
        if alive:
            self._threads[key] = alive
        return len(alive)


def _spawn(body: Callable[[], T], name: str) -> DaemonCall[T]:
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[T] = loop.create_future()

    def settle(result: Any, exc: BaseException | None) -> None:
        if fut.done():  # cancelled meanwhile (a timeout)
            return
        if exc is None:
            fut.set_result(result)
        else:
            fut.set_exception(exc)

    def target() -> None:
        exc: BaseException | None = None
        try:
            result = body()
        except StopIteration as e:  # a Future refuses it: the caller would wait forever
            result, exc = None, RuntimeError(f"{name} raised StopIteration")
            exc.__cause__ = e
        except BaseException as e:  # SystemExit and co. too: the caller decides what they mean
            result, exc = None, e
        with contextlib.suppress(RuntimeError):  # the loop closed while we ran
            loop.call_soon_threadsafe(settle, result, exc)

    thread = threading.Thread(target=target, name=f"grpo-{name}", daemon=True)
    thread.start()
    return DaemonCall(fut, thread)


def _name(fn: Callable) -> str:
    return getattr(fn, "__name__", None) or type(fn).__name__


def run_in_daemon_thread(fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> asyncio.Future[T]:
    """A future for ``fn(*args, **kwargs)`` running in its own daemon thread."""
    return _spawn(functools.partial(fn, *args, **kwargs), _name(fn)).future


class _CrossThreadCancel:
    """Cancels a coroutine running on another thread's event loop, from the caller's thread,
    also when the request comes before the coroutine has started."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requested = False
        self._running: tuple[asyncio.AbstractEventLoop, asyncio.Task] | None = None

    async def run(self, aw: Awaitable[T]) -> T:
        task = asyncio.current_task()
        assert task is not None
        with self._lock:
            if self._requested:  # cancelled before it started: do not start it
                if inspect.iscoroutine(aw):
                    aw.close()
                raise asyncio.CancelledError
            self._running = (asyncio.get_running_loop(), task)
        return await aw

    def request(self) -> None:
        with self._lock:
            self._requested = True
            running = self._running
        if running is not None:
            loop, task = running
            with contextlib.suppress(RuntimeError):  # its loop is closed: nothing left to cancel
                loop.call_soon_threadsafe(task.cancel)


def start_in_daemon_thread(fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> DaemonCall[Any]:
    """Start ``fn(*args, **kwargs)`` in its own daemon thread. If it returns an awaitable (it is
    an ``async def``), that runs to completion on a fresh event loop of the thread. Cancelling
    ``future`` cancels that coroutine on its loop: a well-behaved one stops and cleans up, one
    that blocks its loop keeps its thread until it returns. A coroutine that keeps clients or
    tasks from an earlier call cannot use them: each call has a new loop."""
    cancel = _CrossThreadCancel()

    def body() -> Any:
        out = fn(*args, **kwargs)
        return asyncio.run(cancel.run(out)) if inspect.isawaitable(out) else out

    call = _spawn(body, _name(fn))

    def on_done(fut: asyncio.Future[Any]) -> None:
        if fut.cancelled():
            cancel.request()

    call.future.add_done_callback(on_done)
    return call


def is_async_callable(fn: Callable) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004 - an instance with an async __call__
    )


async def call_maybe_async(fn: Callable[..., T | Awaitable[T]], *args: Any, **kwargs: Any) -> T:
    """Await ``fn`` if it is async, else run it in a daemon thread (never on the event loop)."""
    if is_async_callable(fn):
        return await fn(*args, **kwargs)  # type: ignore[misc]
    out = await run_in_daemon_thread(fn, *args, **kwargs)
    return await out if inspect.isawaitable(out) else out  # type: ignore[return-value]
