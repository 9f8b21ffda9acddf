"""Run user code that may be sync without blocking the event loop, and without being stuck on it.

Sync callables run in a fresh daemon thread per call rather than the loop's default executor: a
call that never returns cannot be killed in Python, but as a daemon it is merely abandoned. It
takes no executor slot that later calls would queue behind, and it does not block interpreter
exit, which the default executor's threads would (``asyncio.run`` joins them).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")


def run_in_daemon_thread(fn: Callable[..., T], *args: Any, **kwargs: Any) -> asyncio.Future[T]:
    """A future for ``fn(*args, **kwargs)`` running in its own daemon thread."""
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
        try:
            result, exc = fn(*args, **kwargs), None
        except BaseException as e:
            result, exc = None, e
        with contextlib.suppress(RuntimeError):  # the loop closed while we ran
            loop.call_soon_threadsafe(settle, result, exc)

    name = f"grpo-{getattr(fn, '__name__', 'call')}"
    threading.Thread(target=target, name=name, daemon=True).start()
    return fut


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
