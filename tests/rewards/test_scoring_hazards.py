"""Reward functions that could take the run down with them: a BaseException that is not an
Exception, an ``async def`` that blocks its event loop, calls that never return piling up, and
misspelt kwargs. Each must end as a named error or a recorded failure, never a hang or a silent
default."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import pytest

from rewards.scoring import (
    MAX_ABANDONED_CALLS,
    RewardFunctionError,
    RewardRunner,
    RewardSpec,
    RewardSpecError,
    RewardStuckError,
    RewardTimeoutError,
)
from tests.rewards.test_scoring import COMPLETIONS, PROMPTS, length


@pytest.fixture
def gate() -> Iterator[threading.Event]:
    """An event that blocked reward functions wait on; set at the end so no thread outlives the
    test."""
    event = threading.Event()
    yield event
    event.set()


@pytest.fixture
def loop_thread() -> Iterator[asyncio.AbstractEventLoop]:
    """An event loop in a daemon thread, as the learner runs it: a reward that kills this loop
    leaves its caller waiting, which the caller sees as a timeout."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    if not thread.is_alive():
        loop.close()


def _raiser(exc: type[BaseException], is_async: bool):
    if is_async:

        async def fn(prompts, completions):
            await asyncio.sleep(0)
            raise exc("from the reward")

    else:

        def fn(prompts, completions):
            raise exc("from the reward")

    return fn


BASE_EXCEPTIONS = [SystemExit, KeyboardInterrupt, GeneratorExit, asyncio.CancelledError]


@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("exc", BASE_EXCEPTIONS, ids=lambda e: e.__name__)
def test_base_exception_is_a_named_error_and_the_loop_survives(loop_thread, exc, is_async):
    runner = RewardRunner(
        [RewardSpec(name="bad"), RewardSpec(name="length")],
        funcs={"bad": _raiser(exc, is_async), "length": length},
        timeout_s=2.0,
    )
    fut = asyncio.run_coroutine_threadsafe(runner.score(PROMPTS, COMPLETIONS), loop_thread)
    with pytest.raises(RewardFunctionError, match=f"raised {exc.__name__}") as info:
        fut.result(timeout=5)  # a loop thread killed by the error would time this out
    assert info.value.function == "bad"
    assert not isinstance(info.value, RewardTimeoutError)
    # The loop is still alive and the runner still scores.
    none = RewardRunner(
        [RewardSpec(name="bad"), RewardSpec(name="length")],
        funcs={"bad": _raiser(exc, is_async), "length": length},
        policy="none",
    )
    res = asyncio.run_coroutine_threadsafe(none.score(PROMPTS, COMPLETIONS), loop_thread)
    res = res.result(timeout=5)
    assert res.per_function == {"bad": [None] * 3, "length": [1.0, 2.0, 3.0]}
    assert f"raised {exc.__name__}" in res.failures["bad"]


async def test_stop_iteration_from_a_thread_is_an_error_not_a_timeout():
    """A Future refuses StopIteration; it must not leave the call to hang until the timeout."""

    def stops(prompts, completions):
        raise StopIteration

    runner = RewardRunner([RewardSpec(name="stops")], funcs={"stops": stops}, timeout_s=5)
    t0 = time.perf_counter()
    with pytest.raises(RewardFunctionError, match="StopIteration") as info:
        await runner.score(PROMPTS, COMPLETIONS)
    assert not isinstance(info.value, RewardTimeoutError)
    assert time.perf_counter() - t0 < 2.0


def _sleeps_until_cancelled(cleaned: threading.Event):
    """An async reward that sleeps until it is cancelled, then sets ``cleaned``."""

    async def slow(prompts, completions):
        try:
            await asyncio.sleep(3600)
        finally:
            cleaned.set()

    return slow


