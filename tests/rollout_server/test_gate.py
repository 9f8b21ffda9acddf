"""The pause gate: a weight load waits for in-flight generations and holds back new ones."""

from __future__ import annotations

import asyncio

from rollout_server.gate import PauseGate


async def test_writer_waits_for_readers_and_new_readers_queue_behind_it():
    gate = PauseGate()
    events: list[str] = []
    reader_in = asyncio.Event()
    release_reader = asyncio.Event()

    async def first_reader():
        async with gate.read():
            events.append("reader1 start")
            reader_in.set()
            await release_reader.wait()
            events.append("reader1 end")

    async def writer():
        async with gate.write():
            events.append("writer")

    async def late_reader():
        async with gate.read():
            events.append("reader2")

    t1 = asyncio.create_task(first_reader())
    await reader_in.wait()
    tw = asyncio.create_task(writer())
    await asyncio.sleep(0.01)
    assert gate.paused and events == ["reader1 start"]  # writer waits for reader1
    t2 = asyncio.create_task(late_reader())
    await asyncio.sleep(0.01)
    assert gate.waiting == 1 and events == ["reader1 start"]  # reader2 queues, not fails
    release_reader.set()
    await asyncio.gather(t1, tw, t2)
    assert events == ["reader1 start", "reader1 end", "writer", "reader2"]
    assert gate.readers == 0 and not gate.paused


async def test_readers_share_the_gate():
    gate = PauseGate()
    inside = 0
    peak = 0

    async def reader():
        nonlocal inside, peak
        async with gate.read():
            inside += 1
            peak = max(peak, inside)
            await asyncio.sleep(0.01)
            inside -= 1

    await asyncio.gather(*(reader() for _ in range(5)))
    assert peak == 5


async def test_cancelled_waiters_release_the_gate():
    gate = PauseGate()
    hold = asyncio.Event()

    async def reader():
        async with gate.read():
            await hold.wait()

    r = asyncio.create_task(reader())
    await asyncio.sleep(0.01)
    w = asyncio.create_task(gate.write().__aenter__())
    await asyncio.sleep(0.01)
    assert gate.paused
    w.cancel()  # a writer that gives up must not keep readers out
    await asyncio.gather(w, return_exceptions=True)
    assert not gate.paused
    async with asyncio.timeout(1):
        async with gate.read():
            pass
    r.cancel()  # a cancelled reader gives its slot back
    await asyncio.gather(r, return_exceptions=True)
    assert gate.readers == 0
    async with asyncio.timeout(1):
        async with gate.write():
            pass


async def test_an_aborting_hold_cancels_only_abortable_readers_and_tells_them():
    gate = PauseGate()
    inside = {"generation": asyncio.Event(), "checksum": asyncio.Event()}
    outcome: dict[str, str] = {}

    async def reader(name: str, abortable: bool) -> None:
        async with gate.read(abortable=abortable):
            inside[name].set()
            try:
                await asyncio.sleep(0.3)
                outcome[name] = "finished"
            except asyncio.CancelledError:
                outcome[name] = f"aborted={gate.take_aborted(asyncio.current_task())}"
                raise

    tasks = [
        asyncio.create_task(reader("generation", True)),
        asyncio.create_task(reader("checksum", False)),
    ]
    await asyncio.gather(*(e.wait() for e in inside.values()))
    await gate.hold(wait=True, abort=True)  # returns once no reader is left
    assert gate.readers == 0 and gate.held
    assert outcome == {"generation": "aborted=True", "checksum": "finished"}
    assert not gate.take_aborted(tasks[0])  # told once
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert isinstance(results[0], asyncio.CancelledError) and results[1] is None
    await gate.release_hold()
    async with gate.read(abortable=True):  # reads go on after the resume
        pass
