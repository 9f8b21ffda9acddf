"""Small text helpers on completions, shared by the built-in rewards and the episode runner."""

from __future__ import annotations

import re

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)


def strip_reasoning(text: str) -> str:
    """The part of a completion after its reasoning: everything after the last ``</think>``."""
    _, sep, after = text.rpartition("</think>")
    return after if sep else text


def final_answer_text(text: str) -> str:
    """Where a completion states its final answer: after the last ``####`` (GSM8K style) if it
    has one, else the whole answer part (math-verify then finds ``\\boxed{}`` or the last
    expression)."""
    text = strip_reasoning(text)
    _, sep, after = text.rpartition("####")
    return after.strip() if sep else text


def extract_code(text: str) -> str:
    """The last fenced code block (preferring ones tagged python/py), else the text itself."""
    text = strip_reasoning(text)
    blocks = _FENCE.findall(text)
    if not blocks:
        return text.strip()
    python = [code for lang, code in blocks if lang.lower() in ("python", "py", "python3")]
    return (python or [code for _, code in blocks])[-1]
