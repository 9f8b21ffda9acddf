"""Parse tool calls out of a completion, in the Qwen/Hermes format::

    <tool_call>
    {"name": "add", "arguments": {"a": 1, "b": 2}}
    </tool_call>

A completion with no ``<tool_call>`` tag is a plain message. A tag whose body is not a JSON object
with a string ``name`` and an object ``arguments`` is a malformed call: it is reported (in order,
among the calls) so the model can be told, rather than silently dropped.
"""

from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|\Z)", re.DOTALL)


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]

    def to_openai(self, call_id: str) -> dict[str, Any]:
        return {
            "id": call_id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass
class MalformedCall:
    """A ``<tool_call>`` whose body could not be used; ``reason`` is shown to the model."""

    raw: str
    reason: str


@dataclass
class ParsedMessage:
    """``content``: the text outside the tool-call tags; ``calls``: in order of appearance."""

    content: str
    calls: list[ToolCall | MalformedCall] = field(default_factory=list)


def _parse_one(body: str) -> ToolCall | MalformedCall:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return MalformedCall(body, f"tool call is not valid JSON ({e.msg} at char {e.pos})")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return MalformedCall(body, 'tool call must be {"name": <string>, "arguments": <object>}')
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models double-encode the arguments
        with contextlib.suppress(json.JSONDecodeError):
            args = json.loads(args)
    if not isinstance(args, dict):
        return MalformedCall(body, f"arguments of {obj['name']!r} must be a JSON object")
    return ToolCall(name=obj["name"], arguments=args)


def parse_tool_calls(text: str) -> ParsedMessage:
    """Split a completion into its plain content and its tool calls."""
    calls = [_parse_one(m.group(1)) for m in _TOOL_CALL.finditer(text)]
    content = _TOOL_CALL.sub("", text).strip() if calls else text
    return ParsedMessage(content=content, calls=calls)
