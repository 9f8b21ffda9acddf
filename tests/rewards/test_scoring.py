"""The scoring runner: weights and abstention, columns by name, and every failure mode under
every policy."""

from __future__ import annotations

import asyncio
import math
import threading
import time

import pytest

from rewards.scoring import (
    RewardFunctionError,
    RewardOutputError,
    RewardRunner,
    RewardSpec,
    RewardSpecError,
    RewardTimeoutError,
    check_output,
)

PROMPTS = ["p0", "p1", "p2"]
COMPLETIONS = ["a", "bb", "ccc"]


def length(prompts, completions, **columns):
    return [float(len(c)) for c in completions]


def gold_match(prompts, completions, gold, **columns):
    return [None if g is None else float(c == g) for c, g in zip(completions, gold, strict=True)]


async def async_double(prompts, completions, **columns):
    await asyncio.sleep(0)
    return [2.0 * len(c) for c in completions]


async def test_weighted_total_with_abstention_by_hand():
    runner = RewardRunner(
        [
            RewardSpec(name="length", weight=0.5),
            RewardSpec(name="gold_match", weight=2.0),
            {"name": "async_double", "weight": -1.0},
        ],
        funcs={"length": length, "gold_match": gold_match, "async_double": async_double},
    )
    res = await runner.score(PROMPTS, COMPLETIONS, {"gold": ["a", None, "xyz"]})
    assert res.per_function == {
        "length": [1.0, 2.0, 3.0],
        "gold_match": [1.0, None, 0.0],
        "async_double": [2.0, 4.0, 6.0],
    }
    # 0.5*len + 2*match - 2*len; the None of gold_match abstains (it is not a 0).
    assert res.total == [0.5 + 2.0 - 2.0, 1.0 - 4.0, 1.5 + 0.0 - 6.0]
    assert res.metrics["reward/gold_match/mean"] == 0.5
    assert res.metrics["reward/gold_match/std"] == 0.5
    assert res.metrics["reward/gold_match/none_frac"] == pytest.approx(1 / 3)
    assert res.metrics["reward/length/std"] == pytest.approx(math.sqrt(2 / 3))
    assert res.metrics["reward/length/failures"] == 0.0
    assert res.failures == {}


async def test_all_abstain_gives_zero_total():
    def never(prompts, completions):
        return [None] * len(completions)

    res = await RewardRunner([RewardSpec(name="never")], funcs={"never": never}).score(
        PROMPTS, COMPLETIONS
    )
    assert res.total == [0.0, 0.0, 0.0]
    assert "reward/never/mean" not in res.metrics
    assert res.metrics["reward/never/none_frac"] == 1.0


async def test_columns_by_name_and_kwargs_and_labels():
    seen = {}

    def narrow(prompts, completions, gold, scale=1.0):  # no **kwargs: gets only `gold`
        seen["gold"] = gold
        return [scale * (c == g) for c, g in zip(completions, gold, strict=True)]

    runner = RewardRunner(
        [
            RewardSpec(name="narrow", label="narrow_x3", kwargs={"scale": 3.0}),
            RewardSpec(name="narrow", label="narrow_x1"),
        ],
        funcs={"narrow": narrow},
    )
    res = await runner.score(PROMPTS, COMPLETIONS, {"gold": ["a", "x", "ccc"], "other": [1, 2, 3]})
    assert res.per_function["narrow_x3"] == [3.0, 0.0, 3.0]
    assert res.per_function["narrow_x1"] == [1.0, 0.0, 1.0]
    assert seen["gold"] == ["a", "x", "ccc"]
    with pytest.raises(ValueError, match="label"):
        RewardRunner([RewardSpec(name="narrow")] * 2, funcs={"narrow": narrow})
    # Columns are filtered to what the function takes; its kwargs are not: a typo is an error,
    # found when the runner is built (test_scoring_hazards.py has more).
    with pytest.raises(RewardSpecError, match=r"kwargs \['scael'\] are not parameters"):
        RewardRunner([RewardSpec(name="narrow", kwargs={"scael": 2.0})], funcs={"narrow": narrow})


