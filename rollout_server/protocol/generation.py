"""The wire models of generation (``POST /generate``): prompts, sampling, samples.

Token ids are the source of truth: a prompt given as text or chat messages is tokenized once by the
server, and its ids are returned so the learner never re-tokenizes.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from rollout_server.protocol.base import WireModel, refuse_lone_surrogates
from rollout_server.protocol.routes import RoutedExperts
from rollout_server.protocol.template_kwargs import check_template_kwargs

FinishReason = Literal["stop", "length", "abort"]

# Floors below which a sampling value is numerically degenerate in float32 (vLLM's own floor
# for temperature; it clamps smaller ones, here they are refused): a smaller top_p rounds to 0
# and drops every token, a smaller penalty or temperature turns logits into inf, and both give
# NaN log-probs or garbage samples. Top-k at or above the vocabulary is off; its bound keeps it
# an int32 for the engines.
MIN_TEMPERATURE = 1e-2
MIN_TOP_P = 1e-6
MIN_REPETITION_PENALTY = 1e-2
MAX_TOP_K = 2**31 - 1


class ChatMessage(BaseModel):
    """One chat message. Extra keys (``tool_calls``, ``name``, ``tool_call_id``) pass through to
    the chat template unchanged."""

    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = ""


PromptInput = Annotated[
    list[int] | str | list[ChatMessage],
    Field(description="token ids, raw text, or a list of chat messages"),
]


class SamplingParams(WireModel):
    """Sampling parameters, with vLLM's meaning. ``top_k`` <= 0 and ``min_p`` = 0 disable them.

    Strict types (JSON's, with ints allowed where floats are meant): ``"n": true`` or
    ``"max_tokens": 2.0`` is a 422, not a silent 1 or 2. NaN and infinities are a 422, and so
    are values too small to sample from (the ``MIN_*`` floors above)."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    temperature: float = Field(
        1.0, ge=0.0, le=100.0, description=f"0 means greedy; else at least {MIN_TEMPERATURE}"
    )
    top_p: float = Field(1.0, ge=MIN_TOP_P, le=1.0)
    top_k: int = Field(-1, ge=-1, le=MAX_TOP_K, description="-1 or 0 disables top-k")
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, ge=MIN_REPETITION_PENALTY, le=10.0)
    max_tokens: int = Field(256, ge=1, description="completion tokens per sample")
    stop: list[str] = Field(default_factory=list, description="stop strings (not included)")
    stop_token_ids: list[int] = Field(default_factory=list, description="extra stop token ids")
    ignore_eos: bool = False
    seed: int | None = Field(
        None,
        description="same seed + same weights + same request = same output; prompt k's "
        "sample i draws from seed + k * n + i",
    )
    logprobs: bool = Field(
        True,
        description="return each sampled token's log-prob; false spares vLLM the work and "
        "returns empty logprobs lists",
    )
    return_routed_experts: bool = Field(
        False,
        description="return each sample's routed experts (a mixture-of-experts model on the "
        "transformers engine): the expert indices every MoE layer chose for each token the "
        "server ran, for the learner's routing replay",
    )

    @model_validator(mode="before")
    @classmethod
    def _stop_as_list(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("stop"), str):
            data = {**data, "stop": [data["stop"]]}
        return data

    @field_validator("temperature")
    @classmethod
    def _temperature_floor(cls, value: float) -> float:
        if 0 < value < MIN_TEMPERATURE:
            raise ValueError(
                f"a temperature in (0, {MIN_TEMPERATURE}) is numerically degenerate (vLLM's "
                f"floor); send 0 for greedy or at least {MIN_TEMPERATURE}"
            )
        return value

    def describe(self) -> str:
        """The values that shape the sampling distribution, for an error message."""
        return ", ".join(
            f"{name}={getattr(self, name)}"
            for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
        )


class GenerateRequest(SamplingParams):
    """``POST /generate``: ``n`` samples for each prompt of a batch."""

    prompts: list[PromptInput] = Field(min_length=1)
    n: int = Field(1, ge=1, description="samples per prompt")
    add_generation_prompt: bool = Field(True, description="for chat prompts")
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description='variables of the server\'s chat template, e.g. {"enable_thinking": '
        "false}: names whose values are JSON scalars; apply_chat_template's own parameters "
        "(chat_template, tokenize ...) are refused",
    )
    tools: list[dict[str, Any]] | None = Field(
        None, description="tool schemas passed to the chat template (chat prompts only)"
    )

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        refuse_lone_surrogates(data)
        return data

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables_only(cls, value: dict[str, Any]) -> dict[str, Any]:
        return check_template_kwargs(value)

    def sampling(self) -> SamplingParams:
        return SamplingParams.model_validate(
            self.model_dump(include=set(SamplingParams.model_fields))
        )


class Sample(WireModel):
    token_ids: list[int]
    logprobs: list[float] = Field(
        description="log-prob of each sampled token under the sampling distribution; "
        "empty when the request set logprobs=false"
    )
    text: str
    finish_reason: FinishReason
    weight_version: int
    routed_experts: RoutedExperts | None = Field(
        None,
        description="with return_routed_experts: [prompt + completion - 1 tokens, layers, k] "
        "expert indices (rollout_server.protocol.routes)",
    )


class PromptResult(WireModel):
    prompt_token_ids: list[int]
    samples: list[Sample]


class GenerateResponse(WireModel):
    results: list[PromptResult]
    weight_version: int = Field(description="version of the weights that produced every sample")
    server: str | None = Field(None, description="filled in by the client: which server answered")
