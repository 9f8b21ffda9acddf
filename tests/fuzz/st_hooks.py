"""Schemathesis checks for ``make fuzz`` (loaded through ``SCHEMATHESIS_HOOKS``).

``not_a_server_error`` fails on every 5xx, but the API answers 501 for what an engine cannot do
(NCCL on the transformers engine) and 503 while loading or asleep: those pass where the
operation's OpenAPI lists them; any 500, and any other 5xx, fails."""

from __future__ import annotations

from typing import Any

import schemathesis

ALLOWED_DOCUMENTED = {501, 503}


@schemathesis.check
def no_server_fault(ctx: Any, response: Any, case: Any) -> None:
    status = response.status_code
    if status < 500:
        return
    documented = {str(code) for code in case.operation.definition.raw.get("responses", {})}
    if status in ALLOWED_DOCUMENTED and str(status) in documented:
        return
    raise AssertionError(
        f"{case.operation.label} answered {status}"
        + ("" if status in ALLOWED_DOCUMENTED else " (a server fault)")
        + f": {response.text[:300]}"
    )
