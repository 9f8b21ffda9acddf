"""Off-policy corrections between the learner and the rollout servers, as pure functions.

The servers sample each completion from a behaviour policy μ (vLLM's kernels, bf16 logits, maybe
weights a few versions old); the learner's loss is written for its own policy at the start of
the step, π_old. Per sampled token the log-ratio is ``x = log π_old - log μ`` (the learner's
old log-prob minus the server's sampling log-prob), and from it:

    token level        w_t = exp(x_t)
    sequence level     w_b = mean_t exp(x_t)              (arithmetic mean of the token ratios)
    geo_sequence level w_b = exp(mean_t x_t)              (geometric mean of the token ratios)

    truncate (TIS)     w' = min(w, high)
    mask (MIS)         w' = w · 1[low <= w <= high]        (low / high optional; ICEPOP: token
                                                           level, both bounds)
    rejection          w' = 0 for every token of a sequence whose geometric-mean ratio
                       exp(mean_t x_t) is outside [reject_low, reject_high]

A sequence-level weight is the same for every token of its completion. The weight multiplies
the policy-gradient term of the loss only (not the KL or the entropy bonus), and it carries no
gradient: π_old and μ are constants of the step.

The gap itself is measured with Schulman's k3 estimator on the sampled tokens (drawn from μ),
``k3 = exp(x) - x - 1``: an unbiased, non-negative estimate of KL(μ ‖ π_old) per token.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor

from learner.loss.settings import Correction, CorrectionLevel

# Metrics averaged over sequences (weighted by the micro-batch's rows with loss tokens), not
# over tokens: the learner's step sums them as such (`learner.step.update.MetricSums`).
SEQUENCE_METRICS = frozenset(
    {"off_policy/seq_truncated", "off_policy/seq_masked", "off_policy/seq_rejected"}
)


@dataclass
class Weights:
    """A micro-batch's correction: the weight and what it did, per token and per sequence."""

    weight: Tensor  # [B, T] the factor on each token's policy-gradient term (0 where masked)
    truncated: Tensor  # [B, T] bool: the weight was capped at `high`
    masked: Tensor  # [B, T] bool: the weight was outside [low, high] and set to 0
    rejected: Tensor  # [B] bool: the sequence was outside the rejection band


def k3(log_ratio: Tensor) -> Tensor:
    """``exp(x) - x - 1`` elementwise: with ``x = log π_old - log μ`` on tokens sampled from
    μ, each value is an unbiased, non-negative estimate of KL(μ ‖ π_old)."""
    return torch.expm1(log_ratio) - log_ratio


def seq_mean(x: Tensor, mask: Tensor) -> Tensor:
    """``[B, T] -> [B, 1]``: the mean of each row over its masked tokens (0 for a row without)."""
    return (x * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)


def level_weight(log_ratio: Tensor, mask: Tensor, level: CorrectionLevel) -> Tensor:
    """``[B, T]``: the raw importance weight at ``level``, a sequence's on each of its tokens."""
    if level == "token":
        return torch.exp(log_ratio)
    if level == "sequence":
        return seq_mean(torch.exp(log_ratio), mask).expand_as(log_ratio)
    if level == "geo_sequence":
        return torch.exp(seq_mean(log_ratio, mask)).expand_as(log_ratio)
    raise ValueError(f"level must be 'token', 'sequence' or 'geo_sequence', got {level!r}")


