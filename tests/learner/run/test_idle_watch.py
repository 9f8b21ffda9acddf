"""``IdleWatch``: a run whose steps train nothing (every group zero-advantage, a reward that
fails under its policy) says so once it lasts a few steps, naming why; a step that trains
anything resets it. And the real learner says it in its log."""

from __future__ import annotations

from pathlib import Path

import pytest

from learner.run.idle import IdleWatch
from tests.learner.demo_runs import run_ok

IDLE = {"tokens/trained": 0.0, "groups/zero_advantage": 8.0, "reward/mean": 0.0, "reward/std": 0.0}


def test_the_watch_warns_once_nothing_trains_for_a_few_steps_and_again_while_it_lasts() -> None:
    watch = IdleWatch(groups=8, patience=3, every=4)
    trained = [0, 0, 5, 0, 0, 0, 0, 0, 0, 0, 0, 7, 0]
    warned = [
        s
        for s, t in enumerate(trained, 1)
        if watch.check(s, {**IDLE, "tokens/trained": float(t)}) is not None
    ]
    # 1-2 idle, reset by 3; 4-11 idle: the 3rd (6), then every 4th (10); 12 resets
    assert warned == [6, 10]
    assert IdleWatch(groups=8).check(1, {"loss": 0.0}) is None  # no token count: no evidence


def test_the_warning_names_the_zero_advantage_groups_and_the_failed_rewards() -> None:
    watch = IdleWatch(groups=8, patience=1)
    message = watch.check(7, {**IDLE, "reward/huge/failures": 1.0, "reward/len/failures": 0.0})
    assert message is not None
    assert message.startswith("step 7: nothing was trained for 1 steps in a row")
    assert "groups/zero_advantage = 8 of 8" in message and "every completion got 0" in message
    assert "reward function(s) ['huge'] failed" in message and "'len'" not in message
    assert "sampling.temperature" in message

    partly = IdleWatch(groups=8, patience=1).check(1, {**IDLE, "groups/zero_advantage": 5.0})
    assert partly is not None and "no completion had a non-zero advantage" in partly


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_run_whose_reward_never_varies_says_it_trains_nothing(tmp_path: Path) -> None:
    """The tiny random model never writes ``<think>..</think><answer>..</answer>``: the format
    reward is 0 for every completion, so every group is zero-advantage and no step trains."""
    proc = run_ok(
        tmp_path / "run",
        'rewards=[{name="format"}]',
        "eval=none",
        "run.steps=4",
        "run.save_final=false",
        timeout=600,
    )
    warnings = [line for line in proc.stderr.splitlines() if "nothing was trained" in line]
    assert len(warnings) == 1, proc.stderr[-3000:]
    assert "step 3: nothing was trained for 3 steps in a row" in warnings[0]
    assert "groups/zero_advantage = 8 of 8" in warnings[0]
    assert "every completion got 0" in warnings[0]
