"""What ``python -m learner`` prints when a user's reward function raises during training: the
function's own frames (not the thread and runner frames that called it), then one line."""

from __future__ import annotations

import traceback

import pytest

from learner.cli import user_traceback
from rewards.scoring import RewardFunctionError, RewardRunner, RewardSpec


def reads_a_missing_column(prompts, completions, **columns):
    return [columns["answer"] for _ in completions]


async def test_a_raising_reward_shows_its_own_frames_only():
    runner = RewardRunner([RewardSpec(name="r")], funcs={"r": reads_a_missing_column})
    with pytest.raises(RewardFunctionError) as info:
        await runner.score(["p"], ["c"])
    full = "".join(traceback.format_exception(info.value.__cause__))
    assert "grpo_common/threads.py" in full  # what the filter has to drop

    shown = user_traceback(info.value.__cause__)
    frames = [line for line in shown.splitlines() if line.startswith("  File ")]
    assert frames[0].endswith(", in reads_a_missing_column")
    assert __file__ in frames[0]
    assert "grpo_common/threads.py" not in shown and "rewards/scoring.py" not in shown
    assert shown.splitlines()[-1] == "KeyError: 'answer'"
    assert str(info.value) == "reward function 'r': raised KeyError: 'answer'"


def test_an_error_without_a_cause_prints_no_traceback():
    assert user_traceback(None) == ""
