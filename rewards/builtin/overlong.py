"""DAPO's soft overlong punishment (Yu et al. 2025, section 3.4): a length penalty in tokens.

A completion cut at the generation limit is scored as if it were wrong, though its reasoning may
be sound; that teaches noise. DAPO instead adds a penalty that starts ``buffer`` tokens before
``max_tokens`` and grows linearly to -1 at ``max_tokens``::

    0                                   if len <= max_tokens - buffer
    ((max_tokens - buffer) - len) / buffer   if max_tokens - buffer < len <= max_tokens
    -1                                  if len > max_tokens

Add it beside the task's reward (``[[rewards]] name = "overlong"`` with ``kwargs = {max_tokens =
4096, buffer = 512}``, ``max_tokens`` usually ``sampling.max_tokens``). Lengths are the sampled
token counts (the learner's ``completion_ids`` column). ``grpo.mask_truncated_completions`` is the
other remedy DAPO names: cut completions get no loss at all.
"""

from __future__ import annotations

from typing import Any


def overlong_score(length: int, max_tokens: int, buffer: int) -> float:
    start = max_tokens - buffer
    if length <= start:
        return 0.0
    if length > max_tokens:
        return -1.0
    return (start - length) / buffer


def overlong_penalty(
    prompts: list, completions: list[str], *, max_tokens: int, buffer: int = 512, **columns: Any
) -> list[float]:
    """Registered as ``overlong``: 0 up to ``max_tokens - buffer`` sampled tokens, then falling
    linearly to -1 at ``max_tokens``, -1 beyond."""
    if max_tokens <= 0:
        raise ValueError(f"overlong: max_tokens={max_tokens}; give the generation limit in tokens")
    if not 0 < buffer <= max_tokens:
        raise ValueError(
            f"overlong: buffer={buffer}; must be a positive token count at most max_tokens "
            f"({max_tokens}): the penalty ramps over the last `buffer` tokens"
        )
    if "completion_ids" not in columns:
        raise KeyError("overlong needs the 'completion_ids' column (the learner adds it)")
    return [overlong_score(len(ids), max_tokens, buffer) for ids in columns["completion_ids"]]
