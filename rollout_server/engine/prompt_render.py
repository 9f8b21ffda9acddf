"""Bounded rendering of client prompts: chat messages through the chat template, then text to
token ids.

A client's prompt must cost the server a bounded amount of time and memory before its length
is even known. Two bounds hold here:

- **characters.** A tokenizer's token covers at most a handful of characters in real text, so
  text longer than ``CHARS_PER_TOKEN`` characters per token of the prompt limit cannot fit and
  is refused before it is tokenized (the service checks the text a client sends; the text a
  chat template renders is checked here, before it is encoded).
- **time.** The chat template is the server's own (``chat_template_kwargs`` cannot replace it),
  but its variables and the messages are the client's, and a template loops over them: its
  rendering runs under a deadline (``RENDER_DEADLINE_S``), checked at every line of the
  template's Python code, so no template, however it loops, renders for longer.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

CHARS_PER_TOKEN = 16
"""Characters of text a prompt may hold per token of its limit; 3-5 is usual, 16 leaves room
for runs of spaces or symbols that some tokenizers merge into one long token."""

RENDER_DEADLINE_S = 5.0
"""How long one chat prompt may take to render (real templates take milliseconds)."""


class PromptTooLong(ValueError):
    """The text to encode is longer than the character bound."""

    def __init__(self, chars: int, max_chars: int) -> None:
        super().__init__(f"{chars} characters, more than {max_chars}")
        self.chars = chars
        self.max_chars = max_chars


class RenderTimeout(BaseException):
    """The chat template did not finish within its deadline.

    A ``BaseException``: it is raised inside the template's code (by the deadline's trace
    function), and must not be caught by an ``except Exception`` of Jinja or transformers that
    would carry on rendering, no longer watched."""

    def __init__(self, seconds: float) -> None:
        super().__init__(f"the chat template did not finish rendering within {seconds:g} s")
        self.seconds = seconds


@contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Raise ``RenderTimeout`` in the Python code this thread runs once ``seconds`` passed.

    A trace function sees every call and every line of Python code the block runs (a Jinja
    template is compiled to Python, each loop iteration a line), so a template that loops is
    stopped at its next line past the deadline. The thread's previous trace function (a
    debugger's, coverage's) is restored afterwards."""
    end = time.monotonic() + seconds

    def trace(frame: Any, event: str, arg: Any) -> Any:
        if time.monotonic() > end:
            raise RenderTimeout(seconds)
        return trace

    previous = sys.gettrace()
    sys.settrace(trace)
    try:
        yield
    finally:
        sys.settrace(previous)


def render_chat(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool,
    chat_template_kwargs: dict[str, Any] | None,
    tools: list[dict[str, Any]] | None,
    deadline_s: float | None = RENDER_DEADLINE_S,
) -> str:
    """The chat template's text for ``messages``, rendered under ``deadline_s`` (None: none)."""

    def render() -> str:
        return tokenizer.apply_chat_template(
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **(chat_template_kwargs or {}),
        )

    if deadline_s is None:
        return render()
    with deadline(deadline_s):
        return render()


def encode_text(
    tokenizer: Any, text: str, *, max_chars: int | None, add_special_tokens: bool = True
) -> list[int]:
    """Token ids of ``text``, refused (``PromptTooLong``) if longer than ``max_chars``."""
    if max_chars is not None and len(text) > max_chars:
        raise PromptTooLong(len(text), max_chars)
    return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])


def text_chars(value: Any) -> int:
    """Characters of every string in ``value`` (messages, tools: keys and values), what a chat
    template can put into a prompt; counted before rendering, in one pass over the request."""
    total, stack = 0, [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict):
            total += sum(len(str(k)) for k in item)
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
        elif item is not None:
            total += len(str(item))
    return total
