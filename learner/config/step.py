"""[grpo] and [optim]: how each step's rollouts become a weight update, the loss and its
variants (each combination checked against the others at load) and the optimizer.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from learner.config.base import FieldError, Section


class GRPOConfig(Section):
    prompts_per_step: int = Field(8, ge=1, description="prompts per optimizer step (all ranks)")
    num_iterations: int = Field(1, ge=1, description="optimizer passes over each batch")
    micro_batch_size: int = Field(16, ge=1, description="sequences per forward/backward")
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group",
        description="advantages are reward - group mean, divided by the group's std (group), "
        "the batch's std (batch) or nothing (none: Dr. GRPO)",
    )
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo"] = Field(
        "dapo",
        description="how token losses are averaged: grpo per sequence then over sequences; bnpo "
        "over a micro-batch's tokens; dr_grpo over sequences × max_tokens; dapo over the "
        "optimizer step's tokens",
    )
    eps_low: float = Field(0.2, ge=0, description="PPO clip: the ratio's floor is 1 - eps_low")
    eps_high: float = Field(
        0.28, ge=0, description="PPO clip: the ratio's ceiling is 1 + eps_high (DAPO's clip-higher)"
    )
    beta: float = Field(0.0, ge=0, description="KL coefficient (k3) to a frozen reference")
    tis_cap: float | None = Field(
        2.0,
        description="truncated IS cap; none disables it, and then the rollout server is not "
        "asked for log-probs",
    )
    entropy_coef: float = Field(
        0.0, description="entropy bonus: this times the token entropy is subtracted from the loss"
    )
    importance_sampling_level: Literal["token", "sequence"] = Field(
        "token",
        description="sequence: GSPO's ratio, one per completion (the geometric mean of its "
        "tokens'), clipped as a whole; use GSPO's small clip ranges (eps_low = 3e-4, eps_high "
        "= 4e-4). Not with fused_loss",
    )
    skip_zero_advantage: bool = Field(
        True,
        description="leave out of the forward/backward the rollouts whose gradient is zero: "
        "those of zero advantage (with beta = 0 and entropy_coef = 0) and those without loss "
        "tokens; same gradient, less work",
    )
    count_zero_advantage: bool = Field(
        True,
        description="false: zero-advantage rollouts do not count in the loss normalisers (the "
        "loss averages over the informative rollouts alone, as with DAPO's dynamic sampling "
        "but without generating more); needs beta = 0 and entropy_coef = 0",
    )
    dynamic_sampling: bool = Field(
        False,
        description="DAPO's dynamic sampling: a step tops its batch up to prompts_per_step "
        "informative groups (rewards not all equal) with more rounds of prompts, and leaves the "
        "uninformative groups out",
    )
    max_sampling_rounds: int = Field(
        4,
        ge=2,
        description="with dynamic_sampling: rounds of generation a step may take (the first "
        "included); a batch still short after them is filled with uninformative groups",
    )
    logprob_chunk_size: int = Field(
        1024, ge=1, description="tokens per chunk of the LM head when computing log-probs"
    )
    fused_loss: bool = Field(
        False, description="loss fused with the LM head: 3 N·H·V products instead of 4"
    )
    fused_chunk_size: int | None = Field(
        None, ge=1, description="tokens a chunk of the fused loss; none: 1.5 × hidden (1024-4096)"
    )
    packing: bool = Field(False, description="padding-free micro-batches (best-fit packing)")
    max_tokens_per_micro_batch: int = Field(4096, ge=1, description="packing token budget")
    pad_to_multiple_of: int = Field(
        1, ge=1, description="without packing: pad each micro-batch's length to a multiple of this"
    )
    mask_truncated_completions: bool = Field(
        False, description="completions cut at max_tokens get no loss (DAPO overlong filter)"
    )
    max_prompt_tokens: int | None = Field(None, ge=1, description="longer prompts are cut")
    overlong_prompts: Literal["truncate_left", "mask"] = Field(
        "truncate_left",
        description="truncate_left: keep the prompt's end; mask: also exclude from the loss",
    )

    @model_validator(mode="after")
    def _sequence_ratio_is_not_separable(self) -> GRPOConfig:
        if self.importance_sampling_level == "sequence" and self.fused_loss:
            raise FieldError(
                "importance_sampling_level",
                '"sequence" ties every token\'s gradient to its whole completion, and the fused '
                "loss computes each token's gradient on its own: set fused_loss = false, or "
                'importance_sampling_level = "token"',
            )
        return self

    @model_validator(mode="after")
    def _uncounted_needs_policy_gradient_only(self) -> GRPOConfig:
        if not self.count_zero_advantage and (self.beta != 0.0 or self.entropy_coef != 0.0):
            raise FieldError(
                "count_zero_advantage",
                f"false leaves zero-advantage rollouts out of the loss, but their tokens have "
                f"a gradient with beta = {self.beta} and entropy_coef = {self.entropy_coef}: "
                "set both to 0, or count_zero_advantage = true",
            )
        return self


class OptimConfig(Section):
    lr: float = Field(1e-6, gt=0, description="AdamW's peak learning rate")
    weight_decay: float = Field(0.0, ge=0, description="AdamW's decoupled weight decay")
    betas: tuple[float, float] = Field((0.9, 0.99), description="AdamW's beta1 and beta2")
    max_grad_norm: float = Field(
        1.0, gt=0, description="clip the gradient's global norm to this before each step"
    )
    schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="the learning rate after warmup, over run.steps"
    )
    warmup_steps: int = Field(0, ge=0, description="steps of linear warmup from 0 to lr")
    fused: bool | Literal["auto"] = Field(
        "auto",
        description="AdamW as one fused kernel; 'auto': on a GPU wherever the optimizer states "
        "are on it (under DeepSpeed too, unless the optimizer is offloaded to the CPU)",
    )
