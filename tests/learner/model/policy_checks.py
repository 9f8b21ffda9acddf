"""What the model tests share: a GRPO loss through the policy's real forward, and the check
that only LoRA adapters train."""

from __future__ import annotations

import torch

from learner.loss.grpo import LossConfig, LossInputs, grpo_loss
from learner.model.policy import PolicyLogprobs
from learner.step.update import policy_forward, regroup, seq_index


def policy_loss(policy, batch, loss_type="grpo"):
    """The GRPO loss of ``batch`` (padded or packed) under ``policy``, off-policy by a constant
    (ratio != 1: the clip path is exercised too)."""
    flat, ent = policy_forward(policy, batch, with_entropy=True)
    seq = seq_index(batch)
    n = batch.advantages.numel()
    lp = regroup(flat, seq, n)
    inputs = LossInputs(
        logprobs=lp,
        old_logprobs=lp.detach() + 0.05,  # ratio != 1: exercise the clip path too
        advantages=batch.advantages,
        mask=regroup(torch.ones_like(flat), seq, n),
        sampling_logprobs=regroup(batch.sampling_logprobs[batch.loss_mask.bool()], seq, n),
        entropy=regroup(ent, seq, n),
    )
    return grpo_loss(inputs, LossConfig(loss_type=loss_type, max_completion_length=16))[0]


def assert_only_adapters_train(policy: PolicyLogprobs, batch) -> None:
    """Two optimizer steps (lora_B starts at 0: the second moves lora_A too) change both adapter
    matrices and nothing else."""
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(2):
        policy_loss(policy, batch).backward()
        opt.step()
        opt.zero_grad()
    changed = {n for n, p in policy.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all("lora_" in n for n in changed), sorted(changed)[:5]
    assert any("lora_A" in n for n in changed) and any("lora_B" in n for n in changed)
