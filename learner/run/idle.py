"""A watch on steps that train nothing, from metrics every step already has.

A step trains no token (``tokens/trained`` = 0) when every completion's advantage is 0: each
group's completions got the same reward (``groups/zero_advantage`` = every group), say because
a reward function fails and is scored 0 under ``scoring.policy``, because the task is too hard
or too easy for the model, or because sampling gives G copies of one completion. Nothing fails
then and the run goes on, its loss 0; ``IdleWatch`` says it in the log, naming the likely
cause, once it holds for a few steps in a row.
"""

from __future__ import annotations

from learner.run.drift import warning_due

PATIENCE = 3  # consecutive steps that trained nothing before the first warning
EVERY = 10  # while it lasts, the warning again every this many steps


class IdleWatch:
    """Feed it each step's metrics (reduced over the ranks); it returns a warning to log, or
    None. ``groups``: the prompts (groups) of one rank's batch."""

    def __init__(self, groups: int, patience: int = PATIENCE, every: int = EVERY) -> None:
        self.groups, self.patience, self.every = groups, patience, every
        self.idle_steps = 0  # consecutive steps that trained no token, up to now

    def check(self, step: int, metrics: dict[str, float]) -> str | None:
        trained = metrics.get("tokens/trained")
        if trained is None or trained > 0:
            self.idle_steps = 0
            return None
        self.idle_steps += 1
        if not warning_due(self.idle_steps, self.patience, self.every):
            return None
        return (
            f"step {step}: nothing was trained for {self.idle_steps} steps in a row "
            f"(tokens/trained = 0, the loss is 0): {self.why(metrics)}"
        )

    def why(self, metrics: dict[str, float]) -> str:
        """The likely cause, from the step's metrics."""
        failed = sorted(
            k.removeprefix("reward/").removesuffix("/failures")
            for k, v in metrics.items()
            if k.startswith("reward/") and k.endswith("/failures") and v > 0
        )
        zero = metrics.get("groups/zero_advantage")
        parts = []
        if zero is not None and zero >= self.groups:
            parts.append(
                f"every group had zero advantage (groups/zero_advantage = {zero:g} of "
                f"{self.groups}): the completions of each prompt all got the same reward"
            )
            if metrics.get("reward/std") == 0.0 and "reward/mean" in metrics:
                parts.append(f"every completion got {metrics['reward/mean']:g}")
        else:
            parts.append("no completion had a non-zero advantage with a token in the loss")
        if failed:
            parts.append(
                f"reward function(s) {failed} failed in this step and were scored under "
                "scoring.policy (their errors are in the log above)"
            )
        if metrics.get("episode/error_frac", 0.0) > 0:
            parts.append(f"{metrics['episode/error_frac']:.0%} of the episodes failed")
        return (
            "; ".join(parts)
            + ". GRPO learns only from groups whose completions score differently: check the "
            "reward functions on a few completions (reward/<name>/mean), and that the task is "
            "neither too hard nor too easy for the model; a higher sampling.temperature or "
            "sampling.num_generations gives more varied groups"
        )
