"""The built-in rewards on real answer formats, and the code sandbox's limits."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from rewards.builtin.code import code_reward, run_python_tests
from rewards.builtin.format import format_reward
from rewards.builtin.length import length_reward
from rewards.builtin.math import math_accuracy
from rewards.builtin.overlong import overlong_penalty
from rewards.scoring import (
    RewardFunctionError,
    RewardRunner,
    RewardSpec,
    RewardSpecError,
    RewardTimeoutError,
)

GSM8K_GOLD = (
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
    "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72"
)


@pytest.mark.parametrize(
    "completion,gold,expected",
    [
        ("In May she sold 24, so 48 + 24 = 72 in total.\n#### 72", GSM8K_GOLD, 1.0),
        ("48 + 24 = 71.\n#### 71", GSM8K_GOLD, 0.0),
        ("<think>24 in May, 48 in April, 72 total</think>She sold 72 clips.", GSM8K_GOLD, 1.0),
        ("So the probability is \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}", 1.0),
        ("So the probability is \\boxed{\\frac{1}{2}}.", "0.5", 1.0),
        ("The probability is 0.5", "1/2", 1.0),
        ("The probability is \\boxed{0.25}", "1/2", 0.0),
        ("We get $x = 3$, and the answer is \\boxed{-3}", "-3", 1.0),
        ("The total is 1,000 dollars", "#### 1000", 1.0),
        ("I don't know", "42", 0.0),
    ],
)
def test_math_accuracy_on_real_formats(completion, gold, expected):
    assert math_accuracy([""], [completion], answer=[gold]) == [expected]


def test_math_accuracy_abstains_without_gold_and_names_missing_column():
    assert math_accuracy(["", ""], ["42", "42"], answer=[None, ""]) == [None, None]
    assert math_accuracy([""], ["\\boxed{7}"], gold_column="solution", solution=["7"]) == [1.0]
    with pytest.raises(KeyError, match="column 'answer'"):
        math_accuracy([""], ["42"], solution=["42"])


async def test_math_accuracy_in_the_runner_thread(caplog):
    """The runner calls sync rewards from a worker thread, where math-verify's signal-based
    timeout cannot work; the reward must still grade there, without math-verify warning on every
    step that its timeout is off (the runner's scoring.timeout_s bounds it)."""
    runner = RewardRunner([RewardSpec(name="math_accuracy")])
    with caplog.at_level(logging.WARNING):
        res = await runner.score(
            ["q"] * 2, ["#### 72", "\\boxed{0.5}"], {"answer": [GSM8K_GOLD, "1/2"]}
        )
    assert res.per_function["math_accuracy"] == [1.0, 1.0]
    assert not [r for r in caplog.records if r.name.startswith("math_verify")], caplog.text


def test_format_reward():
    good = "<think>\nsteps\n</think>\n<answer>42</answer>"
    bad = ["<answer>42</answer>", "<think>x</think> 42", "<think>x</think><answer>4</answer> extra"]
    assert format_reward([""] * 4, [good, *bad]) == [1.0, 0.0, 0.0, 0.0]
    assert format_reward([""] * 2, ["#### 5", "5"], pattern=r"####\s*\d+") == [1.0, 0.0]
    with pytest.raises(ValueError, match="invalid regex"):
        format_reward([""], ["x"], pattern="(")


def test_length_reward_by_hand():
    completions = ["one two three four", "one two", "x " * 8, ""]
    # target 4 words: |4-4|, |2-4|, |8-4|, |0-4| over 4 -> 1, 0.5, 0, 0
    assert length_reward([""] * 4, completions, target=4) == [1.0, 0.5, 0.0, 0.0]
    assert length_reward([""], ["abcdef"], target=4, unit="chars") == [0.5]
    assert length_reward([""], ["?"], target=4, unit="tokens", completion_ids=[[1, 2, 3]]) == [0.75]


def test_overlong_penalty_by_hand():
    # max 10 tokens, the last 4 a ramp: 0 up to 6 tokens, then -1/4 a token, -1 at 10 and beyond
    ids = [[0] * n for n in (0, 6, 7, 8, 10, 11)]
    got = overlong_penalty([""] * 6, ["x"] * 6, max_tokens=10, buffer=4, completion_ids=ids)
    assert got == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"max_tokens": 0}, "max_tokens=0"), ({"max_tokens": 8, "buffer": 9}, "buffer=9")],
)
def test_overlong_penalty_names_a_bad_setting(kwargs, message):
    with pytest.raises(ValueError, match=message):
        overlong_penalty([""], ["x"], completion_ids=[[1]], **kwargs)


