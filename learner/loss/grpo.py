"""The GRPO policy loss as a pure function of typed, per-token inputs.

Per token (ratio r = exp(logp - logp_old), advantage A of the token's completion):

    pg    = -min(r·A, clip(r, 1 - eps_low, 1 + eps_high)·A)        (PPO clipped surrogate)
    pg   *= min(exp(logp_old - logp_sampling), tis_cap)            (truncated IS, optional)
    loss  = pg + beta·KL_k3(ref ‖ θ) - entropy_coef·entropy
    KL_k3 = exp(ref - logp) - (ref - logp) - 1                     (Schulman's k3 estimator)

`policy_loss` picks pg's form (ppo above, cispo, sapo, gmpo: `learner.loss.policy`), and the
importance weight between the learner and the rollout servers may be truncated or masked, per
token or per sequence, with a sequence rejection band (`learner.loss.off_policy`).

With ``importance_sampling_level = "sequence"`` (GSPO, Zheng et al. 2025) r is one ratio per
completion, the geometric mean of its tokens' ratios, exp(mean_t (logp - logp_old)), clipped as
a whole (GSPO's clip ranges are ~1e-3, not 0.2): a long completion's ratio no longer rests on
single tokens. On-policy (μ = 1, no lag) r = 1 and the gradient equals the token level's.

The IS weight corrects for the rollout engine (vLLM, bf16 kernels, maybe stale weights)
sampling from a slightly different distribution than the learner's `logp_old`; truncating it
keeps the variance bounded. It multiplies the policy-gradient term only, as in TRL.

How the per-token losses are reduced (definitions from TRL's GRPOTrainer):

    grpo    : mean over each sequence's tokens, then mean over sequences (long completions
              weigh less per token: the length bias Dr. GRPO points out)
    bnpo    : token sum / tokens in this micro-batch
    dr_grpo : token sum / (B · max_completion_length)   (a constant: no length bias)
    dapo    : token sum / tokens in the whole optimizer step (all micro-batches, all ranks)

Gradient accumulation and data parallelism. The optimizer step's gradient is the sum over
micro-batches of each micro-batch loss's gradient, averaged over data-parallel ranks (DDP and
DeepSpeed average). So:

- dapo: pass `num_items_in_batch` = the number of loss tokens (mask sum) of the *whole step*,
  summed over every micro-batch and every rank, and `dp_world_size`. The loss is
  `token_sum · dp_world_size / num_items_in_batch`; summed over micro-batches and averaged over
  ranks that is exactly `Σ_all tokens / num_items_in_batch`: every token of the step weighs the
  same however the tokens fall into micro-batches. Do NOT divide it again by the number of
  accumulation steps (nor let `accelerator.backward` do so). Without `num_items_in_batch` the
  local token count is used, divided by `num_micro_batches` (i.e. bnpo).
- grpo, bnpo, dr_grpo: the local value is divided by `num_micro_batches` (as TRL divides by its
  gradient accumulation steps), so the step averages the micro-batch losses.

All four are `Σ_rows w_b · Σ_t per_token·mask` (times dapo's `dp_world_size /
num_items_in_batch`), with `w_b` from the micro-batch's layout (`row_weights`). The learner
computes the `w_b` once from the layout of *all* the step's rollouts and passes them as
`seq_weights`: rows can then be trained in any grouping, and rows whose every token has a
zero gradient (zero advantage without KL or entropy bonus) left out, with the same gradient
(`learner.step.update.build_micro_batches`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Literal, get_args

import torch
from torch import Tensor

from learner.loss.off_policy import correction_metrics, correction_weights
from learner.loss.policy import policy_term
from learner.loss.settings import (
    Correction,
    CorrectionLevel,
    CorrectionMode,
    PolicyLoss,
    correction_problem,
    policy_problem,
)

LossType = Literal["grpo", "bnpo", "dr_grpo", "dapo"]
LOSS_TYPES: tuple[str, ...] = get_args(LossType)


@dataclass
class LossConfig:
    """Hyper-parameters of the GRPO loss (defaults: DAPO's asymmetric clip, no KL).

    Every field but `max_completion_length` is the `[grpo]` config field of the same name:
    `LossConfig.of` takes them from the validated section. What that section already checks
    (the loss type and the ratio's level among their choices, clip ranges and beta >= 0) is
    not checked again here; `__post_init__` checks what it does not."""

    loss_type: LossType = "dapo"
    eps_low: float = 0.2
    eps_high: float = 0.28
    beta: float = 0.0  # KL coefficient (k3 estimator); 0 needs no reference model
    tis_cap: float | None = 2.0  # truncated importance-sampling cap; None disables the weight
    max_completion_length: int | None = None  # dr_grpo's constant normaliser
    entropy_coef: float = 0.0  # entropy bonus (subtracted from the loss)
    importance_sampling_level: Literal["token", "sequence"] = "token"  # sequence: GSPO
    policy_loss: PolicyLoss = "ppo"  # the policy-gradient term's form (learner.loss.policy)
    cispo_eps_low: float | None = None  # CISPO's floor on its weight, 1 - this; None: none
    sapo_tau_pos: float = 1.0  # SAPO's gate temperature for A > 0
    sapo_tau_neg: float = 1.05  # ... for A <= 0
    # The importance weight between the learner and the servers (learner.loss.off_policy);
    # tis_cap is its upper bound
    correction_level: CorrectionLevel = "token"
    correction_mode: CorrectionMode = "truncate"
    correction_low: float | None = None  # mask: weights below it are masked
    reject_low: float | None = None  # sequence rejection band on the geometric-mean ratio
    reject_high: float | None = None

    @property
    def correction(self) -> Correction:
        return Correction.of(self)

    @property
    def uses_sampling_logprobs(self) -> bool:
        """Whether the loss reads the servers' sampling log-probs (a correction is on)."""
        return self.correction.active

    @property
    def separable(self) -> bool:
        """Whether each token's gradient depends on that token's values alone (what the
        fused loss needs)."""
        return (
            self.importance_sampling_level == "token"
            and self.policy_loss != "gmpo"
            and self.correction.separable
        )

    def __post_init__(self) -> None:
        if self.eps_low >= 1:
            raise ValueError(
                f"need eps_low < 1 (the ratio is clipped below at 1 - eps_low), got "
                f"eps_low={self.eps_low}"
            )
        if self.tis_cap is not None and self.tis_cap <= 0:
            raise ValueError(f"tis_cap must be > 0 or None (disabled), got {self.tis_cap}")
        for problem in (correction_problem(self.correction), policy_problem(self)):
            if problem is not None:
                raise ValueError(f"{problem[0]}: {problem[1]}")
        if self.loss_type == "dr_grpo" and not self.max_completion_length:
            raise ValueError(
                "loss_type='dr_grpo' normalises by B * max_completion_length: set "
                "max_completion_length to the sampling max_tokens"
            )

    @classmethod
    def of(cls, grpo: Any, max_completion_length: int) -> LossConfig:
        """The loss of a validated `[grpo]` section (`learner.config.step.GRPOConfig`, which
        this package does not import: the config imports `learner.loss.settings`), its fields
        read by name;
        `max_completion_length` is the sampling `max_tokens` (dr_grpo's normaliser)."""
        own = {
            f.name: getattr(grpo, f.name) for f in fields(cls) if f.name != "max_completion_length"
        }
        return cls(**own, max_completion_length=max_completion_length)


@dataclass
class LossInputs:
    """Per-token tensors of one micro-batch. B completions, T completion positions."""

    logprobs: Tensor  # [B, T] current policy, requires grad
    old_logprobs: Tensor  # [B, T] policy at the start of the step (= logprobs.detach() if μ=1)
    advantages: Tensor  # [B]
    mask: Tensor  # [B, T] 1 for tokens in the loss (completion, not tool output, not padding)
    sampling_logprobs: Tensor | None = None  # [B, T] from the rollout server
    ref_logprobs: Tensor | None = None  # [B, T] reference policy, needed when beta > 0
    entropy: Tensor | None = None  # [B, T] needed when entropy_coef != 0; else only a metric
    num_items_in_batch: float | Tensor | None = None  # dapo: loss tokens of the whole step
    dp_world_size: int = 1  # data-parallel ranks that average gradients (dapo scaling)
    num_micro_batches: int = 1  # gradient-accumulation micro-batches in the step
    # [B] each row's factor on its token sum, from the step's whole layout (`row_weights` of
    # the micro-batch it would sit in with every rollout trained); replaces the normalisers
    # above except dapo's global one. None: `row_weights` of this micro-batch.
    seq_weights: Tensor | None = None


def _masked_mean(x: Tensor, mask: Tensor, count: Tensor) -> Tensor:
    return (x * mask).sum() / count


def grpo_loss(inputs: LossInputs, cfg: LossConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """Scalar loss of one micro-batch and detached metrics (token means over the mask).

    Metrics: clip_low / clip_high / clip_region (fraction of tokens whose ratio is clipped on
    the side that stops the gradient; for cispo the tokens whose weight is clipped), ratio_mean,
    and when the inputs exist kl, entropy, is_weight and the correction's ``off_policy/*``
    (`learner.loss.off_policy.correction_metrics`); num_tokens is the mask sum, num_seqs the
    rows with loss tokens.
    """
    logp = inputs.logprobs  # [B, T]
    if logp.dim() != 2:
        raise ValueError(f"logprobs must be [B, T], got {tuple(logp.shape)}")
    for name in ("old_logprobs", "mask", "sampling_logprobs", "ref_logprobs", "entropy"):
        t = getattr(inputs, name)
        if t is not None and t.shape != logp.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(logp.shape)}")
    if inputs.advantages.shape != (logp.shape[0],):
        raise ValueError(
            f"advantages must be [B]={logp.shape[0]}, got {tuple(inputs.advantages.shape)}"
        )
    if cfg.beta != 0.0 and inputs.ref_logprobs is None:
        raise ValueError("cfg.beta > 0 needs inputs.ref_logprobs (reference model log-probs)")
    if cfg.entropy_coef != 0.0 and inputs.entropy is None:
        raise ValueError("cfg.entropy_coef != 0 needs inputs.entropy (token_logprobs entropy)")

    dtype = torch.promote_types(logp.dtype, torch.float32)
    logp = logp.to(dtype)
    mask = inputs.mask.to(dtype)  # [B, T]
    adv = inputs.advantages.detach().to(dtype)[:, None]  # [B, 1]
    old = inputs.old_logprobs.detach().to(dtype)  # [B, T]

    term = policy_term(logp, old, adv, mask, cfg)
    per_token = term.per_token  # [B, T]

    metrics: dict[str, Tensor] = {}
    count = mask.sum().clamp(min=1.0)
    correction = cfg.correction
    if inputs.sampling_logprobs is not None and correction.active:
        sampling = inputs.sampling_logprobs.detach().to(dtype)  # [B, T]
        w = correction_weights(old, sampling, mask, correction)
        per_token = per_token * w.weight
        metrics.update(correction_metrics(old, sampling, mask, w, correction))
        # the drift watch's gauge (learner.run.drift): the token ratio, capped at tis_cap
        ratio = torch.exp(old - sampling)
        capped = ratio if cfg.tis_cap is None else ratio.clamp(max=cfg.tis_cap)
        metrics["is_weight"] = _masked_mean(capped, mask, count)
    if inputs.ref_logprobs is not None:
        d = inputs.ref_logprobs.detach().to(dtype) - logp  # [B, T]
        kl = torch.exp(d) - d - 1.0
        if cfg.beta != 0.0:
            per_token = per_token + cfg.beta * kl
        metrics["kl"] = _masked_mean(kl.detach(), mask, count)
    if inputs.entropy is not None:
        ent = inputs.entropy.to(dtype)
        if cfg.entropy_coef != 0.0:
            per_token = per_token - cfg.entropy_coef * ent
        metrics["entropy"] = _masked_mean(ent.detach(), mask, count)

    loss = _reduce(per_token, mask, inputs, cfg)

    with torch.no_grad():
        r = term.ratio
        low, high = term.clip_low.to(dtype), term.clip_high.to(dtype)
        metrics["clip_low"] = _masked_mean(low, mask, count)
        metrics["clip_high"] = _masked_mean(high, mask, count)
        metrics["clip_region"] = _masked_mean(torch.maximum(low, high), mask, count)
        metrics["ratio_mean"] = _masked_mean(r, mask, count)
        metrics["num_tokens"] = mask.sum()
        metrics["num_seqs"] = (mask.sum(-1) > 0).sum().to(dtype)
    return loss, metrics


def row_weights(
    tokens: Tensor, cfg: LossConfig, num_micro_batches: int, *, global_tokens: bool
) -> Tensor:
    """``[B]``: each row's factor on its token sum ``Σ_t per_token·mask`` in the loss of a
    micro-batch of ``B`` rows holding ``tokens`` ``[B]`` loss tokens each, one of
    ``num_micro_batches``: the loss types' normalisers (module docstring), dapo's global one
    apart (``global_tokens``: dapo divides by the step's tokens, applied by the caller; the
    rows' factor is then 1).

        grpo    : 1 / (B · M · n_b)        bnpo : 1 / (Σ_b n_b · M)
        dr_grpo : 1 / (B · max_len · M)     dapo : 1, or bnpo's without global_tokens
    """
    if num_micro_batches < 1:
        raise ValueError("num_micro_batches must be >= 1")
    tokens = tokens.to(torch.promote_types(tokens.dtype, torch.float32))
    rows, micro = tokens.shape[0], num_micro_batches
    if cfg.loss_type == "grpo":
        return 1.0 / (tokens.clamp(min=1.0) * (rows * micro))
    if cfg.loss_type == "dr_grpo":
        return torch.full_like(tokens, 1.0 / (rows * cfg.max_completion_length * micro))
    if cfg.loss_type == "dapo" and global_tokens:
        return torch.ones_like(tokens)
    return torch.full_like(tokens, 1.0).div_(tokens.sum().clamp(min=1.0) * micro)


def global_factor(cfg: LossConfig, num_items_in_batch: float | Tensor | None, dp: int) -> float:
    """dapo's normaliser beyond `row_weights`: ``dp_world_size / num_items_in_batch`` (the
    step's loss tokens on every rank); 1 for the other loss types or without the count."""
    if cfg.loss_type != "dapo" or num_items_in_batch is None:
        return 1.0
    n = float(num_items_in_batch)
    if n <= 0:
        raise ValueError(f"num_items_in_batch must be > 0, got {n}")
    return dp / n


def _reduce(per_token: Tensor, mask: Tensor, inputs: LossInputs, cfg: LossConfig) -> Tensor:
    if inputs.num_micro_batches < 1 or inputs.dp_world_size < 1:
        raise ValueError("num_micro_batches and dp_world_size must be >= 1")
    w = inputs.seq_weights  # [B]
    if w is None:
        w = row_weights(
            mask.sum(-1),
            cfg,
            inputs.num_micro_batches,
            global_tokens=inputs.num_items_in_batch is not None,
        )
    elif w.shape != (per_token.shape[0],):
        raise ValueError(f"seq_weights must be [B]={per_token.shape[0]}, got {tuple(w.shape)}")
    rows = (per_token * mask).sum(-1)  # [B]
    scale = global_factor(cfg, inputs.num_items_in_batch, inputs.dp_world_size)
    return (rows * w.to(rows.dtype)).sum() * scale


__all__ = [
    "LOSS_TYPES",
    "LossConfig",
    "LossInputs",
    "global_factor",
    "grpo_loss",
    "row_weights",
]
