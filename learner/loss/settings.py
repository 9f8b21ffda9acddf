"""The settings of the policy objective and the off-policy correction, and their checks, free of
torch: `learner.config.step` validates `[grpo]` with them, the loss (`learner.loss.grpo`)
its `LossConfig`. What they mean is in `learner.loss.policy` and `learner.loss.off_policy`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Protocol

PolicyLoss = Literal["ppo", "cispo", "sapo", "gmpo"]
CorrectionLevel = Literal["token", "sequence", "geo_sequence"]
CorrectionMode = Literal["truncate", "mask"]


class PolicySettings(Protocol):
    """What the objectives read (`[grpo]` and `LossConfig` both have it)."""

    policy_loss: PolicyLoss
    importance_sampling_level: Literal["token", "sequence"]
    eps_low: float
    eps_high: float
    cispo_eps_low: float | None
    sapo_tau_pos: float
    sapo_tau_neg: float


@dataclass(frozen=True)
class Correction:
    """What to do with the importance weight of π_old over μ (`learner.loss.off_policy`):
    ``high`` is `[grpo]`'s ``tis_cap``. No bound and no rejection band: no correction."""

    level: CorrectionLevel = "token"
    mode: CorrectionMode = "truncate"
    low: float | None = None  # mask only: weights below it are masked
    high: float | None = 2.0  # truncate: the cap; mask: weights above it are masked
    reject_low: float | None = None  # sequences whose geometric-mean ratio is below it: dropped
    reject_high: float | None = None  # ... or above it

    @classmethod
    def of(cls, fields: Any) -> Correction:
        """From the `[grpo]` fields of the same names (a `GRPOConfig` or a `LossConfig`)."""
        return cls(
            fields.correction_level,
            fields.correction_mode,
            fields.correction_low,
            fields.tis_cap,
            fields.reject_low,
            fields.reject_high,
        )

    @property
    def weighs(self) -> bool:
        """Whether the weight itself is applied (else only the rejection band, if any)."""
        return self.high is not None or (self.mode == "mask" and self.low is not None)

    @property
    def rejects(self) -> bool:
        return self.reject_low is not None or self.reject_high is not None

    @property
    def active(self) -> bool:
        return self.weighs or self.rejects

    @property
    def separable(self) -> bool:
        """Whether each token's weight depends on that token alone (the fused loss needs it
        when the learner's old log-probs are its current ones, known chunk by chunk)."""
        return (self.level == "token" or not self.weighs) and not self.rejects


def correction_problem(c: Correction) -> tuple[str, str] | None:
    """What is wrong with a correction, as ``(field, message)`` in `[grpo]`'s names (tis_cap is
    ``high``), or None."""
    if c.high is not None and c.high <= 0:
        return "tis_cap", f"the weight's upper bound must be > 0 (or none), got {c.high}"
    if c.low is not None and c.mode != "mask":
        return (
            "correction_low",
            "truncation caps the weight above only (at tis_cap): correction_low is the lower "
            'bound of correction_mode = "mask"; unset it, or set correction_mode = "mask"',
        )
    if c.low is not None and not 0 < c.low <= 1:
        return "correction_low", f"must be in (0, 1] (a band around 1), got {c.low}"
    if c.high is not None and c.mode == "mask" and c.high < 1:
        return "tis_cap", f"masking above {c.high} < 1 would mask on-policy tokens: use >= 1"
    if c.mode == "mask" and c.low is None and c.high is None:
        return "correction_mode", '"mask" needs a bound: set tis_cap and/or correction_low'
    lo, hi = c.reject_low, c.reject_high
    if lo is not None and not 0 < lo <= 1:
        return "reject_low", f"must be in (0, 1] (on-policy sequences have ratio 1), got {lo}"
    if hi is not None and hi < 1:
        return "reject_high", f"must be >= 1 (on-policy sequences have ratio 1), got {hi}"
    return None


def policy_problem(cfg: PolicySettings) -> tuple[str, str] | None:
    """What is wrong with the objective's settings, as ``(field, message)`` in `[grpo]`'s
    names, or None."""
    if cfg.policy_loss == "gmpo" and cfg.importance_sampling_level != "token":
        return (
            "importance_sampling_level",
            "gmpo takes the geometric mean of its clipped token ratios itself: set "
            'importance_sampling_level = "token" with policy_loss = "gmpo"',
        )
    if cfg.cispo_eps_low is not None and not 0 <= cfg.cispo_eps_low < 1:
        return "cispo_eps_low", f"must be in [0, 1) (the floor 1 - it), got {cfg.cispo_eps_low}"
    for name in ("sapo_tau_pos", "sapo_tau_neg"):
        if getattr(cfg, name) <= 0:
            return name, f"SAPO's temperature must be > 0, got {getattr(cfg, name)}"
    return None


__all__ = [
    "Correction",
    "CorrectionLevel",
    "CorrectionMode",
    "PolicyLoss",
    "PolicySettings",
    "correction_problem",
    "policy_problem",
]
