"""Rollouts -> padded training tensors. Pure functions, no model, no HTTP.

A rollout is a prompt (token ids) followed by a completion (token ids). For multi-turn episodes the
completion interleaves sampled tokens (mask 1) with tool/template tokens (mask 0), which are in
the sequence as context but never in the loss.

Everything is aligned to *targets*: position ``t`` of a ``[B, T-1]`` tensor is about predicting
token ``t + 1`` of the padded ``[B, T]`` input.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from learner.model.routing import route_rows


@dataclass
class Rollout:
    prompt_ids: list[int]
    completion_ids: list[int]
    sampling_logprobs: list[float]  # server log-probs, one per completion token (0 where masked)
    completion_mask: list[int]  # 1 = sampled by the policy, 0 = tool/template token
    advantage: float = 0.0
    weight_version: int = 0
    # the server's routed experts, [prompt + completion - 1, layers, k] (routing replay)
    routes: Any = None


@dataclass
class TrainBatch:
    input_ids: torch.Tensor  # [B, T] long, right-padded
    attention_mask: torch.Tensor  # [B, T] long
    loss_mask: torch.Tensor  # [B, T-1] float, 1 where the target is a sampled completion token
    sampling_logprobs: torch.Tensor  # [B, T-1] float32, aligned with loss_mask
    advantages: torch.Tensor  # [B] float32
    # [B] float64: each row's weight in the step's loss (`loss.LossInputs.seq_weights`), set by
    # `train_step.build_micro_batches`; None: the loss normalises by this micro-batch alone
    seq_weights: torch.Tensor | None = None
    # [B, T, layers, k] int16 experts to replay (-1: the model's own routing); None: none
    routes: torch.Tensor | None = None

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum().item())

    def to(self, device: torch.device | str) -> TrainBatch:
        return TrainBatch(
            *(t.to(device) for t in (self.input_ids, self.attention_mask, self.loss_mask)),
            self.sampling_logprobs.to(device),
            self.advantages.to(device),
            self.seq_weights.to(device) if self.seq_weights is not None else None,
            routes=self.routes.to(device) if self.routes is not None else None,
        )


def collate(rollouts: list[Rollout], pad_id: int, pad_to_multiple_of: int = 1) -> TrainBatch:
    if not rollouts:
        raise ValueError("collate needs at least one rollout")
    for r in rollouts:
        if not (len(r.completion_ids) == len(r.sampling_logprobs) == len(r.completion_mask)):
            raise ValueError(
                "a rollout's completion_ids, sampling_logprobs and completion_mask differ in length"
            )
    lengths = [len(r.prompt_ids) + len(r.completion_ids) for r in rollouts]
    seq_len = max(lengths)
    seq_len = -(-seq_len // pad_to_multiple_of) * pad_to_multiple_of
    b = len(rollouts)
    input_ids = torch.full((b, seq_len), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((b, seq_len), dtype=torch.long)
    loss_mask = torch.zeros((b, seq_len - 1), dtype=torch.float32)
    sampling = torch.zeros((b, seq_len - 1), dtype=torch.float32)
    for i, r in enumerate(rollouts):
        p, c = len(r.prompt_ids), len(r.completion_ids)
        input_ids[i, : p + c] = torch.tensor(r.prompt_ids + r.completion_ids, dtype=torch.long)
        attention_mask[i, : p + c] = 1
        # token p + j (completion token j) is predicted at target position p + j - 1
        loss_mask[i, p - 1 : p - 1 + c] = torch.tensor(r.completion_mask, dtype=torch.float32)
        sampling[i, p - 1 : p - 1 + c] = torch.tensor(r.sampling_logprobs, dtype=torch.float32)
    advantages = torch.tensor([r.advantage for r in rollouts], dtype=torch.float32)
    routes = route_rows([(r.routes, n) for r, n in zip(rollouts, lengths, strict=True)], seq_len)
    return TrainBatch(input_ids, attention_mask, loss_mask, sampling, advantages, routes=routes)


def micro_batches(rollouts: list[Rollout], size: int) -> list[list[Rollout]]:
    """Split into micro-batches of ``size``, grouping similar lengths to cut padding."""
    order = sorted(range(len(rollouts)), key=lambda i: -len(rollouts[i].completion_ids))
    ordered = [rollouts[i] for i in order]
    return [ordered[i : i + size] for i in range(0, len(ordered), size)]
