"""DAPO's dynamic sampling (Yu et al. 2025, section 3.2): fill each step with informative groups.

A group whose G rewards are all equal has zero advantage everywhere: with beta = 0 and no
entropy bonus it gives no gradient (``grpo.skip_zero_advantage`` leaves it out of the step), and
the step learns from fewer prompts than ``grpo.prompts_per_step`` says, fewer and fewer as the
policy solves (or keeps failing) more of the prompts. With ``grpo.dynamic_sampling`` the trainer
generates further rounds of prompts, drawn from the data stream's refill pass
(``PromptStream.take_refill``, so the rows that prefetched steps hold keep their place and a
resume replays both passes exactly), until each rank holds its share of informative groups or
``grpo.max_sampling_rounds`` rounds ran.

Each rank then keeps its informative groups first, in the order they were generated, and fills
a shortfall with uninformative ones, so the batch keeps its size (those are left out of the
train step, and count in its normalisers unless ``grpo.count_zero_advantage = false``). The
advantages are computed again over the kept batch (with ``scale_rewards = "batch"`` the
normaliser is the trained batch's). All ranks take the same refill rows, so their streams stay
equal, and stop together: a round runs while any rank is short, and a rank already full
generates nothing in it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from learner.config import LearnerConfig
from learner.step.batch import Rollout
from learner.step.rollouts import StepRollouts, finish_step

logger = logging.getLogger(__name__)

_SUMMED = ("time/generate", "time/score")  # per-round metrics that add up; the rest: means

_warned_short = False


def informative(step: StepRollouts, g: int) -> list[bool]:
    """Per group of ``g`` rollouts: whether one of them has a nonzero advantage and loss tokens
    (its rewards differ among the group's valid rollouts)."""
    return [
        any(r.advantage != 0.0 and any(r.completion_mask) for r in step.rollouts[i : i + g])
        for i in range(0, len(step.rollouts), g)
    ]


def merge_rounds(cfg: LearnerConfig, rounds: list[StepRollouts], groups: int) -> StepRollouts:
    """One step of ``groups`` groups from the rounds' rollouts: informative groups first, in
    round order, then uninformative ones; advantages computed again. The rollout metrics
    (lengths, advantages, ``groups/zero_advantage``, the trainer's ``reward/mean``) describe the
    kept batch; the reward functions' and the generation's (``tokens/generated``, times) every
    round's rollouts."""
    g = cfg.sampling.num_generations
    found: list[tuple[StepRollouts, int]] = []
    rest: list[tuple[StepRollouts, int]] = []
    for step in rounds:
        for i, useful in enumerate(informative(step, g)):
            (found if useful else rest).append((step, i))
    kept = (found + rest)[:groups]
    rollouts: list[Rollout] = []
    rewards: list[float] = []
    valid: list[bool] = []
    for step, i in kept:
        span = slice(i * g, (i + 1) * g)
        rollouts += step.rollouts[span]
        rewards += step.rewards[span].tolist()
        valid += step.valid[span] if step.valid is not None else [True] * g
    counts = [len(s.rollouts) for s in rounds]
    metrics: dict[str, float] = {}
    for k in dict.fromkeys(k for s in rounds for k in s.metrics):  # a round may lack a key
        have = [(s.metrics[k], n) for s, n in zip(rounds, counts, strict=True) if k in s.metrics]
        total = sum(v if k in _SUMMED else v * n for v, n in have)
        metrics[k] = total if k in _SUMMED else total / sum(n for _, n in have)
    merged = finish_step(cfg, rollouts, rewards, metrics, valid)
    generated = sum(s.metrics["tokens/generated"] for s in rounds)
    merged.metrics.update(
        {
            "tokens/generated": generated,
            "throughput/gen_tokens_per_s": generated / max(metrics["time/generate"], 1e-9),
            "sampling/rounds": float(len(rounds)),
            "sampling/groups_generated": float(sum(counts) // g),
            "sampling/informative_frac": len(found) / max(1, sum(counts) // g),
        }
    )
    merged.first_error = next((s.first_error for s in rounds if s.first_error), None)
    return merged


def fill_step(
    cfg: LearnerConfig,
    first: StepRollouts,
    groups: int,
    generate_round: Callable[[int, bool], StepRollouts | None],
    most: Callable[[int], int],
) -> StepRollouts:
    """The step's rollouts topped up to ``groups`` informative groups on this rank.

    ``generate_round(k, short)``: round k's rollouts for this rank, drawn from the refill pass
    (every rank must take the round's rows; only a ``short`` rank generates, the others return
    None). ``most(n)``: the largest ``n`` over the ranks (``train_step.max_over_ranks``, a
    collective: every rank calls it the same number of times)."""
    g = cfg.sampling.num_generations
    rounds = [first]
    have = sum(informative(first, g))
    for k in range(1, cfg.grpo.max_sampling_rounds):
        short = max(groups - have, 0)
        if most(short) == 0:
            break
        extra = generate_round(k, short > 0)
        if extra is not None:
            rounds.append(extra)
            have += sum(informative(extra, g))
    merged = merge_rounds(cfg, rounds, groups)
    global _warned_short
    if have < groups and not _warned_short:
        _warned_short = True
        logger.warning(
            "dynamic sampling: %d of %d groups informative after %d rounds; the batch is filled "
            "with uninformative groups (metric sampling/informative_frac says how many groups "
            "of the data still teach anything). Raise grpo.max_sampling_rounds to look further; "
            "this warning shows once a run",
            have,
            groups,
            len(rounds),
        )
    return merged
