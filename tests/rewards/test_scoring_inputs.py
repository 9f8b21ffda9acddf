"""What a reward function gets and gives beyond the obvious failures: scores that are finite but
overflow the batch's float32 statistics (1e308, a huge int, two large rewards whose sum
overflows), and arguments it changes in place, which no other function may see."""

from __future__ import annotations

import threading

import pytest
import torch

from learner.step.advantages import group_advantages
from rewards.scoring import (
    FLOAT32_MAX,
    RewardOutputError,
    RewardRunner,
    RewardSpec,
    overflow,
)
from tests.rewards.test_scoring import COMPLETIONS, PROMPTS, length


def constant(value: float):
    def fn(prompts, completions, **columns):
        return [value] * len(completions)

    return fn


def first_group_advantages(rewards: list[float]) -> list[torch.Tensor]:
    """The first group's advantages on each of the learner's paths: group or batch std, every
    sample valid or the last one left out (a failed episode)."""
    t = torch.tensor(rewards, dtype=torch.float32)
    some = torch.tensor([True] * (len(rewards) - 1) + [False])
    return [
        group_advantages(t, 2, scale=scale, valid=valid)[0][:2]
        for scale in ("group", "batch")
        for valid in (None, some)
    ]


def test_what_overflows_is_what_breaks_the_advantages():
    """The bound is float32's: the first group's rewards differ, and the advantages are finite
    and non-zero on every path when ``overflow`` passes them; when it refuses them, some path
    gives that group no signal (inf/NaN, or 0 from an inf std)."""
    for rewards in ([1e308, 0.0, 0.0, 1.0], [0.0, 1e20, 0.0, 1.0], [3e38, -3e38, 0.0, 1.0]):
        assert overflow(rewards) is not None, rewards
        paths = first_group_advantages(rewards)
        assert any(not torch.isfinite(a).all() or not a.all() for a in paths), (rewards, paths)
    for rewards in ([0.0, 1e18, 0.0, 1.0], [-1e9, 1e9, 0.5, 0.25], [0.0, 1.0, 0.5, 0.25]):
        assert overflow(rewards) is None, rewards
        paths = first_group_advantages(rewards)
        assert all(torch.isfinite(a).all() and a.all() for a in paths), (rewards, paths)


async def test_a_score_of_1e308_is_refused_like_a_nan():
    runner = RewardRunner(
        [RewardSpec(name="huge"), RewardSpec(name="length")],
        funcs={"huge": constant(1e308), "length": length},
    )
    with pytest.raises(RewardOutputError, match="overflow") as info:
        await runner.score(PROMPTS, COMPLETIONS)
    assert info.value.function == "huge"
    assert "1e+308" in str(info.value) and "scale the scores down" in str(info.value)


@pytest.mark.parametrize("policy", ["none", "zero"])
async def test_under_a_policy_an_overflowing_reward_is_a_recorded_failure(policy):
    runner = RewardRunner(
        [RewardSpec(name="huge"), RewardSpec(name="length")],
        funcs={"huge": constant(1e308), "length": length},
        policy=policy,
    )
    res = await runner.score(PROMPTS, COMPLETIONS)
    assert res.per_function["huge"] == ([None] * 3 if policy == "none" else [0.0] * 3)
    assert res.total == [1.0, 2.0, 3.0]
    assert res.metrics["reward/huge/failures"] == 1.0 and "overflow" in res.failures["huge"]
    assert res.metrics["reward/total/mean"] == 2.0
    assert runner.failure_counts == {"huge": 1, "length": 0}


async def test_rewards_that_overflow_only_together_blame_the_largest():
    """Each below float32's range, their weighted sum is not: the largest contributor fails."""
    runner = RewardRunner(
        [RewardSpec(name="big"), RewardSpec(name="bigger", weight=2.0)],
        funcs={"big": constant(1e38), "bigger": constant(1e38)},
        policy="zero",
    )
    assert overflow([1e38] * 3) is None and overflow([3e38] * 3) is not None
    res = await runner.score(PROMPTS, COMPLETIONS)
    assert list(res.failures) == ["bigger"] and "weight 2" in res.failures["bigger"]
    assert res.total == [1e38] * 3


async def test_a_spread_beyond_float32_squares_is_refused():
    """0 and 1e20 side by side: each finite in float32, but their squares are not."""
    runner = RewardRunner(
        [RewardSpec(name="spread")],
        funcs={"spread": lambda p, c: [0.0, 1e20, 0.0]},
    )
    with pytest.raises(RewardOutputError, match="squared deviations"):
        await runner.score(PROMPTS, COMPLETIONS)
    assert FLOAT32_MAX < 1e20 * 1e20


async def test_an_int_too_large_for_a_float_is_a_named_output_error():
    runner = RewardRunner([RewardSpec(name="int")], funcs={"int": constant(10**400)})
    with pytest.raises(RewardOutputError, match="int too large for a float") as info:
        await runner.score(PROMPTS, COMPLETIONS)
    assert info.value.function == "int"


async def test_a_function_that_changes_its_arguments_changes_only_its_own_copy():
    """One function clears the completions, rewrites a chat prompt, a column and the token ids
    in place while another reads them: the other scores what was generated, nobody is blamed, and the caller's
    lists are as they were."""
    changed = threading.Event()

    def vandal(prompts, completions, gold, completion_ids):
        n = len(completions)
        completions.clear()
        prompts[0][0]["content"] = "changed"
        gold[:] = ["x"] * n
        completion_ids[0].append(99)
        changed.set()
        return [0.0] * n

    seen: dict[str, object] = {}

    def reader(prompts, completions, gold, completion_ids):
        assert changed.wait(30)  # reads after the vandal changed its arguments
        seen.update(prompt=prompts[0][0]["content"], gold=list(gold), ids=completion_ids[0])
        return [float(len(c)) for c in completions]

    prompts = [[{"role": "user", "content": f"p{i}"}] for i in range(3)]
    completions, gold, ids = list(COMPLETIONS), ["a", "b", "c"], [[1], [2, 2], [3, 3, 3]]
    runner = RewardRunner(
        [RewardSpec(name="vandal"), RewardSpec(name="reader")],
        funcs={"vandal": vandal, "reader": reader},
    )
    for _ in range(2):  # and the next batch sees nothing of the first's changes
        res = await runner.score(prompts, completions, {"gold": gold, "completion_ids": ids})
        assert res.per_function["reader"] == [1.0, 2.0, 3.0]
        assert seen == {"prompt": "p0", "gold": ["a", "b", "c"], "ids": [1]}
        changed.clear()
    assert completions == COMPLETIONS and gold == ["a", "b", "c"] and ids[0] == [1]
    assert prompts[0][0]["content"] == "p0"
