"""Group-relative advantages: the "G" in GRPO.

Each prompt is sampled G times; a completion's advantage is how much better its reward is than
its siblings', so no value network is needed. Groups whose rewards are all equal carry no
learning signal (every advantage is exactly 0): they are counted so the learner can report how
much of the batch was wasted (DAPO filters such groups out; we only count them here).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

Scale = Literal["group", "batch", "none"]


def group_advantages(
    rewards: Tensor,
    group_size: int,
    scale: Scale = "group",
    eps: float = 1e-4,
    valid: Tensor | None = None,
) -> tuple[Tensor, int]:
    """Return `(advantages [B*G], number of zero-advantage groups)`.

    `rewards` is `[B*G]`, the G samples of each prompt contiguous (prompt-major), as the rollout
    server returns them. Advantages are `r - mean_group`, divided by

    - `"group"`: the group's std + eps (GRPO, DeepSeekMath),
    - `"batch"`: the whole batch's std + eps (more robust when a group's std is tiny),
    - `"none"`: nothing (Dr. GRPO: the std division biases towards easy/hard prompts).

    The std is the unbiased one (`torch.std`), as in TRL. Computed in float32 at least, so bf16
    rewards do not round the small differences away.

    `valid` (`[B*G]` bool): samples that count, e.g. not an episode whose environment failed.
    The others get advantage 0 and stay out of their group's mean and std (and the batch's); a
    group with fewer than two valid samples is a zero-advantage group.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [B*G], got shape {tuple(rewards.shape)}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if rewards.numel() % group_size != 0:
        raise ValueError(
            f"rewards has {rewards.numel()} entries, not a multiple of group_size={group_size}: "
            "pass the G samples of every prompt"
        )
    if scale not in ("group", "batch", "none"):
        raise ValueError(f"scale must be 'group', 'batch' or 'none', got {scale!r}")
    if valid is not None and valid.shape != rewards.shape:
        raise ValueError(f"valid has shape {tuple(valid.shape)}, rewards {tuple(rewards.shape)}")
    if valid is not None and not bool(valid.all()):
        return _masked_advantages(rewards, group_size, scale, eps, valid)
    dtype = torch.promote_types(rewards.dtype, torch.float32)
    grouped = rewards.to(dtype).view(-1, group_size)  # [B, G]
    mean = grouped.mean(dim=1, keepdim=True)  # [B, 1]
    centered = grouped - mean  # [B, G]
    # A group is "zero-advantage" when every reward equals the first one (exact comparison:
    # rewards are usually 0/1 and an epsilon here would hide real but small differences).
    all_equal = (grouped == grouped[:, :1]).all(dim=1, keepdim=True)  # [B, 1]
    zero_groups = int(all_equal.sum().item())
    if scale == "group":
        std = grouped.std(dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(mean)
        adv = centered / (std + eps)
    elif scale == "batch":
        std = grouped.std() if grouped.numel() > 1 else torch.zeros((), dtype=dtype)
        adv = centered / (std + eps)
    else:
        adv = centered
    # All-equal groups get exactly 0 (their mean may differ from the rewards by a rounding).
    adv = torch.where(all_equal, torch.zeros_like(adv), adv)
    return adv.reshape(-1), zero_groups


def _masked_advantages(
    rewards: Tensor, group_size: int, scale: Scale, eps: float, valid: Tensor
) -> tuple[Tensor, int]:
    """``group_advantages`` over the valid samples only (see there)."""
    dtype = torch.promote_types(rewards.dtype, torch.float32)
    grouped = rewards.to(dtype).view(-1, group_size)  # [B, G]
    mask = valid.view(-1, group_size)  # [B, G] bool
    w = mask.to(dtype)
    count = w.sum(dim=1, keepdim=True)  # [B, 1]
    mean = (grouped * w).sum(dim=1, keepdim=True) / count.clamp(min=1)
    centered = (grouped - mean) * w  # [B, G], 0 where invalid
    big, small = torch.finfo(dtype).max, torch.finfo(dtype).min
    hi = torch.where(mask, grouped, small).amax(dim=1, keepdim=True)
    lo = torch.where(mask, grouped, big).amin(dim=1, keepdim=True)
    all_equal = (count < 2) | (hi == lo)  # [B, 1]
    zero_groups = int(all_equal.sum().item())
    if scale == "group":
        std = (centered.square().sum(dim=1, keepdim=True) / (count - 1).clamp(min=1)).sqrt()
        adv = centered / (std + eps)
    elif scale == "batch":
        n = w.sum()
        batch_mean = (grouped * w).sum() / n.clamp(min=1)
        var = ((grouped - batch_mean) * w).square().sum() / (n - 1).clamp(min=1)
        adv = centered / (var.sqrt() + eps)
    else:
        adv = centered
    adv = torch.where(all_equal | ~mask, torch.zeros_like(adv), adv)
    return adv.reshape(-1), zero_groups
