"""The OpenAI-compatible answers, built from a ``/generate`` response: completion and chat
choices with ``token_ids`` and ``prompt_token_ids``, and Hermes/Qwen tool calls parsed out of the
text."""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rollout_server.protocol import GenerateResponse, Sample

if TYPE_CHECKING:
    from rollout_server.openai_compat.protocol import ChatCompletionRequest

TokenText = Callable[[int], str]

_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """Hermes/Qwen tool calls (``<tool_call>{"name", "arguments"}</tool_call>``) in ``text``.

    Returns the text before the first call (None if blank) and the calls in OpenAI form; text
    with no well-formed call comes back unchanged with no calls."""
    calls, first = [], None
    for match in _TOOL_CALL.finditer(text):
        try:
            body = json.loads(match.group(1))
        except json.JSONDecodeError:
            continue
        if not isinstance(body, dict) or not isinstance(body.get("name"), str):
            continue
        first = match.start() if first is None else first
        args = body.get("arguments", {})
        calls.append(
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {
                    "name": body["name"],
                    "arguments": args if isinstance(args, str) else json.dumps(args),
                },
            }
        )
    if not calls:
        return text, []
    return (text[:first].strip() or None), calls


def _usage(resp: GenerateResponse) -> dict[str, int]:
    prompt = sum(len(r.prompt_token_ids) for r in resp.results)
    completion = sum(len(s.token_ids) for r in resp.results for s in r.samples)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def completion_response(
    resp: GenerateResponse, model: str, logprobs: int | None, token_text: TokenText
) -> dict[str, Any]:
    """``token_text(id) -> str`` renders one token for the log-prob listing."""
    choices = []
    for r in resp.results:
        for s in r.samples:
            choice: dict[str, Any] = {
                "index": len(choices),
                "text": s.text,
                "finish_reason": s.finish_reason,
                "logprobs": _completion_logprobs(s, token_text) if logprobs is not None else None,
                "token_ids": s.token_ids,
                "prompt_token_ids": r.prompt_token_ids,
                "weight_version": s.weight_version,
            }
            choices.append(choice)
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": _usage(resp),
    }


def _completion_logprobs(s: Sample, token_text: TokenText) -> dict[str, Any]:
    tokens = [token_text(t) for t in s.token_ids]
    offsets, pos = [], 0
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": s.logprobs,
        "top_logprobs": None,
        "text_offset": offsets,
    }


def chat_response(
    resp: GenerateResponse, model: str, req: ChatCompletionRequest, token_text: TokenText
) -> dict[str, Any]:
    (result,) = resp.results
    choices = []
    for i, s in enumerate(result.samples):
        content, calls = s.text, []
        if req.tools and req.tool_choice != "none":
            content, calls = parse_tool_calls(s.text)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        finish = "tool_calls" if calls and s.finish_reason == "stop" else s.finish_reason
        logprobs = None
        if req.logprobs:
            logprobs = {"content": [_chat_token(token_text(t), lp) for t, lp in zip(s.token_ids, s.logprobs, strict=True)]}  # fmt: skip
        choices.append(
            {
                "index": i,
                "message": message,
                "finish_reason": finish,
                "logprobs": logprobs,
                "token_ids": s.token_ids,
                "prompt_token_ids": result.prompt_token_ids,
                "weight_version": s.weight_version,
            }
        )
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "prompt_token_ids": result.prompt_token_ids,
        "usage": _usage(resp),
    }


def _chat_token(text: str, logprob: float) -> dict[str, Any]:
    return {
        "token": text,
        "logprob": logprob,
        "bytes": list(text.encode("utf-8")),
        "top_logprobs": [],
    }
