"""Pure ASGI middlewares: the API key check, the body size limit and per-route request
metrics."""

from __future__ import annotations

import json
import re
import secrets
import time
from typing import Any

from fastapi import HTTPException
from starlette.routing import compile_path
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rollout_server.errors import error_body
from rollout_server.metrics import Metrics


class ApiKeyMiddleware:
    """Every HTTP request needs ``Authorization: Bearer <key>`` (docs and /health included);
    the scheme is case-insensitive (RFC 7235), the key is compared in constant time. A request
    with several ``Authorization`` headers is refused (400), whatever they hold."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given_all = [v for k, v in scope["headers"] if k == b"authorization"]
        if len(given_all) > 1:  # which one counts would be a guess: the client must say
            detail = (
                f"{len(given_all)} Authorization headers: send exactly one, "
                "Authorization: Bearer <key>"
            )
            await _send_json(scope, send, 400, detail)
            return
        given = given_all[0] if given_all else b""
        scheme, _, key = given.partition(b" ")
        if scheme.lower() == b"bearer" and secrets.compare_digest(key.lstrip(b" "), self._key):
            await self.app(scope, receive, send)
            return
        if not given:
            detail = "missing API key: send Authorization: Bearer <key>"
        elif scheme.lower() != b"bearer" or not key.strip():
            detail = "malformed Authorization header: expected Authorization: Bearer <key>"
        else:
            detail = "invalid API key"
        await _send_json(scope, send, 401, detail, [(b"www-authenticate", b"Bearer")])


UPLOAD_PATHS = frozenset({"/weights/update", "/weights/bucket"})
"""The routes whose body is weights (safetensors): ``max_body_mb`` applies to them, the small
``max_json_body_mb`` to every other route."""


class BodyLimitMiddleware:
    """413 for a body over its route's limit (``max_bytes`` for the weight uploads of
    ``UPLOAD_PATHS``, ``max_json_bytes`` for every other route): a declared one before any of
    it is read, one sent without a length (``Transfer-Encoding: chunked``) as soon as its bytes
    pass the limit.

    The streamed case raises ``HTTPException`` from ``receive``: the route reading the body
    (FastAPI's JSON parsing re-raises it, a weight route's stream too) answers the 413."""

    def __init__(self, app: ASGIApp, max_bytes: int, max_json_bytes: int | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.max_json_bytes = max_bytes if max_json_bytes is None else max_json_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if scope.get("path") in UPLOAD_PATHS:
            limit, flag = self.max_bytes, "max_body_mb"
        else:
            limit, flag = self.max_json_bytes, "max_json_body_mb"
        named = f"{flag}={limit // 2**20} (--{flag.replace('_', '-')})"
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > limit:
            detail = f"body of {int(declared)} bytes exceeds {named}"
            await _send_json(scope, send, 413, detail)
            return
        received = 0

        async def counted_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise HTTPException(413, f"body of more than {limit} bytes exceeds {named}")
            return message

        await self.app(scope, counted_receive, send)


async def _send_json(
    scope: Scope,
    send: Send,
    status: int,
    detail: str,
    headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    body = json.dumps(error_body(scope.get("path", ""), status, detail)).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *(headers or []),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"})


class MetricsMiddleware:
    """Counts requests and latency by route template and method; labels stay bounded: a path
    no route matches is ``route="unmatched"``, a method outside ``HTTP_METHODS`` (a client may
    send any token) ``method="other"``."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics
        self.templates = RouteTemplates()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500
        start = time.perf_counter()

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route = _route(scope, self.templates)
            method = scope["method"] if scope["method"] in HTTP_METHODS else "other"
            self.metrics.requests.labels(route, method, str(status)).inc()
            self.metrics.request_seconds.labels(route).observe(time.perf_counter() - start)


def _route(scope: dict[str, Any], templates: RouteTemplates) -> str:
    """The route template: FastAPI's for its API routes, else ``templates``' match."""
    route = scope.get("route")
    return getattr(route, "path", None) or templates.match(scope)


class RouteTemplates:
    """Route templates for the requests FastAPI does not label: its docs (``/docs``,
    ``/openapi.json``) and those answered before routing (a 413 from the body limit). Built
    once, from the app's top-level routes and its OpenAPI paths; a path none matches is
    "unmatched" (a raw path would make the metrics' labels unbounded)."""

    def __init__(self) -> None:
        self._compiled: list[tuple[re.Pattern[str], str]] | None = None

    def match(self, scope: dict[str, Any]) -> str:
        if self._compiled is None:
            self._compiled = self._build(scope.get("app"))
        path = scope.get("path", "")
        return next((t for regex, t in self._compiled if regex.match(path)), "unmatched")

    @staticmethod
    def _build(app: Any) -> list[tuple[re.Pattern[str], str]]:
        templates = [
            p for r in getattr(app, "routes", ()) if isinstance(p := getattr(r, "path", None), str)
        ]
        openapi = getattr(app, "openapi", None)
        if callable(openapi):
            templates += list(openapi().get("paths", {}))
        return [(compile_path(t)[0], t) for t in dict.fromkeys(templates)]
