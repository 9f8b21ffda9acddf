"""The policy-gradient objectives (`grpo.policy_loss`), per token, before the correction weight,
the KL term, the entropy bonus and the reduction (`learner.loss.grpo`).

With r = exp(logp - logp_old), A the completion's advantage, ε_low / ε_high the clip range:

    ppo   : -min(r·A, clip(r, 1 - ε_low, 1 + ε_high)·A)                  (PPO / GRPO / DAPO)
    cispo : -sg(clip(r, 1 - cispo_eps_low, 1 + ε_high))·A·logp            (MiniMax-M1's CISPO)
            sg = stop-gradient: the clipped ratio only weighs the REINFORCE gradient -A·∇logp,
            so a clipped token still has a gradient (PPO's gets none). No floor unless
            cispo_eps_low is set, as in the paper.
    sapo  : -(4/τ)·σ(τ·(r - 1))·A,  τ = sapo_tau_pos if A > 0 else sapo_tau_neg
            (SAPO: a smooth gate instead of the hard clip; its gradient -4σ(1-σ)·r·A·∇logp is
            the plain policy gradient at r = 1 and fades smoothly as r leaves 1)
    gmpo  : -A·exp(mean_t ĉ_t) on each token of the completion               (GMPO)
            ĉ_t = min(x_t, clip(x_t, -ε_low, ε_high)) for A > 0, max(...) for A <= 0,
            x_t = logp_t - logp_old_t: the geometric mean of the token ratios, each clipped in
            log space (PPO's sign-aware clip); GMPO's range is wider, ε_low = ε_high = 0.4.

GSPO (`importance_sampling_level = "sequence"`) replaces x_t by its completion's mean before
ppo, cispo or sapo. gmpo is a sequence objective already: like GSPO, its completion's loss is
on every one of its tokens, so the `grpo` reduction (mean over tokens, then over completions)
is the paper's mean over completions. ppo, cispo and sapo at the token level are separable:
`token_grad` is their per-token ∂/∂logp in closed form (the fused loss's).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from learner.loss.off_policy import seq_mean
from learner.loss.settings import PolicySettings as LossConfig


@dataclass
class PolicyTerm:
    per_token: Tensor  # [B, T] the policy-gradient loss of each token
    ratio: Tensor  # [B, T] detached: the ratio the objective saw (a metric)
    clip_low: Tensor  # [B, T] bool: clipped on the side that stops a negative advantage's push
    clip_high: Tensor  # [B, T] bool: clipped on the side that stops a positive advantage's push


def policy_term(
    logp: Tensor, old: Tensor, adv: Tensor, mask: Tensor, cfg: LossConfig
) -> PolicyTerm:
    """The objective ``cfg.policy_loss`` per token. ``logp`` ``[B, T]`` (with gradient),
    ``old`` ``[B, T]`` detached, ``adv`` ``[B, 1]``, ``mask`` ``[B, T]``."""
    log_ratio = logp - old  # [B, T]
    if cfg.policy_loss == "gmpo":
        return _gmpo(log_ratio, adv, mask, cfg)
    if cfg.importance_sampling_level == "sequence":  # GSPO: each completion's mean log-ratio
        log_ratio = seq_mean(log_ratio, mask).expand_as(logp)
    ratio = torch.exp(log_ratio)  # [B, T]
    no = torch.zeros_like(ratio, dtype=torch.bool)
    if cfg.policy_loss == "ppo":
        lo, hi = 1.0 - cfg.eps_low, 1.0 + cfg.eps_high
        per_token = -torch.min(ratio * adv, torch.clamp(ratio, lo, hi) * adv)
        r = ratio.detach()
        return PolicyTerm(per_token, r, (r < lo) & (adv < 0), (r > hi) & (adv > 0))
    if cfg.policy_loss == "cispo":
        lo = None if cfg.cispo_eps_low is None else 1.0 - cfg.cispo_eps_low
        r = ratio.detach()
        weight = torch.clamp(r, min=lo, max=1.0 + cfg.eps_high)  # sg(clip(r))
        per_token = -weight * adv * logp
        low = no if lo is None else r < lo
        return PolicyTerm(per_token, r, low, r > 1.0 + cfg.eps_high)
    if cfg.policy_loss == "sapo":
        tau = sapo_tau(adv, cfg)  # [B, 1]
        per_token = -(4.0 / tau) * torch.sigmoid(tau * (ratio - 1.0)) * adv
        return PolicyTerm(per_token, ratio.detach(), no, no)
    raise ValueError(f"policy_loss must be one of ppo, cispo, sapo, gmpo; got {cfg.policy_loss!r}")


def sapo_tau(adv: Tensor, cfg: LossConfig) -> Tensor:
    """SAPO's temperature of each completion (``adv`` ``[B, 1]`` or ``[N]``)."""
    pos, neg = adv.new_tensor(cfg.sapo_tau_pos), adv.new_tensor(cfg.sapo_tau_neg)  # adv's dtype
    return torch.where(adv > 0, pos, neg)


