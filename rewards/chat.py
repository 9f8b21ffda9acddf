"""Chat formats: turn messages into token ids for the multi-turn episode runner.

The runner never re-tokenizes what the model sampled: a conversation's ids are the prompt ids,
then the sampled ids of each assistant turn, then the ids of the template text that follows it
(end of turn, tool messages, next generation prompt). ``HFChatFormat`` gets that text from the
tokenizer's own chat template with the usual suffix trick: render a fixed conversation ending in an
assistant turn with and without the new messages, and keep what follows the assistant turn.

The assistant turn is located by a marker string rather than by rendering the prefix alone,
because templates render the *last* assistant turn differently from an earlier one (Qwen3 adds an
empty ``<think></think>`` block only to the last), so "render the prefix, take the longer
render's tail" would cut in the wrong place.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

_MARK = "GRPO_SERVICE_ASSISTANT_CONTENT_MARK"
_BASE = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _MARK}]


class ChatTemplateError(ValueError):
    """The tokenizer's chat template cannot be used for multi-turn token accounting."""


@runtime_checkable
class ChatFormat(Protocol):
    def prompt_ids(self, messages: list[dict[str, Any]], tools: list[dict] | None) -> list[int]:
        """Ids of the conversation so far plus the generation prompt of the assistant."""
        ...

    def tool_message_ids(self, tool_messages: list[dict[str, Any]]) -> list[int]:
        """Ids that follow a closed assistant turn: the tool message(s) and the next generation
        prompt."""
        ...

    def close_turn_ids(self, completion_ids: list[int]) -> list[int]:
        """Ids still missing to close a sampled assistant turn as the template closes it (e.g.
        the newline after ``<|im_end|>``, or all of it when the sample was cut off)."""
        ...


class HFChatFormat:
    """``ChatFormat`` for a Hugging Face tokenizer with a chat template (tools supported when
    the template supports them, as Qwen's and Hermes' do)."""

    def __init__(self, tokenizer: Any, chat_template_kwargs: dict[str, Any] | None = None) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ChatTemplateError(
                f"{type(tokenizer).__name__} has no chat_template; set tokenizer.chat_template or "
                f"use a chat model's tokenizer"
            )
        self.tokenizer = tokenizer
        self.template_kwargs = dict(chat_template_kwargs or {})
        self.end_text = self._after_mark(self._render(_BASE, add_generation_prompt=False))
        self.end_ids = self._encode(self.end_text)
        if not self.end_ids:
            raise ChatTemplateError("the chat template writes nothing after an assistant turn")

    def _render(
        self, messages: list[dict], tools: list[dict] | None = None, *, add_generation_prompt: bool
    ) -> str:
        return self.tokenizer.apply_chat_template(
            messages,
            tools=tools,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **self.template_kwargs,
        )

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    @staticmethod
    def _after_mark(text: str) -> str:
        i = text.find(_MARK)
        if i < 0 or text.find(_MARK, i + 1) >= 0:
            raise ChatTemplateError(
                "the chat template does not render assistant content verbatim exactly once; "
                "multi-turn token accounting needs a template that does"
            )
        return text[i + len(_MARK) :]

    def prompt_ids(
        self, messages: list[dict[str, Any]], tools: list[dict] | None = None
    ) -> list[int]:
        return self._encode(self._render(messages, tools or None, add_generation_prompt=True))

    def tool_message_ids(self, tool_messages: list[dict[str, Any]]) -> list[int]:
        after = self._after_mark(self._render(_BASE + tool_messages, add_generation_prompt=True))
        if not after.startswith(self.end_text):
            raise ChatTemplateError(
                f"the chat template closes an assistant turn with {self.end_text!r} when it is "
                f"last but not when tool messages follow ({after[:40]!r}...)"
            )
        return self._encode(after[len(self.end_text) :])

    def close_turn_ids(self, completion_ids: list[int]) -> list[int]:
        end = self.end_ids
        for k in range(min(len(end), len(completion_ids)), 0, -1):
            if completion_ids[-k:] == end[:k]:
                return end[k:]
        return list(end)
