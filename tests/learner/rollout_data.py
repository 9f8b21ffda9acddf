"""Small random rollouts for the learner's loss and memory-option tests."""

from __future__ import annotations

import random

from learner.step.batch import Rollout


def random_rollouts(n: int = 5, seed: int = 0) -> list[Rollout]:
    """``n`` rollouts of 2–7 prompt and 1–9 completion tokens (ids 5–249), seeded; a completion
    longer than 3 tokens has a tool token (mask 0: context, not loss) at position 1."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p, c = rng.randint(2, 7), rng.randint(1, 9)
        mask = [1] * c
        if c > 3:
            mask[1] = 0
        out.append(
            Rollout(
                [rng.randrange(5, 250) for _ in range(p)],
                [rng.randrange(5, 250) for _ in range(c)],
                [-rng.random() for _ in range(c)],
                mask,
                advantage=rng.uniform(-1, 1),
            )
        )
    return out
