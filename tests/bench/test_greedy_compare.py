"""The GPU tests' same-weights check on greedy generations (bench/gpu_common.Greedy), on CPU."""

from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

from gpu_common import Greedy  # noqa: E402


def test_identical_generations_match():
    a = Greedy([[5, 6, 7]], [[-11.0, -10.5, -11.2]])
    assert a.matches(Greedy([[5, 6, 7]], [[-11.0, -10.5, -11.2]]))


def test_a_near_tie_may_flip_and_the_rest_diverges():
    a = Greedy([[5, 6, 7, 8]], [[-11.0, -10.50, -11.2, -9.0]])
    b = Greedy([[5, 6, 9, 1]], [[-11.0, -10.51, -11.21, -14.0]])  # 7 vs 9: a tie, then anything
    assert a.matches(b) and b.matches(a)


def test_a_flip_between_unequal_choices_is_a_mismatch():
    a = Greedy([[5, 6, 7]], [[-11.0, -10.5, -11.2]])
    b = Greedy([[5, 6, 9]], [[-11.0, -10.5, -11.9]])
    assert not a.matches(b)
    assert "prompt 0 token 2" in a.mismatch(b)


def test_same_tokens_with_moved_logprobs_are_a_mismatch():
    a = Greedy([[5, 6], [1, 2]], [[-11.0, -10.5], [-3.0, -2.0]])
    b = Greedy([[5, 6], [1, 2]], [[-11.0, -10.5], [-3.0, -2.2]])  # other weights, same argmax
    assert a.mismatch(b).startswith("prompt 1 token 1")
    assert not a.matches(Greedy([[5, 6]], [[-11.0, -10.5]]))  # a prompt missing
