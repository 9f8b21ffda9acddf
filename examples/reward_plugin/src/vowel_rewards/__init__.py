"""An example reward function, installed as its own package and found by its entry point."""

from __future__ import annotations


def vowel_variety(
    prompts: list[object], completions: list[str], *, min_count: int = 1, **columns: list
) -> list[float | None]:
    """The share of the row's ``allowed`` letters that the completion uses at least
    ``min_count`` times: a song of all five vowels scores 1.0, "aaaa" 0.2. ``None`` (abstain)
    where the row has no ``allowed`` column (or an empty one)."""
    return [
        sum(text.count(c) >= min_count for c in chars) / len(chars) if chars else None
        for text, chars in zip(completions, columns["allowed"], strict=True)
    ]
