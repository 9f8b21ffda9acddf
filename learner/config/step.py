"""[grpo] and [optim]: how each step's rollouts become a weight update, the loss and its
variants (each combination checked against the others at load) and the optimizer.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from learner.config.base import FieldError, Section
from learner.loss.settings import Correction, correction_problem, policy_problem


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
        description="the upper bound of the importance weight between the learner's and the "
        "rollout servers' log-probs of each sampled token: the cap of truncated IS (TIS), or "
        "with correction_mode = mask the bound above which weights are masked; none: no "
        "weight, and without a rejection band or correction_low the rollout server is not asked "
        "for log-probs",
    )
    correction_level: Literal["token", "sequence", "geo_sequence"] = Field(
        "token",
        description="the importance weight per token, or per completion on each of its tokens: "
        "the arithmetic (sequence) or geometric (geo_sequence) mean of its tokens' ratios. "
        "Sequence levels not with fused_loss",
    )
    correction_mode: Literal["truncate", "mask"] = Field(
        "truncate",
        description="truncate: the weight is capped at tis_cap (TIS); mask: a weight above "
        "tis_cap or below correction_low becomes 0 (MIS; at the token level with both bounds, "
        "ICEPOP's band)",
    )
    correction_low: float | None = Field(
        None,
        description='with correction_mode = "mask": weights below it are masked (in (0, 1]; '
        "ICEPOP: 0.5)",
    )
    reject_low: float | None = Field(
        None,
        description="sequence rejection: a completion whose geometric-mean ratio of learner to "
        "server probabilities is below it gets no policy gradient (in (0, 1]). Not with "
        "fused_loss",
    )
    reject_high: float | None = Field(
        None,
        description="sequence rejection: ... or above it (>= 1). Not with fused_loss",
    )
    policy_loss: Literal["ppo", "cispo", "sapo", "gmpo"] = Field(
        "ppo",
        description="the policy-gradient term: ppo (the clipped surrogate of GRPO and DAPO); "
        "cispo (MiniMax-M1: the clipped ratio, stop-gradient, weighs -A·logp; its cap is 1 + "
        "eps_high, e.g. eps_high = 4); sapo (a sigmoid gate of the ratio instead of the clip, "
        "sapo_tau_pos / sapo_tau_neg); gmpo (the geometric mean of the token ratios, each "
        "clipped in log space to [-eps_low, eps_high], e.g. 0.4 each; not with fused_loss)",
    )
    cispo_eps_low: float | None = Field(
        None,
        description="cispo: the weight's floor is 1 - cispo_eps_low; none (MiniMax-M1's "
        "choice): no floor",
    )
    sapo_tau_pos: float = Field(
        1.0, gt=0, description="sapo: the gate's temperature for positive advantages"
    )
    sapo_tau_neg: float = Field(
        1.05,
        gt=0,
        description="sapo: the gate's temperature for other advantages (larger: the gate "
        "fades faster off-policy)",
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

    @property
    def correction(self) -> Correction:
        """The off-policy correction these fields set (`learner.loss.off_policy`)."""
        return Correction.of(self)

    @property
    def needs_sampling_logprobs(self) -> bool:
        """Whether the loss reads the rollout servers' log-probs of the sampled tokens."""
        return self.correction.active

    @model_validator(mode="after")
    def _sequence_ratio_is_not_separable(self) -> GRPOConfig:
        if self.importance_sampling_level == "sequence" and self.fused_loss:
            raise FieldError(
                "importance_sampling_level",
                '"sequence" ties every token\'s gradient to its whole completion, and the fused '
                "loss computes each token's gradient on its own: set fused_loss = false, or "
                'importance_sampling_level = "token"',
            )
        if self.policy_loss == "gmpo" and self.fused_loss:
            raise FieldError(
                "policy_loss",
                '"gmpo" ties every token\'s gradient to its whole completion (a geometric mean), '
                "and the fused loss computes each token's gradient on its own: set fused_loss = "
                "false, or another policy_loss",
            )
        if self.correction_level != "token" and self.fused_loss and self.correction.weighs:
            raise FieldError(
                "correction_level",
                f'"{self.correction_level}" weighs each token by its whole completion\'s ratio, '
                "which the fused loss does not have chunk by chunk: set fused_loss = false, or "
                'correction_level = "token"',
            )
        if self.correction.rejects and self.fused_loss:
            field = "reject_low" if self.reject_low is not None else "reject_high"
            raise FieldError(
                field,
                "sequence rejection needs each completion's whole ratio, which the fused loss "
                "does not have chunk by chunk: set fused_loss = false, or unset reject_low and "
                "reject_high",
            )
        return self

    @model_validator(mode="after")
    def _correction_and_policy_loss_agree(self) -> GRPOConfig:
        for problem in (correction_problem(self.correction), policy_problem(self)):
            if problem is not None:
                raise FieldError(*problem)
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
