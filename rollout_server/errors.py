"""HTTP errors of the serving layer, and the JSON body every error answer carries.

Every error body is ``{"detail": "<one readable sentence>"}`` with a real status code: 4xx for
the caller's mistakes (naming the field and the limit), 503 while loading or asleep (with
``Retry-After``), 501 for what the engine cannot do, 500 only for faults of the server.
"""

from __future__ import annotations


class ServiceError(Exception):
    status_code = 500

    def __init__(self, detail: str, *, headers: dict[str, str] | None = None) -> None:
        super().__init__(detail)
        self.detail = detail
        self.headers = headers


class BadRequest(ServiceError):
    status_code = 400


class NotFound(ServiceError):
    status_code = 404


class Conflict(ServiceError):
    status_code = 409


class NonFiniteWeights(ServiceError):
    """The served weights hold NaN/inf: a fault of the server's state (500), not of the request.
    Every update refuses them (HTTP, file, NCCL, CUDA IPC); they come with the startup checkpoint."""

    status_code = 500


class Unavailable(ServiceError):
    status_code = 503

    def __init__(self, detail: str, *, retry_after_s: int = 5) -> None:
        super().__init__(detail, headers={"Retry-After": str(retry_after_s)})


def format_validation_errors(errors: list[dict]) -> str:
    """``body.temperature: Input should be greater than or equal to 0`` and so on, one line."""
    parts = []
    for err in errors:
        if err.get("type") == "json_invalid":  # loc is ("body", <character offset>)
            at = err.get("loc", ("body", "?"))[-1]
            reason = (err.get("ctx") or {}).get("error", "")
            parts.append(f"malformed JSON at character {at}" + (f": {reason}" if reason else ""))
            continue
        loc = ".".join(str(x) for x in err.get("loc", ()))
        parts.append(f"{loc}: {err.get('msg', 'invalid')}" if loc else err.get("msg", "invalid"))
    return "; ".join(parts) or "invalid request"


_OPENAI_TYPES = {401: "authentication_error", 404: "not_found_error", 503: "service_unavailable"}


def error_body(path: str, status: int, detail: str) -> dict[str, object]:
    """``{"detail": ...}``, and on ``/v1/*`` also OpenAI's ``{"error": {...}}``."""
    body: dict[str, object] = {"detail": detail}
    if path.startswith("/v1/"):  # the openai client reads error.message
        kind = _OPENAI_TYPES.get(
            status, "invalid_request_error" if status < 500 else "server_error"
        )
        body["error"] = {"message": detail, "type": kind, "code": status}
    return body
