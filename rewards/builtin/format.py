"""Format reward: 1.0 when a completion matches a regular expression, else 0.0.

The default pattern asks for a reasoning block then an answer block,
``<think>...</think><answer>...</answer>``, the format of DeepSeek-R1-style training.
"""

from __future__ import annotations

import functools
import re
from typing import Any

THINK_ANSWER = r"^\s*<think>.*?</think>\s*<answer>.*?</answer>\s*$"


@functools.lru_cache(maxsize=64)
def _compile(pattern: str) -> re.Pattern[str]:
    try:
        return re.compile(pattern, re.DOTALL)
    except re.error as e:
        raise ValueError(f"format_reward: invalid regex pattern {pattern!r}: {e}") from e


def format_reward(
    prompts: list, completions: list[str], *, pattern: str = THINK_ANSWER, **columns: Any
) -> list[float]:
    """Registered as ``format``. ``pattern`` is searched with ``re.DOTALL`` (``.`` spans lines);
    anchor it with ``^...$`` to require the whole completion to match."""
    regex = _compile(pattern)
    return [1.0 if regex.search(c) else 0.0 for c in completions]
