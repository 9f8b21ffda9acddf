"""The HTTP calls under ``RolloutClient``: one pooled httpx client for every server, retries
with backoff for the calls that are safe to repeat, and every failure turned into an exception
that names the server, the call and the reason (the client's public errors are defined here).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel

logger = logging.getLogger("rollout_server.client")  # the client's one logger, retries included

M = TypeVar("M", bound=BaseModel)

RETRY_STATUSES = frozenset({502, 503, 504})


class RolloutError(Exception):
    """A rollout-server call failed. ``server`` says which one."""

    def __init__(self, server: str, message: str) -> None:
        super().__init__(f"rollout server {server}: {message}")
        self.server = server
        self.reason = message


class RolloutHTTPError(RolloutError):
    """The server answered with an error status; ``detail`` is its explanation."""

    def __init__(
        self, server: str, method: str, path: str, status: int, detail: str, hint: str = ""
    ) -> None:
        super().__init__(server, f"{method} {path} -> HTTP {status}: {detail}{hint}")
        self.status = status
        self.detail = detail


class RolloutAuthError(RolloutHTTPError):
    """The server refused the API key (401/403): retrying or waiting cannot help."""

    def __init__(self, server: str, method: str, path: str, status: int, detail: str) -> None:
        hint = (
            "; give the learner the server's API key (its --api-key): set rollout.api_key in "
            "the learner's config or the ROLLOUT_API_KEY environment variable"
        )
        super().__init__(server, method, path, status, detail, hint)


class RolloutUnavailableError(RolloutError):
    """The server could not be reached (or stayed unavailable) after the allowed retries."""


class WeightSyncError(RolloutError):
    """A weight update failed; the message says whether the old weights are still serving."""


class ServerCalls:
    """Calls to a fleet of servers over one connection pool."""

    def __init__(
        self,
        servers: list[str],
        *,
        api_key: str | None,
        timeout_s: float,
        connect_timeout_s: float,
        max_retries: int,
        backoff_s: float,
    ) -> None:
        self.servers = servers
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.AsyncClient(
            headers=headers,
            timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s),
            limits=httpx.Limits(max_connections=256, max_keepalive_connections=64),
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    async def call(
        self,
        server: str,
        method: str,
        path: str,
        *,
        body: BaseModel | dict[str, Any] | None = None,
        content: bytes | None = None,
        params: dict[str, Any] | None = None,
        retry: bool = True,
    ) -> httpx.Response:
        """One call, retried with backoff when ``retry``; each failed attempt that will be
        retried is a warning (a single probe's failure is the caller's to report)."""
        attempts = 1 + (self.max_retries if retry else 0)
        last: str = "no attempt made"
        for attempt in range(attempts):
            if attempt:
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                resp = await self._http.request(
                    method,
                    server + path,
                    json=body.model_dump(mode="json") if isinstance(body, BaseModel) else body,
                    content=content,
                    params=params,
                    headers={"Content-Type": "application/octet-stream"} if content else None,
                )
            except httpx.TimeoutException as e:
                last = f"{method} {path} timed out ({type(e).__name__})"
            except httpx.TransportError as e:
                last = f"{method} {path} failed to connect: {type(e).__name__}: {e}"
            else:
                if resp.status_code < 400:
                    return resp
                detail = _detail(resp)
                if resp.status_code in (401, 403):
                    raise RolloutAuthError(server, method, path, resp.status_code, detail)
                if resp.status_code not in RETRY_STATUSES or attempt == attempts - 1:
                    raise RolloutHTTPError(server, method, path, resp.status_code, detail)
                last = f"{method} {path} -> HTTP {resp.status_code}: {detail}"
            if attempt < attempts - 1:
                logger.warning(
                    "rollout server %s: %s (attempt %d/%d)", server, last, attempt + 1, attempts
                )
        raise RolloutUnavailableError(server, f"{last} (after {attempts} attempt(s))")

    async def json(self, server: str, method: str, path: str, model: type[M], **kw: Any) -> M:
        """``call``, its answer read as ``model``."""
        resp = await self.call(server, method, path, **kw)
        return model.model_validate(resp.json())

    async def all(self, coro_fn: Callable[[str], Coroutine[Any, Any, Any]]) -> list[Any]:
        """``coro_fn(server)`` for every server at once, answers in server order."""
        servers = self.servers  # a change of the rotation replaces the list: this one stays
        return list(await asyncio.gather(*(coro_fn(s) for s in servers)))


def _detail(resp: httpx.Response) -> str:
    try:
        data = resp.json()
    except ValueError:
        return resp.text[:500] or resp.reason_phrase
    if isinstance(data, dict) and "detail" in data:
        d = data["detail"]
        return d if isinstance(d, str) else str(d)[:1000]
    return str(data)[:500]
