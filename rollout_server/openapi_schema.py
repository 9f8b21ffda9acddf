"""The published ``/openapi.json`` describes the error bodies the server really sends.

FastAPI documents every 422 as its own ``HTTPValidationError`` (``detail`` a list of objects),
but ``rollout_server.error_handlers`` answers every error, 422 included, with one readable
sentence ``{"detail": "..."}``, and on ``/v1/*`` also OpenAI's ``{"error": {...}}``. A client
generated from the schema, and the fuzzer that checks answers against it (``make fuzz``), must
see the bodies that are sent.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

ERROR_REF = "#/components/schemas/ErrorResponse"
OPENAI_ERROR_REF = "#/components/schemas/OpenAIErrorResponse"

OPENAI_ERROR_SCHEMA: dict[str, Any] = {
    "title": "OpenAIErrorResponse",
    "type": "object",
    "description": "the error body of the /v1 routes: ours, and the one the openai client reads",
    "properties": {
        "detail": {"type": "string"},
        "error": {
            "type": "object",
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "code": {"type": "integer"},
            },
            "required": ["message", "type", "code"],
        },
    },
    "required": ["detail", "error"],
}
VALIDATION_DESCRIPTION = "a field is missing, unknown, of the wrong type or out of range"
# Answered by the middleware and FastAPI's body parsing, before the route, for any body.
BODY_ERRORS = {
    "400": {"description": "the body is not UTF-8 or not JSON"},
    "413": {"description": "body larger than max_body_mb"},
}


def describe_errors(schema: dict[str, Any]) -> dict[str, Any]:
    """Point every 4xx/5xx answer of ``schema`` at the error body the server sends (in place)."""
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    if "ErrorResponse" not in components:
        components["ErrorResponse"] = {
            "title": "ErrorResponse",
            "type": "object",
            "properties": {"detail": {"type": "string", "title": "Detail"}},
            "required": ["detail"],
        }
    components["OpenAIErrorResponse"] = OPENAI_ERROR_SCHEMA
    for path, operations in schema.get("paths", {}).items():
        ref = OPENAI_ERROR_REF if path.startswith("/v1/") else ERROR_REF
        for operation in operations.values():
            if "requestBody" in operation:
                for code, response in BODY_ERRORS.items():
                    operation["responses"].setdefault(code, dict(response))
            for code, response in operation.get("responses", {}).items():
                if code.isdigit() and int(code) >= 400:
                    response["content"] = {"application/json": {"schema": {"$ref": ref}}}
                    if code == "422":
                        response["description"] = VALIDATION_DESCRIPTION
    return schema


def install_openapi(app: FastAPI) -> None:
    """``app.openapi()`` returns the schema with the error bodies described."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = describe_errors(build())
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
