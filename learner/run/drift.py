"""A watch on what the rollout servers serve, from a metric every step already has.

``is_weight`` is the token mean of exp(learner log-prob - server log-prob), clamped at
``grpo.tis_cap``: near 1 while the servers sample from the learner's weights (bf16 logits move
it by a few hundredths, a step of ``rollout.max_staleness`` by a little more). Far from 1 they
sample from another policy than the one trained: a sync that did not load, another model or
dtype, other sampling settings. Nothing fails then (the truncated importance weight corrects
what it can, and the loss fades towards 0), so the run would go on quietly; ``DriftWatch`` says
it in the log once the drift holds for a few steps.
"""

from __future__ import annotations

DRIFT = 0.25  # |is_weight - 1| beyond which a step counts as off the learner's policy
PATIENCE = 2  # consecutive such steps before the first warning
EVERY = 10  # while it lasts, the warning again every this many steps


def warning_due(streak: int, patience: int, every: int) -> bool:
    """Whether a condition that has held ``streak`` steps in a row is warned about now: first
    after ``patience`` steps, then every ``every`` steps while it lasts."""
    due = streak - patience
    return due >= 0 and due % every == 0


class DriftWatch:
    """Feed it each step's metrics (reduced over the ranks); it returns a warning to log, or
    None. Without ``is_weight`` (``grpo.tis_cap = "none"``) it never warns."""

    def __init__(self, drift: float = DRIFT, patience: int = PATIENCE, every: int = EVERY) -> None:
        self.drift, self.patience, self.every = drift, patience, every
        self.off_steps = 0  # consecutive steps off the learner's policy, up to now

    def check(self, step: int, metrics: dict[str, float]) -> str | None:
        weight = metrics.get("is_weight")
        if weight is None:
            return None
        if abs(weight - 1.0) <= self.drift:
            self.off_steps = 0
            return None
        self.off_steps += 1
        if not warning_due(self.off_steps, self.patience, self.every):
            return None
        return (
            f"step {step}: the rollout servers sample from another policy than the learner's "
            f"for {self.off_steps} steps now (is_weight {weight:.3f}: the token mean of "
            f"exp(learner log-prob - server log-prob), near 1 when they serve the learner's "
            "weights). Check that every weight sync loads (the servers' logs and /info's "
            "weight_version), that they serve the learner's model in model.dtype, and that "
            "nothing changes their sampling (temperature, logits processors)"
        )
