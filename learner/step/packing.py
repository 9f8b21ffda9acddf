"""Padding-free micro-batches: several rollouts packed into one row, so padding costs no compute.

Rollouts are grouped best-fit-decreasing under a token budget; each group becomes one ``[1, T]``
row in which every sequence restarts its position ids and attends only to itself (a
block-diagonal causal mask for SDPA/eager attention; flash-attention reads the sequence starts
from the position ids). The loss is identical to the padded layout's: same tokens, same targets,
same masks — only where they sit in memory differs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from learner.model.routing import route_rows
from learner.step.batch import Rollout, TrainBatch


def best_fit_decreasing(lengths: list[int], budget: int) -> list[list[int]]:
    """Indices grouped into bins of total length <= ``budget`` (a longer item gets its own bin)."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        n = lengths[i]
        best = -1
        for b, r in enumerate(room):
            if n <= r and (best < 0 or r < room[best]):
                best = b
        if best < 0:
            bins.append([i])
            room.append(budget - n)
        else:
            bins[best].append(i)
            room[best] -= n
    return bins


@dataclass
class PackedBatch(TrainBatch):
    position_ids: torch.Tensor | None = None  # [1, T]
    seq_ids: torch.Tensor | None = None  # [T] which rollout each token belongs to
    seq_advantage_index: torch.Tensor | None = None  # [T-1] rollout of each target position

    def to(self, device: torch.device | str) -> PackedBatch:
        base = super().to(device)
        return PackedBatch(
            base.input_ids,
            base.attention_mask,
            base.loss_mask,
            base.sampling_logprobs,
            base.advantages,
            base.seq_weights,
            base.routes,
            self.position_ids.to(device) if self.position_ids is not None else None,
            self.seq_ids.to(device) if self.seq_ids is not None else None,
            (self.seq_advantage_index.to(device) if self.seq_advantage_index is not None else None),
        )

    def block_causal_mask(self) -> torch.Tensor:
        """``[1, 1, T, T]`` bool: token i attends to j <= i of its own sequence."""
        assert self.seq_ids is not None
        t = self.seq_ids.numel()
        causal = torch.ones(t, t, dtype=torch.bool, device=self.seq_ids.device).tril()
        return (causal & (self.seq_ids[:, None] == self.seq_ids[None, :]))[None, None]


def pack(rollouts: list[Rollout]) -> PackedBatch:
    """One row holding every rollout back to back. Targets never cross sequence boundaries."""
    ids: list[int] = []
    pos: list[int] = []
    seq: list[int] = []
    loss: list[float] = []
    samp: list[float] = []
    for k, r in enumerate(rollouts):
        p, c = len(r.prompt_ids), len(r.completion_ids)
        ids += r.prompt_ids + r.completion_ids
        pos += list(range(p + c))
        seq += [k] * (p + c)
        # targets of this sequence: positions 0..p+c-2 predict tokens 1..p+c-1; the last position
        # would predict the next sequence's first token: never in the loss.
        loss += [0.0] * (p - 1) + [float(m) for m in r.completion_mask] + [0.0]
        samp += [0.0] * (p - 1) + list(r.sampling_logprobs) + [0.0]
    t = len(ids)
    seq_t = torch.tensor(seq, dtype=torch.long)
    lengths = [len(r.prompt_ids) + len(r.completion_ids) for r in rollouts]
    offsets = [sum(lengths[:k]) for k in range(len(rollouts))]
    routes = route_rows([(r.routes, n) for r, n in zip(rollouts, lengths, strict=True)], t, offsets)
    return PackedBatch(
        input_ids=torch.tensor([ids], dtype=torch.long),
        attention_mask=torch.ones((1, t), dtype=torch.long),
        loss_mask=torch.tensor([loss[: t - 1]], dtype=torch.float32),
        sampling_logprobs=torch.tensor([samp[: t - 1]], dtype=torch.float32),
        advantages=torch.tensor([r.advantage for r in rollouts], dtype=torch.float32),
        routes=routes,
        position_ids=torch.tensor([pos], dtype=torch.long),
        seq_ids=seq_t,
        seq_advantage_index=seq_t[:-1].clone(),
    )


def packed_micro_batches(rollouts: list[Rollout], max_tokens: int) -> list[list[Rollout]]:
    lengths = [len(r.prompt_ids) + len(r.completion_ids) for r in rollouts]
    return [[rollouts[i] for i in b] for b in best_fit_decreasing(lengths, max_tokens)]
