"""The OpenAI-compatible subset's request models, and their translation to ``/generate``.

Enough of ``/v1/completions`` and ``/v1/chat/completions`` for the official ``openai`` client
and agent harnesses. Like vLLM's ``return_token_ids``, every choice also carries ``token_ids``
and ``prompt_token_ids`` (read them as ``choice.model_extra["token_ids"]`` with the client), so
rollouts driven through this API can still be trained on without re-tokenizing.

Not supported (refused with a 400 naming the field): streaming, ``echo``, ``suffix``,
``best_of``, ``logit_bias``, presence/frequency penalties (use ``repetition_penalty``), images.
Log-probs are those of the sampled tokens; top alternatives are not computed, so
``top_logprobs`` comes back empty (chat) or null (completions).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from rollout_server.errors import BadRequest
from rollout_server.protocol import ChatMessage, GenerateRequest
from rollout_server.protocol.template_kwargs import check_template_kwargs


class _OpenAIRequest(BaseModel):
    """Fields shared by both routes; vLLM's extra sampling fields included. Strict types, as in
    ``/generate`` and OpenAI's own API: ``"n": true`` or ``"temperature": "0.5"`` is a 422,
    not a silent 1 or 0.5 (ints are taken where floats are meant)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    n: int = Field(1, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    top_k: int = Field(-1, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    # vLLM's: the choices always carry token_ids and prompt_token_ids here, and the text is
    # always decoded without special tokens
    return_token_ids: bool | None = None
    skip_special_tokens: bool = True

    def _refuse_unsupported(self) -> None:
        checks = {
            "stream": (self.stream, "streaming is not supported; set stream=false"),
            "presence_penalty": (self.presence_penalty, "use repetition_penalty instead"),
            "frequency_penalty": (self.frequency_penalty, "use repetition_penalty instead"),
            "logit_bias": (self.logit_bias, "logit_bias is not supported"),
        }
        for field, (value, why) in checks.items():
            if value:
                raise BadRequest(f"{field}={value!r} is not supported: {why}")

    def _sampling(self, max_tokens: int) -> dict[str, Any]:
        return {
            "n": self.n,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
            "max_tokens": max_tokens,
            "stop": [self.stop] if isinstance(self.stop, str) else (self.stop or []),
            "stop_token_ids": self.stop_token_ids,
            "ignore_eos": self.ignore_eos,
            "seed": self.seed,
        }


class CompletionRequest(_OpenAIRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | bool | None = Field(None, ge=0, le=20, description="true means 1")
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("logprobs")
    @classmethod
    def _logprobs_bool(cls, v: int | bool | None) -> int | None:
        """Some clients send a bool: true asks for the sampled token's log-prob alone."""
        if isinstance(v, bool):
            return 1 if v else None
        return v

    def to_generate(self, default_max_tokens: int) -> GenerateRequest:
        self._refuse_unsupported()
        if self.echo:
            raise BadRequest(
                "echo=true is not supported; the prompt comes back as prompt_token_ids"
            )
        if self.suffix:
            raise BadRequest("suffix is not supported")
        if self.best_of not in (None, self.n):
            raise BadRequest(f"best_of={self.best_of} is not supported (only best_of == n)")
        prompt = self.prompt
        prompts: list[Any]
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompts = [prompt]
        else:
            prompts = list(prompt)
        return GenerateRequest(
            prompts=prompts,
            logprobs=self.logprobs is not None,
            **self._sampling(self.max_tokens or default_max_tokens),
        )


class ChatCompletionRequest(_OpenAIRequest):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables_only(cls, value: dict[str, Any]) -> dict[str, Any]:
        return check_template_kwargs(value)

    def to_generate(self, default_max_tokens: int) -> GenerateRequest:
        self._refuse_unsupported()
        if isinstance(self.tool_choice, dict):
            raise BadRequest("tool_choice naming a function is not supported; use 'auto'")
        if self.response_format and self.response_format.get("type") != "text":
            raise BadRequest("response_format other than {'type': 'text'} is not supported")
        messages = [_chat_message(i, m) for i, m in enumerate(self.messages)]
        max_tokens = self.max_completion_tokens or self.max_tokens or default_max_tokens
        return GenerateRequest(
            prompts=[messages],
            add_generation_prompt=self.add_generation_prompt,
            chat_template_kwargs=self.chat_template_kwargs,
            tools=self.tools if self.tool_choice != "none" else None,
            logprobs=self.logprobs,
            **self._sampling(max_tokens),
        )


def _chat_message(i: int, message: dict[str, Any]) -> ChatMessage:
    """OpenAI message -> ``ChatMessage``: text parts joined, ``developer`` read as system."""
    m = dict(message)
    if m.get("role") == "developer":
        m["role"] = "system"
    content = m.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise BadRequest(
                    f"messages[{i}].content: {kind!r} parts are not supported (text only)"
                )
            texts.append(str(part.get("text", "")))
        m["content"] = "".join(texts)
    return ChatMessage.model_validate(m)
