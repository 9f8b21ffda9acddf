"""Pure ASGI middlewares: the API key check and per-route request metrics."""

from __future__ import annotations

import json
import secrets
import time
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rollout_server.errors import error_body
from rollout_server.metrics import Metrics


class ApiKeyMiddleware:
    """Every HTTP request needs ``Authorization: Bearer <key>`` (docs and /health included)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"authorization", b"")
        if secrets.compare_digest(given, self._expected):
            await self.app(scope, receive, send)
            return
        detail = "invalid API key" if given else "missing API key: send Authorization: Bearer <key>"
        await _send_json(scope, send, 401, detail, [(b"www-authenticate", b"Bearer")])


class BodyLimitMiddleware:
    """413 for a declared body over ``max_bytes`` before any of it is read (weight routes also
    count the bytes of bodies sent without a length)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            declared = dict(scope["headers"]).get(b"content-length", b"")
            if declared.isdigit() and int(declared) > self.max_bytes:
                mb = self.max_bytes // 2**20
                detail = f"body of {int(declared)} bytes exceeds max_body_mb={mb}"
                await _send_json(scope, send, 413, detail)
                return
        await self.app(scope, receive, send)


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


class MetricsMiddleware:
    """Counts requests and latency by route template (never by raw path: bounded labels)."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

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
            route = _route(scope)
            self.metrics.requests.labels(route, scope["method"], str(status)).inc()
            self.metrics.request_seconds.labels(route).observe(time.perf_counter() - start)


def _route(scope: dict[str, Any]) -> str:
    route = scope.get("route")
    return getattr(route, "path", None) or "unmatched"
