"""What a client may pass to the chat template (``chat_template_kwargs``).

The keys reach ``tokenizer.apply_chat_template(**kwargs)`` as template variables. Some of that
function's own parameters would change what renders rather than feed the template: above all
``chat_template``, which replaces the server's template with the client's Jinja source (a
template that loops, or builds a string of gigabytes). So the keys are template variables
only: names (letters, digits, ``_``), none of them a parameter of ``apply_chat_template``, and
their values JSON scalars (``true``, ``4``, ``"low"``, ``null``) of bounded size; a violation
is a 422 naming the key. ``tools``, ``add_generation_prompt`` and the messages have their own
fields.
"""

from __future__ import annotations

import re
from typing import Any

MAX_TEMPLATE_KWARGS = 32
MAX_TEMPLATE_KWARG_CHARS = 1024  # of a string value
_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,63}")

RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        # they select or replace the template, or what it is given, or how its output is
        # returned: apply_chat_template's own parameters, not template variables
        "chat_template",
        "conversation",
        "messages",
        "tools",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
        "processor_kwargs",
    }
)


def check_template_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` unchanged, or the ``ValueError`` (a 422) naming the first key refused."""
    if len(kwargs) > MAX_TEMPLATE_KWARGS:
        raise ValueError(
            f"{len(kwargs)} keys, more than the {MAX_TEMPLATE_KWARGS} a request may pass to "
            "the chat template"
        )
    for key, value in kwargs.items():
        if key in RESERVED_TEMPLATE_KWARGS:
            raise ValueError(
                f"{key!r} is not accepted: it is a parameter of apply_chat_template, not a "
                "template variable (the server renders with its model's own chat template; "
                "tools and add_generation_prompt are fields of the request)"
            )
        if not _NAME.fullmatch(key):
            raise ValueError(
                f"{key[:64]!r} is not a template variable name (a letter, then up to 63 "
                "letters, digits or '_')"
            )
        if value is not None and not isinstance(value, bool | int | float | str):
            raise ValueError(
                f"{key!r}: a {type(value).__name__} is not accepted; a chat template variable "
                "is a JSON scalar (true/false, a number, a string or null)"
            )
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 2**31:
            raise ValueError(f"{key!r}: {value} is outside the range of a template number")
        if isinstance(value, str) and len(value) > MAX_TEMPLATE_KWARG_CHARS:
            raise ValueError(
                f"{key!r}: a string of {len(value)} characters, more than "
                f"{MAX_TEMPLATE_KWARG_CHARS}"
            )
    return kwargs
