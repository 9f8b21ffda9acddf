"""HTTP errors of the serving layer and the handlers that turn every failure into JSON.

Every error body is ``{"detail": "<one readable sentence>"}`` with a real status code: 4xx for
the caller's mistakes (naming the field and the limit), 503 while loading or asleep (with
``Retry-After``), 501 for what the engine cannot do, 500 only for faults of the server.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from rollout_server.engine.base import EngineError, UnsupportedError, WeightsError

log = logging.getLogger(__name__)


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


def _json(
    request: Request, status: int, detail: str, headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(
        error_body(request.url.path, status, detail), status_code=status, headers=headers
    )


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ServiceError)
    async def _service(request: Request, exc: ServiceError) -> JSONResponse:
        return _json(request, exc.status_code, exc.detail, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _request_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _json(request, 422, format_validation_errors(list(exc.errors())))

    @app.exception_handler(ValidationError)
    async def _validation(request: Request, exc: ValidationError) -> JSONResponse:
        return _json(request, 422, format_validation_errors(list(exc.errors())))

    @app.exception_handler(WeightsError)
    async def _weights(request: Request, exc: WeightsError) -> JSONResponse:
        return _json(
            request, 400, f"weight update refused, the previous weights keep serving: {exc}"
        )

    @app.exception_handler(UnsupportedError)
    async def _unsupported(request: Request, exc: UnsupportedError) -> JSONResponse:
        return _json(request, 501, str(exc))

    @app.exception_handler(EngineError)
    async def _engine(request: Request, exc: EngineError) -> JSONResponse:
        log.error("engine error: %s", exc)
        return _json(request, 500, f"engine error: {exc}")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _json(request, exc.status_code, str(exc.detail), getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return _json(request, 500, f"internal server error: {type(exc).__name__}: {exc}")
