"""Cancel a generation whose client has gone.

ASGI servers do not cancel a plain (non-streaming) handler when its client disconnects: without
this a 256-prompt ``/generate`` whose caller gave up kept the engine busy for minutes and every
later request waited behind it. Once the request body has been read, a watcher waits on the
connection; a disconnect before the response is complete cancels the handler, which cancels
the engine's work (``Engine.generate`` stops on cancellation).

Only generation routes are watched: a weight update is never cut off half-applied because its
sender went away.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger(__name__)

GENERATION_PATHS = ("/generate", "/v1/completions", "/v1/chat/completions")
CLIENT_CLOSED_REQUEST = 499  # nginx's status for it: what the metrics count such a request as


class CancelOnDisconnectMiddleware:
    def __init__(self, app: ASGIApp, paths: Iterable[str] = GENERATION_PATHS) -> None:
        self.app = app
        self.paths = frozenset(paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in self.paths:
            await self.app(scope, receive, send)
            return
        body_read = asyncio.Event()
        closed = asyncio.Event()  # the connection ended: the client left or the response is sent
        gone = asyncio.Event()  # the client left before the response was complete
        response_done = False

        async def app_receive() -> Message:
            if body_read.is_set():  # later reads (a stream's disconnect listener) share the watch
                await closed.wait()
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_read.set()
            return message

        async def app_send(message: Message) -> None:
            nonlocal response_done
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                response_done = True
            await send(message)

        handler = asyncio.create_task(self.app(scope, app_receive, app_send))

        async def watch() -> None:
            await body_read.wait()
            message = await receive()  # blocks until the client leaves or the response is sent
            closed.set()
            if message["type"] == "http.disconnect" and not response_done:
                gone.set()
                handler.cancel()

        watcher = asyncio.create_task(watch())
        try:
            await handler
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if not gone.is_set() or (current is not None and current.cancelling()):
                raise
            log.info("%s: the client disconnected; its generation was cancelled", scope["path"])
            with contextlib.suppress(Exception):  # counted by the metrics, never delivered
                await send(
                    {"type": "http.response.start", "status": CLIENT_CLOSED_REQUEST, "headers": []}
                )
                await send({"type": "http.response.body", "body": b""})
        finally:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
