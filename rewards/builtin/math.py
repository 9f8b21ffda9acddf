"""Math answer accuracy, checked with Hugging Face's ``math-verify`` (not hand-written parsing).

The gold answer comes from a dataset column (``answer`` by default, as in GSM8K, whose answers end
in ``#### 72``). The completion's answer is what follows its last ``####`` if it has one, else
what math-verify extracts: the last ``\\boxed{}``, else the last LaTeX or plain expression. Answers
are compared as math, so ``0.5``, ``1/2`` and ``\\frac{1}{2}`` all match.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from rewards.text import final_answer_text


def _timeouts() -> dict[str, int | None]:
    # math-verify's timeouts use signal.alarm, which only works in the main thread; the scoring
    # runner calls sync rewards from a worker thread and bounds them with its own timeout.
    on_main = threading.current_thread() is threading.main_thread()
    return {"seconds": 5 if on_main else None}


class _BoundElsewhere(logging.Filter):
    """Drops math-verify's warning that its timeout is off (off off the main thread, above):
    the scoring runner's ``scoring.timeout_s`` bounds the reward instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_BoundElsewhere())


def gold_text(gold: Any) -> str:
    """The answer part of a gold column value: after ``####`` for GSM8K solutions."""
    text = str(gold)
    _, sep, after = text.rpartition("####")
    return after.strip() if sep else text.strip()


def score_one(completion: str, gold: Any) -> float | None:
    """1.0 if the completion's final answer equals the gold answer, else 0.0; None when there
    is no gold answer or it cannot be parsed (the sample is not gradable)."""
    from math_verify import parse, verify

    if gold is None or str(gold).strip() == "":
        return None
    seconds = _timeouts()["seconds"]
    gold_parsed = parse(gold_text(gold), parsing_timeout=seconds)
    if not gold_parsed:
        return None
    pred = parse(final_answer_text(completion), parsing_timeout=seconds)
    return 1.0 if pred and verify(gold_parsed, pred, timeout_seconds=seconds) else 0.0


def math_accuracy(
    prompts: list, completions: list[str], *, gold_column: str = "answer", **columns: Any
) -> list[float | None]:
    """Registered as ``math_accuracy``. ``gold_column`` names the dataset column that holds the
    reference answers (set it with ``kwargs = {gold_column = "solution"}``)."""
    if gold_column not in columns:
        raise KeyError(
            f"math_accuracy needs the reference answers in column {gold_column!r}, but the "
            f"columns are {sorted(columns)}; set kwargs.gold_column to the right one"
        )
    golds = columns[gold_column]
    return [score_one(c, g) for c, g in zip(completions, golds, strict=True)]
