"""The pause gate between generation and weight loads (an asyncio readers-writer lock).

Generations are readers: any number run at once. A weight load (or sleep/wake) is a writer: it
waits for the generations in flight to finish, and from the moment it starts waiting no new
generation starts — they queue behind it rather than fail — so an update cannot be starved by a
steady stream of requests and no sample ever mixes two weight versions.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class PauseGate:
    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self._readers = 0
        self._writing = False
        self._writers_waiting = 0
        self._readers_waiting = 0
        self._held = False  # paused by the trainer (/pause) until /resume
        self._abortable: set[asyncio.Task] = set()  # generations a /pause?mode=abort may cancel
        self._aborted: set[asyncio.Task] = set()  # cancelled by it, until they take the news

    @property
    def readers(self) -> int:
        """Generations in flight."""
        return self._readers

    @property
    def waiting(self) -> int:
        """Generations queued behind a weight load or sleep."""
        return self._readers_waiting

    @property
    def paused(self) -> bool:
        return self._writing or self._writers_waiting > 0 or self._held

    @property
    def held(self) -> bool:
        return self._held

    async def hold(self, *, wait: bool, abort: bool = False) -> None:
        """Keep new generations from starting until ``release_hold`` (a trainer's /pause);
        weight loads still go through. ``wait``: return once the generations in flight ended.
        ``abort``: cancel the abortable ones in flight first (``read(abortable=True)``; each
        learns it from ``take_aborted``)."""
        async with self._cond:
            self._held = True
            if abort:
                for task in self._abortable:
                    self._aborted.add(task)
                    task.cancel()
            if wait:
                try:
                    await self._cond.wait_for(lambda: self._readers == 0)
                except BaseException:  # a cancelled /pause pauses nothing
                    self._held = False
                    self._cond.notify_all()
                    raise

    async def release_hold(self) -> None:
        async with self._cond:
            self._held = False
            self._cond.notify_all()

    def take_aborted(self, task: asyncio.Task) -> bool:
        """Whether ``task`` was cancelled by ``hold(abort=True)`` (asked once: forgotten after)."""
        if task not in self._aborted:
            return False
        self._aborted.discard(task)
        return True

    @asynccontextmanager
    async def read(self, *, abortable: bool = False) -> AsyncIterator[None]:
        """The read side, for one generation (or anything that must see one weight version).
        ``abortable``: a ``/pause?mode=abort`` may cancel the calling task inside the block."""
        async with self._cond:
            self._readers_waiting += 1
            try:
                await self._cond.wait_for(lambda: not self.paused)
            finally:
                self._readers_waiting -= 1
            self._readers += 1
        task = asyncio.current_task() if abortable else None
        if task is not None:
            self._abortable.add(task)
        try:
            yield
        finally:
            if task is not None:
                self._abortable.discard(task)  # before the await below: never cancelled there
            # Shielded: a cancelled request must still give its slot back, or writers hang.
            await asyncio.shield(self._release_read())

    async def _release_read(self) -> None:
        async with self._cond:
            self._readers -= 1
            self._cond.notify_all()

    @asynccontextmanager
    async def write(self) -> AsyncIterator[None]:
        await self.acquire_write()
        try:
            yield
        finally:
            await asyncio.shield(self.release_write())

    async def acquire_write(self) -> None:
        """Take the write side beyond one block (a prepared NCCL update holds it from prepare
        to commit); ``release_write`` gives it back."""
        async with self._cond:
            self._writers_waiting += 1
            try:
                await self._cond.wait_for(lambda: not self._writing and self._readers == 0)
            except BaseException:
                self._writers_waiting -= 1
                self._cond.notify_all()  # a cancelled writer must not keep readers queued
                raise
            self._writers_waiting -= 1
            self._writing = True

    async def release_write(self) -> None:
        async with self._cond:
            self._writing = False
            self._cond.notify_all()