async def test_overlong_is_registered_and_needs_its_limit():
    with pytest.raises(RewardSpecError, match="max_tokens"):
        RewardRunner([RewardSpec(name="overlong")]).check_columns(["prompt"])
    runner = RewardRunner([RewardSpec(name="overlong", kwargs={"max_tokens": 4, "buffer": 2})])
    ids = [[1], [1, 2, 3], [1, 2, 3, 4]]
    scored = await runner.score([""] * 3, ["a", "b", "c"], {"completion_ids": ids})
    assert scored.total == [0.0, -0.5, -1.0]


SOLUTION = "```python\ndef add(a, b):\n    return a + b\n```"
TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 5"]


async def test_code_reward_fraction_of_tests_passed():
    completions = [
        f"Here you go:\n{SOLUTION}\nDone.",
        "```python\ndef add(a, b):\n    return a - b\n```",  # fails all three
        "no code at all",
        SOLUTION,
        SOLUTION,
    ]
    tests = [TESTS, TESTS, TESTS, None, '["assert add(1, 1) == 2"]']
    scores = await code_reward([""] * 5, completions, tests=tests)
    assert scores == [2 / 3, 0.0, 0.0, None, 1.0]


@pytest.mark.parametrize(
    "code",
    [
        "while True:\n    pass",
        "import time\ntime.sleep(60)",
        # ignores the soft CPU-limit signal and the usual alarm signal
        "import signal\nfor s in (signal.SIGXCPU, signal.SIGALRM, signal.SIGTERM):\n"
        "    signal.signal(s, lambda *a: None)\nwhile True:\n    pass",
    ],
    ids=["busy", "sleep", "ignores-signals"],
)
async def test_code_cannot_escape_its_time_limit(code):
    t0 = time.perf_counter()
    result = await run_python_tests(code, ["assert True"], timeout_s=1.0)
    elapsed = time.perf_counter() - t0
    assert result.timed_out and result.passed == 0 and not result.completed
    assert elapsed < 2.5


async def test_forked_child_is_killed_with_the_run(tmp_path):
    pid_file = tmp_path / "child.pid"
    code = (
        "import os, time\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    time.sleep(60)\n"
        f"open({str(pid_file)!r}, 'w').write(str(pid))\n"
    )
    result = await run_python_tests(code, ["assert True"], timeout_s=5.0)
    assert result.completed and result.passed == 1
    child = int(pid_file.read_text())
    for _ in range(100):  # killed with the process group
        if not _alive(child):
            break
        await asyncio.sleep(0.02)
    else:
        pytest.fail(f"forked child {child} outlived the run")


def _alive(pid: int) -> bool:
    """Running, as opposed to gone or a zombie waiting for init to reap it."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


@pytest.mark.parametrize(
    "code,test",
    [
        # a failing test stays failed whatever the code prints or how it exits
        ("print('passed')\nprint('0')\nprint('done')", "assert False"),
        ("import sys\nsys.exit(0)", "assert False"),
        ("import os\nos._exit(0)", "assert False"),
        # over the address-space limit: MemoryError, so even a trivial test fails
        ("x = bytearray(4 * 1024**3)", "assert True"),
    ],
    ids=["print", "sys.exit", "os._exit", "memory"],
)
async def test_code_cannot_fake_a_pass_or_exceed_memory(code, test):
    result = await run_python_tests(code, [test], timeout_s=5.0, memory_mb=512)
    assert result.passed == 0 and not result.timed_out


async def test_cancelled_code_reward_kills_its_subprocess(tmp_path):
    """The runner's timeout cancels the async code reward; its sandbox must die with it."""
    pid_file = tmp_path / "pid"
    code = f"import os, time\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\ntime.sleep(60)"
    runner = RewardRunner(
        [RewardSpec(name="code", kwargs={"timeout_s": 60})], timeout_s=1.0, policy="raise"
    )
    with pytest.raises(RewardTimeoutError):
        await runner.score([""], [code], {"tests": [["assert True"]]})
    pid = int(pid_file.read_text())
    await asyncio.sleep(0.1)
    assert not _alive(pid)


async def test_code_reward_needs_its_column():
    runner = RewardRunner([RewardSpec(name="code")])
    with pytest.raises(RewardFunctionError, match="column 'tests'"):
        await runner.score([""], [SOLUTION], {"unit_tests": [TESTS]})
