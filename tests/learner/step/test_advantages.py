"""Group-relative advantages against hand-computed numbers."""

import math

import pytest
import torch

from learner.step.advantages import group_advantages


def test_group_scale_hand_computed():
    # Group 1: rewards 1, 2, 3 -> mean 2, unbiased std 1 -> (-1, 0, 1) / (1 + 1e-4).
    # Group 2: rewards 5, 5, 5 -> all equal -> exactly 0, counted as a zero-advantage group.
    rewards = torch.tensor([1.0, 2.0, 3.0, 5.0, 5.0, 5.0])
    adv, zero = group_advantages(rewards, group_size=3)
    d = 1.0 + 1e-4
    expected = torch.tensor([-1 / d, 0.0, 1 / d, 0.0, 0.0, 0.0])
    torch.testing.assert_close(adv, expected, rtol=1e-6, atol=1e-7)
    assert zero == 1


def test_group_scale_binary_rewards():
    # Group [1, 0]: mean 0.5, unbiased std sqrt(0.5) = 0.70711 -> ±0.5 / 0.70721 = ±0.70700.
    # Groups [0, 0] and [1, 1]: zero advantage, 2 such groups.
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0])
    adv, zero = group_advantages(rewards, group_size=2, eps=1e-4)
    a = 0.5 / (math.sqrt(0.5) + 1e-4)
    torch.testing.assert_close(adv, torch.tensor([a, -a, 0.0, 0.0, 0.0, 0.0]))
    assert abs(a - 0.70700) < 1e-5
    assert zero == 2


def test_batch_scale_hand_computed():
    # Rewards [0, 1 | 0, 0]: centred by group -> [-0.5, 0.5, 0, 0].
    # Batch mean 0.25, unbiased var = (3 * 0.0625 + 0.5625) / 3 = 0.25 -> std 0.5.
    rewards = torch.tensor([0.0, 1.0, 0.0, 0.0])
    adv, zero = group_advantages(rewards, group_size=2, scale="batch", eps=1e-4)
    torch.testing.assert_close(adv, torch.tensor([-0.5 / 0.5001, 0.5 / 0.5001, 0.0, 0.0]))
    assert zero == 1


def test_none_scale_is_dr_grpo_centering():
    # Dr. GRPO: no std division. Group [3, 1] -> mean 2 -> [1, -1]; group [2, 6] -> [-2, 2].
    rewards = torch.tensor([3.0, 1.0, 2.0, 6.0])
    adv, zero = group_advantages(rewards, group_size=2, scale="none")
    torch.testing.assert_close(adv, torch.tensor([1.0, -1.0, -2.0, 2.0]))
    assert zero == 0


def test_all_equal_non_representable_rewards_are_exactly_zero():
    # 0.1 is not exact in binary; the group mean may differ from 0.1 by a rounding, yet the
    # advantages must be exactly 0, not ±1e-8 / (1e-9 + eps).
    rewards = torch.full((7,), 0.1)
    adv, zero = group_advantages(rewards, group_size=7)
    assert torch.equal(adv, torch.zeros(7))
    assert zero == 1


def test_bf16_rewards_computed_in_fp32():
    rewards = torch.tensor([0.0, 1.0], dtype=torch.bfloat16)
    adv, _ = group_advantages(rewards, group_size=2)
    assert adv.dtype == torch.float32


def test_group_size_one_gives_zero_and_counts_every_group():
    adv, zero = group_advantages(torch.tensor([0.3, 0.9]), group_size=1)
    assert torch.equal(adv, torch.zeros(2))
    assert zero == 2


@pytest.mark.parametrize(
    ("rewards", "group_size", "scale", "match"),
    [
        (torch.zeros(5), 2, "group", "multiple of group_size"),
        (torch.zeros(2, 2), 2, "group", "1-D"),
        (torch.zeros(4), 0, "group", "group_size must be"),
        (torch.zeros(4), 2, "std", "scale must be"),
    ],
)
def test_bad_inputs_name_the_problem(rewards, group_size, scale, match):
    with pytest.raises(ValueError, match=match):
        group_advantages(rewards, group_size, scale=scale)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_invalid_samples_are_left_out_of_their_group(scale):
    """A failed episode (invalid) gets 0 and does not move its siblings' baseline: the valid
    samples get exactly what they would get as a group of their own."""
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.0, 0.3, 0.3, 0.9, 0.1])
    valid = torch.tensor([True, True, True, False, True, True, False, True])
    adv, zero = group_advantages(rewards, group_size=4, scale=scale, valid=valid)
    alone, _ = group_advantages(torch.tensor([1.0, 0.0, 0.5]), group_size=3, scale="group")
    if scale == "group":
        assert torch.allclose(adv[:3], alone, atol=1e-6)
    if scale == "none":
        assert torch.allclose(adv[:3], torch.tensor([0.5, -0.5, 0.0]))
    if scale == "batch":  # the std over the 6 valid rewards
        v = rewards[valid]
        assert torch.allclose(adv[:3], (rewards[:3] - 0.5) / (v.std() + 1e-4), atol=1e-6)
    assert adv[3] == 0 and adv[6] == 0
    # the second group's valid rewards are 0.3, 0.3, 0.1: not all equal
    assert adv[4] == adv[5] and adv[4] > 0 > adv[7]
    assert zero == 0
    one_valid = torch.tensor([True, False, False, False] * 2)
    adv, zero = group_advantages(rewards, group_size=4, scale=scale, valid=one_valid)
    assert zero == 2 and not adv.any()
    everything = torch.ones(8, dtype=torch.bool)  # all valid: the unmasked result
    assert torch.equal(
        group_advantages(rewards, 4, scale, valid=everything)[0],
        group_advantages(rewards, 4, scale)[0],
    )
