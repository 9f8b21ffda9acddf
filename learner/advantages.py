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
) -> tuple[Tensor, int]:
    """Return `(advantages [B*G], number of zero-advantage groups)`.

    `rewards` is `[B*G]`, the G samples of each prompt contiguous (prompt-major), as the rollout
    server returns them. Advantages are `r - mean_group`, divided by

    - `"group"`: the group's std + eps (GRPO, DeepSeekMath),
    - `"batch"`: the whole batch's std + eps (more robust when a group's std is tiny),
    - `"none"`: nothing (Dr. GRPO: the std division biases towards easy/hard prompts).

    The std is the unbiased one (`torch.std`), as in TRL. Computed in float32 at least, so bf16
    rewards do not round the small differences away.
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
