"""The handlers that turn every failure into a JSON error answer (``rollout_server.errors``):
the service's own errors, validation errors, the engine's, and anything unexpected (a 500)."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from rollout_server.engine.base import EngineError, UnsupportedError, WeightsError
from rollout_server.errors import ServiceError, error_body, format_validation_errors

log = logging.getLogger(__name__)


def _json(
    request: Request, status: int, detail: str, headers: dict[str, str] | None = None
) -> JSONResponse:
    # a detail echoing a client's lone surrogate (a name, a key) could not be sent as UTF-8
    detail = detail.encode("utf-8", "backslashreplace").decode("utf-8")
    return JSONResponse(
        error_body(request.url.path, status, detail), status_code=status, headers=headers
    )


def _body_problem(exc: StarletteHTTPException) -> str:
    """FastAPI answers a JSON body it cannot decode with a bare 400 "There was an error
    parsing the body"; its cause says what is wrong (bytes that are not UTF-8)."""
    cause = exc.__cause__
    if exc.status_code == 400 and isinstance(cause, UnicodeDecodeError):
        bad = cause.object[cause.start : cause.start + 1].hex()
        return (
            f"the body is not valid UTF-8 (byte 0x{bad} at byte {cause.start}: {cause.reason}); "
            "send JSON encoded as UTF-8"
        )
    return str(exc.detail)


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
        return _json(request, exc.status_code, _body_problem(exc), getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return _json(request, 500, f"internal server error: {type(exc).__name__}: {exc}")