def correction_weights(old: Tensor, sampling: Tensor, mask: Tensor, c: Correction) -> Weights:
    """The correction of one micro-batch. ``old`` ``[B, T]``: the learner's log-probs at the
    start of the step; ``sampling`` ``[B, T]``: the server's; ``mask`` ``[B, T]`` 1 at the loss
    tokens. No gradient flows through the result."""
    with torch.no_grad():
        log_ratio = old.detach() - sampling.detach()  # [B, T]
        maskf = mask.to(log_ratio.dtype)
        none = torch.zeros_like(log_ratio, dtype=torch.bool)  # [B, T]
        weight = torch.ones_like(log_ratio)  # [B, T]
        truncated, masked = none, none
        if c.weighs:
            w = level_weight(log_ratio, maskf, c.level)  # [B, T]
            if c.mode == "truncate":
                assert c.high is not None
                truncated = w > c.high
                weight = w.clamp(max=c.high)
            else:
                masked = none
                if c.low is not None:
                    masked = masked | (w < c.low)
                if c.high is not None:
                    masked = masked | (w > c.high)
                weight = torch.where(masked, 0.0, w)
        rejected = torch.zeros(log_ratio.shape[0], dtype=torch.bool, device=log_ratio.device)
        if c.rejects:
            geo = torch.exp(seq_mean(log_ratio, maskf)).squeeze(-1)  # [B]
            if c.reject_low is not None:
                rejected = rejected | (geo < c.reject_low)
            if c.reject_high is not None:
                rejected = rejected | (geo > c.reject_high)
            weight = torch.where(rejected[:, None], 0.0, weight)
        return Weights(weight, truncated, masked, rejected)


def correction_metrics(
    old: Tensor, sampling: Tensor, mask: Tensor, w: Weights, c: Correction
) -> dict[str, Tensor]:
    """Detached means of a micro-batch's correction: over its loss tokens ``off_policy/k3``
    (the gap, module docstring), ``off_policy/weight`` (the applied weight, 0 where masked or
    rejected) and the fractions of tokens truncated, masked or rejected; over its sequences
    with loss tokens (`SEQUENCE_METRICS`) the fractions of sequences, for the sequence levels
    and the rejection band."""
    with torch.no_grad():
        maskf = mask.to(w.weight.dtype)  # [B, T]
        count = maskf.sum().clamp(min=1.0)
        rows = maskf.sum(-1) > 0  # [B]
        n_rows = rows.sum().clamp(min=1).to(maskf.dtype)

        def tok(x: Tensor) -> Tensor:
            return (x.to(maskf.dtype) * maskf).sum() / count

        def seq(x: Tensor) -> Tensor:  # [B] bool
            return (x & rows).sum().to(maskf.dtype) / n_rows

        out = {
            "off_policy/k3": tok(k3(old.detach() - sampling.detach())),
            "off_policy/weight": tok(w.weight),
        }
        if c.weighs and c.mode == "truncate":
            out["off_policy/truncated"] = tok(w.truncated)
        if c.weighs and c.mode == "mask":
            out["off_policy/masked"] = tok(w.masked)
        if c.weighs and c.level != "token":
            kind = "truncated" if c.mode == "truncate" else "masked"
            flags = w.truncated if c.mode == "truncate" else w.masked
            out[f"off_policy/seq_{kind}"] = seq(flags.any(-1))
        if c.rejects:
            out["off_policy/rejected"] = tok(w.rejected[:, None].expand_as(maskf))
            out["off_policy/seq_rejected"] = seq(w.rejected)
        return out


def tokens_per_version_lag(
    versions: Iterable[int], tokens: Iterable[int], learner_version: int, *, at_least: int = 0
) -> dict[int, int]:
    """Loss tokens by how many weight versions their rollout's weights are behind the learner's
    (``learner_version - version``), every lag from 0 to ``max(at_least, the largest lag)``
    present (0 tokens where none): the same keys on every rank of a step."""
    counts: dict[int, int] = {}
    for version, n in zip(versions, tokens, strict=True):
        lag = learner_version - version
        counts[lag] = counts.get(lag, 0) + n
    top = max([at_least, *counts])
    return {lag: counts.get(lag, 0) for lag in range(min([0, *counts]), top + 1)}


__all__ = [
    "SEQUENCE_METRICS",
    "Weights",
    "correction_metrics",
    "correction_weights",
    "k3",
    "level_weight",
    "seq_mean",
    "tokens_per_version_lag",
]
