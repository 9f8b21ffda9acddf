"""SFT rows -> token ids and a loss mask: the model learns only what it will be asked to write.

Two row shapes, as in TRL:

- chat rows, ``messages`` = ``[{role, content}, ...]``: rendered with the model's chat template;
  the loss covers every assistant turn (what the template adds for it after the generation
  prompt, so its end-of-turn token too) and nothing else (system, user, tool turns);
- ``prompt`` / ``completion`` rows: the loss covers the completion only. Text prompts are not
  templated and the tokenizer's EOS is appended to the completion (so the model learns to stop);
  a chat prompt (a list of messages) is templated, with the completion as the assistant's turn.

The text is cut into loss / no-loss segments by rendering each assistant turn's prefix, and each
segment is tokenized on its own, so a prompt's tokens are exactly those the model will see at
generation time. This needs a template that renders a conversation's first turns as a prefix of
the whole (ChatML does; Qwen3's drops the <think> of earlier assistant turns): otherwise the row
is refused with a message that says how to split it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from learner.config import SFTConfig
from learner.data.prompts import DataError, check_prompts, read_rows

RowFormat = Literal["messages", "prompt_completion"]


@dataclass
class SFTExample:
    input_ids: list[int]
    loss_mask: list[int]  # [T] 1 where the token is a loss target (assistant / completion)

    @property
    def num_targets(self) -> int:
        return sum(self.loss_mask[1:])  # the first token is never predicted

    def truncate(self, max_length: int) -> SFTExample:
        return SFTExample(self.input_ids[:max_length], self.loss_mask[:max_length])


def load_sft_rows(cfg: SFTConfig) -> tuple[list[dict[str, Any]], RowFormat]:
    """The rows and their shape, decided by the first row's columns."""
    fmt: RowFormat = "messages"
    rows = read_rows(cfg.data, "sft.data", split=cfg.split, subset=cfg.subset)
    try:
        check_prompts(rows, cfg.data, cfg.messages_column, "sft.messages_column")
    except DataError as e:
        if f"row 0 has no {cfg.messages_column!r}" not in str(e):
            raise
        fmt = "prompt_completion"
        try:
            check_prompts(rows, cfg.data, cfg.prompt_column, "sft.prompt_column", allow_empty=True)
        except DataError as e2:
            if f"row 0 has no {cfg.prompt_column!r}" not in str(e2):
                raise
            raise DataError(
                f"sft.data {cfg.data}: row 0 has neither {cfg.messages_column!r} nor "
                f"{cfg.prompt_column!r} (columns: {sorted(rows[0])}); set sft.messages_column, "
                "or sft.prompt_column and sft.completion_column"
            ) from None
    for i, row in enumerate(rows):
        if fmt == "messages" and not isinstance(row[cfg.messages_column], list):
            raise DataError(
                f"sft.data row {i}: {cfg.messages_column!r} must be a list of chat messages"
            )
        if fmt == "prompt_completion" and cfg.completion_column not in row:
            raise DataError(
                f"sft.data row {i} has {cfg.prompt_column!r} but no {cfg.completion_column!r} "
                f"column (columns: {sorted(row)}); rows need {cfg.messages_column!r}, or "
                f"{cfg.prompt_column!r} and {cfg.completion_column!r} (see sft.*_column)"
            )
    if not any(_has_target(row, cfg, fmt) for row in rows):
        what = (
            f"an assistant turn in {cfg.messages_column!r}"
            if fmt == "messages"
            else f"a non-empty {cfg.completion_column!r}"
        )
        raise DataError(f"sft.data {cfg.data}: no row has {what}, so there is nothing to train on")
    return rows, fmt


def _has_target(row: dict[str, Any], cfg: SFTConfig, fmt: RowFormat) -> bool:
    if fmt == "messages":
        return any(
            isinstance(m, dict) and m.get("role") == "assistant" and m.get("content")
            for m in row[cfg.messages_column]
        )
    return bool(row[cfg.completion_column])


def _render(tokenizer: Any, messages: list[dict[str, Any]], gen: bool, kw: dict[str, Any]) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen, **kw)


def assistant_spans(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    *,
    train_from: int = 0,
    template_kwargs: dict[str, Any] | None = None,
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of its assistant turns from message
    ``train_from`` on: each span runs from the end of the generation prompt to the end of the
    turn."""
    kw = template_kwargs or {}
    full = _render(tokenizer, messages, False, kw)
    spans = []
    for i, m in enumerate(messages):
        if i < train_from or m.get("role") != "assistant":
            continue
        if i == 0:
            raise DataError("a conversation needs a user or system turn before the assistant's")
        prefix = _render(tokenizer, messages[:i], True, kw)
        upto = _render(tokenizer, messages[: i + 1], False, kw)
        if not (upto.startswith(prefix) and full.startswith(upto)):
            raise DataError(
                "the chat template renders this conversation's early turns differently from the "
                "whole (e.g. Qwen3 drops the <think> of earlier assistant turns): give such rows "
                "as prompt (the earlier turns) + completion (one assistant turn) instead"
            )
        if spans and len(prefix) < spans[-1][1]:
            raise DataError("the chat template reorders turns: cannot tell assistant text apart")
        spans.append((len(prefix), len(upto)))
    return full, spans


def _encode(tokenizer: Any, text: str, special: bool = False) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=special) if text else []


def tokenize_spans(tokenizer: Any, text: str, spans: list[tuple[int, int]]) -> SFTExample:
    """Tokenize the segments between and inside ``spans`` one by one; mask 1 inside spans."""
    ids: list[int] = []
    mask: list[int] = []
    cursor = 0
    for start, end in [*spans, (len(text), len(text))]:
        for seg, m in ((text[cursor:start], 0), (text[start:end], 1)):
            toks = _encode(tokenizer, seg)
            ids += toks
            mask += [m] * len(toks)
        cursor = end
    return SFTExample(ids, mask)


def tokenize_row(
    tokenizer: Any,
    row: dict[str, Any],
    cfg: SFTConfig,
    fmt: RowFormat,
    template_kwargs: dict[str, Any] | None = None,
) -> SFTExample:
    """One row -> ids and loss mask (not truncated)."""
    if fmt == "messages":
        text, spans = assistant_spans(
            tokenizer, row[cfg.messages_column], template_kwargs=template_kwargs
        )
        return tokenize_spans(tokenizer, text, spans)
    prompt, completion = row[cfg.prompt_column], row[cfg.completion_column]
    if isinstance(prompt, list):  # a chat prompt: the completion is the assistant's turn
        if isinstance(completion, str):
            completion = [{"role": "assistant", "content": completion}]
        text, spans = assistant_spans(
            tokenizer, prompt + completion, train_from=len(prompt), template_kwargs=template_kwargs
        )
        return tokenize_spans(tokenizer, text, spans)
    if not isinstance(completion, str):
        raise DataError(f"a text {cfg.prompt_column!r} needs a text {cfg.completion_column!r}")
    p_ids = _encode(tokenizer, prompt, special=True)  # BOS, for tokenizers that add one
    c_ids = _encode(tokenizer, completion)
    eos = tokenizer.eos_token_id
    if eos is not None and (not c_ids or c_ids[-1] != eos):
        c_ids.append(eos)
    return SFTExample(p_ids + c_ids, [0] * len(p_ids) + [1] * len(c_ids))
