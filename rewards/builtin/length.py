"""Length reward: 1.0 at the target length, falling linearly to 0.0 at 0 and at twice the target.

``score = max(0, 1 - |length - target| / target)``. Length is counted in characters, words
(whitespace-separated), or tokens (needs a ``completion_ids`` column of token id lists).
"""

from __future__ import annotations

from typing import Any, Literal


def length_score(length: int, target: int) -> float:
    return max(0.0, 1.0 - abs(length - target) / target)


def length_reward(
    prompts: list,
    completions: list[str],
    *,
    target: int = 256,
    unit: Literal["chars", "words", "tokens"] = "words",
    **columns: Any,
) -> list[float]:
    """Registered as ``length``."""
    if target <= 0:
        raise ValueError(f"length_reward: target={target}; must be a positive length")
    if unit == "chars":
        lengths = [len(c) for c in completions]
    elif unit == "words":
        lengths = [len(c.split()) for c in completions]
    elif unit == "tokens":
        if "completion_ids" not in columns:
            raise KeyError("length_reward with unit='tokens' needs a 'completion_ids' column")
        lengths = [len(ids) for ids in columns["completion_ids"]]
    else:
        raise ValueError(f"length_reward: unit={unit!r}; use 'chars', 'words' or 'tokens'")
    return [length_score(n, target) for n in lengths]