async def test_cancelling_the_runner_is_not_swallowed():
    cleaned = threading.Event()
    slow = _sleeps_until_cancelled(cleaned)
    runner = RewardRunner([RewardSpec(name="slow")], funcs={"slow": slow}, policy="none")
    task = asyncio.create_task(runner.score(PROMPTS, COMPLETIONS))
    await asyncio.sleep(0.1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await asyncio.to_thread(cleaned.wait, 2)  # cancelled on its own loop too


def _blocking_async(gate: threading.Event):
    async def blocks_its_loop(prompts, completions):
        gate.wait(3)  # a blocking call inside async def: time.sleep, requests.get, ...
        return [1.0] * len(completions)

    return blocks_its_loop


async def test_async_reward_that_blocks_its_loop_times_out(gate):
    runner = RewardRunner(
        [RewardSpec(name="blocks"), RewardSpec(name="length")],
        funcs={"blocks": _blocking_async(gate), "length": length},
        timeout_s=0.3,
    )
    t0 = time.perf_counter()
    with pytest.raises(RewardTimeoutError, match=r"no result after 0\.3 s") as info:
        await runner.score(PROMPTS, COMPLETIONS)
    assert info.value.function == "blocks"
    assert time.perf_counter() - t0 < 2.0


@pytest.mark.parametrize("policy,fill", [("none", None), ("zero", 0.0)])
async def test_async_reward_that_blocks_its_loop_is_recorded(gate, policy, fill):
    runner = RewardRunner(
        [RewardSpec(name="blocks"), RewardSpec(name="length")],
        funcs={"blocks": _blocking_async(gate), "length": length},
        timeout_s=0.3,
        policy=policy,
    )
    t0 = time.perf_counter()
    res = await runner.score(PROMPTS, COMPLETIONS)
    assert time.perf_counter() - t0 < 2.0
    assert res.per_function == {"blocks": [fill] * 3, "length": [1.0, 2.0, 3.0]}
    assert "no result after 0.3 s" in res.failures["blocks"]


async def test_timed_out_async_reward_is_cancelled_on_its_loop():
    """A well-behaved async reward is cancelled at the timeout (so the code reward can kill its
    sandbox), not left running."""
    cleaned = threading.Event()
    slow = _sleeps_until_cancelled(cleaned)
    runner = RewardRunner([RewardSpec(name="slow")], funcs={"slow": slow}, timeout_s=0.2)
    with pytest.raises(RewardTimeoutError):
        await runner.score(PROMPTS, COMPLETIONS)
    assert await asyncio.to_thread(cleaned.wait, 2)


async def test_async_rewards_stay_concurrent():
    loops = set()

    async def fan_out(prompts, completions):
        loops.add(id(asyncio.get_running_loop()))
        await asyncio.gather(*(asyncio.sleep(0.3) for _ in range(20)))
        return [1.0] * len(completions)

    runner = RewardRunner(
        [RewardSpec(name="f", label=f"f{i}") for i in range(4)], funcs={"f": fan_out}
    )
    t0 = time.perf_counter()
    res = await runner.score(PROMPTS, COMPLETIONS)
    assert time.perf_counter() - t0 < 1.0  # 4 functions x 20 sleeps of 0.3 s, all at once
    assert res.total == [4.0, 4.0, 4.0]
    assert id(asyncio.get_running_loop()) not in loops  # each ran on its own loop


async def test_async_reward_with_an_http_client():
    """An httpx client made inside the call works on the call's own loop, against a server on
    the caller's loop."""
    import httpx

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        body = b"0.75"
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\nConnection: close\r\n\r\n" + body)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]

    async def judge(prompts, completions):
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            replies = await asyncio.gather(*(client.get("/score") for _ in completions))
        return [float(r.text) for r in replies]

    async with server:
        res = await RewardRunner([RewardSpec(name="judge")], funcs={"judge": judge}).score(
            PROMPTS, COMPLETIONS
        )
    assert res.per_function["judge"] == [0.75] * 3


@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
async def test_abandoned_calls_are_bounded_regardless_of_policy(gate, is_async):
    calls = []

    def stuck(prompts, completions):
        calls.append(1)
        gate.wait()
        return [1.0] * len(completions)

    async def stuck_async(prompts, completions):
        return stuck(prompts, completions)  # blocks its own loop

    runner = RewardRunner(
        [RewardSpec(name="stuck"), RewardSpec(name="length")],
        funcs={"stuck": stuck_async if is_async else stuck, "length": length},
        timeout_s=0.05,
        policy="zero",
        max_abandoned=2,
    )
    for _ in range(3):  # three calls time out and keep running: more than max_abandoned=2
        res = await runner.score(PROMPTS, COMPLETIONS)
        assert res.per_function["stuck"] == [0.0] * 3
    with pytest.raises(RewardStuckError, match="3 earlier calls of 'stuck' are still running"):
        await runner.score(PROMPTS, COMPLETIONS)
    assert len(calls) == 3  # the refused call was never started
    # Once they return, the function is called again.
    assert runner.still_running("stuck") == 3
    gate.set()
    for _ in range(100):
        if runner.still_running("stuck") == 0:
            break
        await asyncio.sleep(0.02)
    res = await runner.score(PROMPTS, COMPLETIONS)
    assert res.per_function["stuck"] == [1.0] * 3
    assert len(calls) == 4


async def test_abandoned_bound_default_and_validation():
    runner = RewardRunner([RewardSpec(name="length")], funcs={"length": length})
    assert runner.max_abandoned == MAX_ABANDONED_CALLS == 4
    with pytest.raises(ValueError, match="max_abandoned"):
        RewardRunner([RewardSpec(name="length")], funcs={"length": length}, max_abandoned=-1)


def test_misspelt_kwarg_of_a_builtin_is_rejected_at_construction():
    with pytest.raises(RewardSpecError, match=r"\['targt'\]") as info:
        RewardRunner([{"name": "length", "kwargs": {"targt": 2}}])
    message = str(info.value)
    assert "reward function 'length'" in message
    assert "did you mean 'target'" in message
    assert "target, unit" in message
    assert info.value.function == "length"


def test_kwargs_are_checked_against_named_parameters():
    def narrow(prompts, completions, gold, scale=1.0):
        return [scale] * len(completions)

    def only_var_kw(prompts, completions, **kwargs):
        return [1.0] * len(completions)

    def nothing(prompts, completions):
        return [1.0] * len(completions)

    def other_names(p, c, *, scale=1.0):
        return [scale] * len(c)

    ok = RewardRunner(
        [
            RewardSpec(name="narrow", kwargs={"scale": 2.0}),
            RewardSpec(name="only_var_kw", kwargs={"anything": 1}),  # cannot be checked
            RewardSpec(name="other_names", kwargs={"scale": 2.0}),
        ],
        funcs={"narrow": narrow, "only_var_kw": only_var_kw, "other_names": other_names},
    )
    assert len(ok.specs) == 3
    with pytest.raises(
        RewardSpecError,
        match=r"\['scael'\].*takes gold, scale \(did you mean 'scale' for 'scael'\?\)",
    ):
        RewardRunner([RewardSpec(name="narrow", kwargs={"scael": 2})], funcs={"narrow": narrow})
    with pytest.raises(RewardSpecError, match="takes no keyword arguments"):
        RewardRunner([RewardSpec(name="nothing", kwargs={"x": 1})], funcs={"nothing": nothing})
    # The first two parameters take prompts and completions, whatever their names.
    for bad in ("p", "completions"):
        with pytest.raises(RewardSpecError, match=rf"\['{bad}'\]"):
            RewardRunner(
                [RewardSpec(name="other_names", kwargs={bad: 1})],
                funcs={"other_names": other_names},
            )


async def test_a_kwarg_may_have_any_name():
    def picky(prompts, completions, *, fn=0.0, self=0.0):
        return [fn + self] * len(completions)

    runner = RewardRunner(
        [RewardSpec(name="picky", kwargs={"fn": 1.0, "self": 2.0})], funcs={"picky": picky}
    )
    assert (await runner.score(PROMPTS, COMPLETIONS)).total == [3.0] * 3


async def test_builtins_accept_their_documented_kwargs():
    """The kwargs column of the table in docs/rewards.md, through the registry."""
    documented = {
        "math_accuracy": {"gold_column": "answer"},
        "format": {"pattern": r"^a"},
        "length": {"target": 2, "unit": "chars"},
        "charset": {},
        "code": {"tests_column": "tests", "timeout_s": 5.0, "memory_mb": 512},
        "overlong": {"max_tokens": 4, "buffer": 2},
    }
    runner = RewardRunner([RewardSpec(name=n, kwargs=kw) for n, kw in documented.items()])
    res = await runner.score(
        PROMPTS,
        COMPLETIONS,
        {
            "answer": [None] * 3,
            "allowed": ["a", None, "c"],
            "tests": [None] * 3,
            "completion_ids": [[1], [1, 2, 3], [1, 2, 3, 4]],
        },
    )
    assert res.per_function["length"] == [0.5, 1.0, 0.5]
    assert res.per_function["format"] == [1.0, 0.0, 0.0]
    assert res.per_function["charset"] == [1.0, None, 1.0]
    assert res.per_function["code"] == [None] * 3
    assert res.per_function["overlong"] == [0.0, -0.5, -1.0]
    for name in documented:
        with pytest.raises(RewardSpecError, match=f"reward function {name!r}"):
            RewardRunner([RewardSpec(name=name, kwargs={"bogus": 1})])