async def test_sync_rewards_run_off_the_event_loop():
    """A slow sync reward must not stall the loop: a ticker keeps running meanwhile."""
    threads = []

    def slow(prompts, completions):
        threads.append(threading.current_thread())
        time.sleep(0.5)
        return [1.0] * len(completions)

    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            await asyncio.sleep(0.02)
            ticks += 1

    task = asyncio.create_task(ticker())
    await RewardRunner([RewardSpec(name="slow")], funcs={"slow": slow}).score(PROMPTS, COMPLETIONS)
    task.cancel()
    assert threads[0] is not threading.main_thread()
    assert ticks >= 10


def raising(prompts, completions):
    raise ZeroDivisionError("boom")


def hanging_sync(prompts, completions):
    time.sleep(3600)


async def hanging_async(prompts, completions):
    await asyncio.sleep(3600)


def wrong_length(prompts, completions):
    return [1.0] * (len(completions) - 1)


def nan(prompts, completions):
    return [1.0, float("nan"), 0.0]


def not_a_number(prompts, completions):
    return [1.0, "0.5", 0.0]


def not_a_list(prompts, completions):
    return 1.0


FAILURES = {
    "raising": (raising, RewardFunctionError, "raised ZeroDivisionError: boom"),
    "hanging_sync": (hanging_sync, RewardTimeoutError, "no result after 0.3 s"),
    "hanging_async": (hanging_async, RewardTimeoutError, "no result after 0.3 s"),
    "wrong_length": (wrong_length, RewardOutputError, "returned 2 scores for 3 completions"),
    "nan": (nan, RewardOutputError, "score 1 is nan"),
    "not_a_number": (not_a_number, RewardOutputError, "score 1 is '0.5' \\(str\\)"),
    "not_a_list": (not_a_list, RewardOutputError, "returned float"),
}


@pytest.mark.parametrize("name", FAILURES)
async def test_failure_raises_named_error(name):
    fn, error, message = FAILURES[name]
    runner = RewardRunner(
        [RewardSpec(name=name), RewardSpec(name="length")],
        funcs={name: fn, "length": length},
        timeout_s=0.3,
        policy="raise",
    )
    t0 = time.perf_counter()
    with pytest.raises(error, match=message) as info:
        await runner.score(PROMPTS, COMPLETIONS)
    assert info.value.function == name
    assert f"reward function {name!r}" in str(info.value)
    assert time.perf_counter() - t0 < 2.0  # a hang is cut at the timeout


@pytest.mark.parametrize("policy,fill", [("none", None), ("zero", 0.0)])
@pytest.mark.parametrize("name", FAILURES)
async def test_failure_is_recorded_under_policy(name, policy, fill):
    fn = FAILURES[name][0]
    runner = RewardRunner(
        [RewardSpec(name=name, weight=10.0), RewardSpec(name="length")],
        funcs={name: fn, "length": length},
        timeout_s=0.3,
        policy=policy,
    )
    for _ in range(2):  # the run continues after the failure, and the count accumulates
        res = await runner.score(PROMPTS, COMPLETIONS)
        assert res.per_function[name] == [fill] * 3
        assert res.per_function["length"] == [1.0, 2.0, 3.0]
        assert res.total == [1.0, 2.0, 3.0]  # None abstains; 0.0 * 10 adds nothing
        assert res.metrics[f"reward/{name}/failures"] == 1.0
        assert res.metrics["reward/length/failures"] == 0.0
        assert name in res.failures[name]
    assert runner.failure_counts == {name: 2, "length": 0}


async def test_functions_own_timeout_error_is_not_reported_as_a_hang():
    def own_timeout(prompts, completions):
        raise TimeoutError("upstream judge timed out")

    runner = RewardRunner([RewardSpec(name="j")], funcs={"j": own_timeout}, timeout_s=5)
    with pytest.raises(RewardFunctionError, match="raised TimeoutError: upstream") as info:
        await runner.score(PROMPTS, COMPLETIONS)
    assert not isinstance(info.value, RewardTimeoutError)