def _gmpo(log_ratio: Tensor, adv: Tensor, mask: Tensor, cfg: LossConfig) -> PolicyTerm:
    clamped = torch.clamp(log_ratio, -cfg.eps_low, cfg.eps_high)  # [B, T]
    clipped = torch.where(
        adv > 0, torch.minimum(log_ratio, clamped), torch.maximum(log_ratio, clamped)
    )
    seq_ratio = torch.exp(seq_mean(clipped, mask))  # [B, 1] geometric mean of clipped ratios
    per_token = (-seq_ratio * adv).expand_as(log_ratio)
    x = log_ratio.detach()
    low = (x < -cfg.eps_low) & (adv < 0)
    high = (x > cfg.eps_high) & (adv > 0)
    return PolicyTerm(per_token, torch.exp(x), low, high)


def token_grad(lp: Tensor, old: Tensor, adv: Tensor, cfg: LossConfig) -> Tensor:
    """``[N]``: ∂(policy term)/∂logp of each token of a separable objective (token-level ppo,
    cispo or sapo), from flat ``[N]`` log-probs, old log-probs and advantages; what autograd
    through `policy_term` gives, with PyTorch's conventions where it is not smooth (`torch.min`
    splits the gradient evenly on a tie, `clamp` passes it at the bounds)."""
    ratio = torch.exp(lp - old)
    if cfg.policy_loss == "ppo":
        lo, hi = 1.0 - cfg.eps_low, 1.0 + cfg.eps_high
        u = ratio * adv  # the unclipped surrogate; the clipped one is clamp(ratio) * adv
        v = torch.clamp(ratio, lo, hi) * adv
        g_clip = torch.where((ratio >= lo) & (ratio <= hi), 1.0, 0.0)  # clamp's gradient
        g_min = torch.where(u < v, 1.0, torch.where(u == v, 0.5 * (1.0 + g_clip), g_clip))
        return -(u * g_min)  # -(∂min/∂u + ∂min/∂v · clamp') · ratio · adv
    if cfg.policy_loss == "cispo":  # the weight is a constant: ∂(-w·A·logp)/∂logp = -w·A
        lo = None if cfg.cispo_eps_low is None else 1.0 - cfg.cispo_eps_low
        return -torch.clamp(ratio, min=lo, max=1.0 + cfg.eps_high) * adv
    if cfg.policy_loss == "sapo":  # ∂/∂logp of -(4/τ)σ(τ(r-1))A = -4σ(1-σ)·r·A
        s = torch.sigmoid(sapo_tau(adv, cfg) * (ratio - 1.0))
        return -4.0 * s * (1.0 - s) * ratio * adv
    raise ValueError(f"policy_loss {cfg.policy_loss!r} is not separable: no per-token gradient")


__all__ = ["PolicyTerm", "policy_term", "sapo_tau", "token_grad"]