async def test_caller_mistakes_are_value_errors():
    runner = RewardRunner([RewardSpec(name="length")], funcs={"length": length})
    with pytest.raises(ValueError, match="2 prompts for 3 completions"):
        await runner.score(PROMPTS[:2], COMPLETIONS)
    with pytest.raises(ValueError, match="column 'gold' has 1 rows for 3 completions"):
        await runner.score(PROMPTS, COMPLETIONS, {"gold": ["a"]})
    with pytest.raises(ValueError, match=r"kwargs \['gold'\] shadow dataset columns"):
        clash = RewardRunner(
            [RewardSpec(name="gold_match", kwargs={"gold": ["a"] * 3})],
            funcs={"gold_match": gold_match},
        )
        await clash.score(PROMPTS, COMPLETIONS, {"gold": ["a"] * 3})
    with pytest.raises(ValueError, match="policy"):
        RewardRunner([RewardSpec(name="length")], funcs={"length": length}, policy="ignore")


def test_check_output_accepts_numbers_and_none():
    import numpy as np

    assert check_output("f", [1, None, np.float32(0.5), True], 4) == [1.0, None, 0.5, 1.0]
    assert check_output("f", np.array([0.25, 1.0]), 2) == [0.25, 1.0]
    with pytest.raises(RewardOutputError, match="score 0 is inf"):
        check_output("f", [float("inf")], 1)
    with pytest.raises(RewardOutputError, match="returned str"):
        check_output("f", "1.0", 1)


async def test_builtins_resolve_through_the_registry():
    runner = RewardRunner([RewardSpec(name="length", kwargs={"target": 2, "unit": "chars"})])
    res = await runner.score(PROMPTS, COMPLETIONS)
    assert res.per_function["length"] == [0.5, 1.0, 0.5]


def test_a_function_that_cannot_take_prompts_and_completions_fails_when_built():
    def no_prompts(completions, **columns):
        return [1.0] * len(completions)

    with pytest.raises(RewardSpecError) as info:
        RewardRunner([RewardSpec(name="np")], funcs={"np": no_prompts})
    assert str(info.value) == (
        "reward function 'np': no_prompts(completions, **columns) cannot be called with "
        "(prompts, completions) as its first two positional arguments; define it as "
        "fn(prompts, completions, **columns)"
    )


def test_a_parameter_that_names_no_column_fails_before_any_call():
    def needs(prompts, completions, answer, *, scale, unit="words"):
        return [1.0] * len(completions)

    runner = RewardRunner([RewardSpec(name="needs", kwargs={"scale": 2})], funcs={"needs": needs})
    runner.check_columns(["answer", "completion_ids"])  # `scale` comes from the kwargs
    with pytest.raises(RewardSpecError) as info:
        runner.check_columns(["allowed", "completion_ids"])
    assert str(info.value) == (
        "reward function 'needs': needs() needs the column(s) ['answer'], but the data's columns "
        "are ['allowed', 'completion_ids']: add them to the data, pass them in the reward's "
        "kwargs, or give the parameters a default"
    )
    RewardRunner([RewardSpec(name="length")], funcs={"length": length}).check_columns([])
    with pytest.raises(RewardSpecError) as info:
        runner.check_columns(["answer", "scale"])
    assert str(info.value) == (
        "reward function 'needs': kwargs ['scale'] have the names of data columns, which reach "
        "the function under those names: rename the kwargs (or the columns)"
    )


async def test_a_function_that_abstains_on_a_whole_batch_is_warned_about_once(caplog):
    def never(prompts, completions):
        return [None] * len(completions)

    runner = RewardRunner([RewardSpec(name="never")], funcs={"never": never})
    with caplog.at_level("WARNING", logger="rewards.scoring"):
        await runner.score(PROMPTS, COMPLETIONS)
        await runner.score(PROMPTS, COMPLETIONS)
    warned = [r.getMessage() for r in caplog.records]
    assert warned == [
        "reward 'never' returned None (abstained) for all 3 completions of a batch, so it gives "
        "no signal there; if that is not meant, check the columns it reads "
        "(reward/never/none_frac tracks it; this warning is shown once)"
    ]
