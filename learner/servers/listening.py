"""Whether anything listens at the rollout servers' addresses, said plainly while the learner
waits for them to be ready.

Waiting ``rollout.ready_timeout_s`` for a server that is still loading its model is right; but
a server that is not running at all refuses every connection at once, and the readiness poll's
own note (``ConnectError: All connection attempts failed``) does not say so. ``ListenWatch``
tries a plain TCP connection to each address every second while the learner waits: the first
refusal is a warning that nothing listens there yet, repeated every ``every_s`` while it lasts,
and a server that starts listening is an info line.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from urllib.parse import urlsplit

logger = logging.getLogger(__name__)

NOTE_EVERY_S = 30.0  # while nothing listens, the warning again every this many seconds
PROBE_EVERY_S = 1.0
CONNECT_TIMEOUT_S = 5.0


def address(url: str) -> tuple[str, int]:
    """The host and port a server URL connects to (the scheme's port where it names none)."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return parts.hostname or "", port


async def refuses(url: str) -> bool:
    """Whether ``url``'s host refuses a TCP connection to its port now (nothing listens there).
    Anything else (accepted, timed out, no route, a name that does not resolve) is not that."""
    host, port = address(url)
    try:
        _, writer = await asyncio.wait_for(
            asyncio.open_connection(host, port), timeout=CONNECT_TIMEOUT_S
        )
    except ConnectionRefusedError:
        return True
    except (OSError, TimeoutError):
        return False
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return False


class ListenWatch:
    """Run ``watch()`` as a task while waiting for ``servers()`` to be ready; ``refused`` then
    holds the addresses that refused at the last probe, with the time of their first refusal."""

    def __init__(
        self,
        servers: Callable[[], Sequence[str]],
        timeout_s: float,
        *,
        every_s: float = NOTE_EVERY_S,
        probe_s: float = PROBE_EVERY_S,
    ) -> None:
        self.servers, self.timeout_s = servers, timeout_s
        self.every_s, self.probe_s = every_s, probe_s
        self.refused: dict[str, float] = {}  # url -> monotonic time of its first refusal
        self._noted: dict[str, float] = {}  # url -> when it was last said

    async def watch(self) -> None:
        start = time.monotonic()
        while True:
            urls = list(self.servers())
            results = await asyncio.gather(*(refuses(u) for u in urls))
            now = time.monotonic()
            for url, refused in zip(urls, results, strict=True):
                self._note(url, refused, now, now - start)
            await asyncio.sleep(self.probe_s)

    def _note(self, url: str, refused: bool, now: float, waited: float) -> None:
        host, port = address(url)
        if not refused:
            if self.refused.pop(url, None) is not None:
                logger.info("%s: something listens at %s:%d now; waiting for it to be ready",
                            url, host, port)  # fmt: skip
            return
        self.refused.setdefault(url, now)
        last = self._noted.get(url)
        if last is None:
            logger.warning(
                "%s: nothing listens at %s:%d yet (connection refused); waiting up to "
                "rollout.ready_timeout_s = %g s for a rollout server to start there. If none is "
                "starting, start one (rollout-server --port %d ...) or fix the URL in "
                "rollout.servers",
                url, host, port, self.timeout_s, port,
            )  # fmt: skip
        elif now - last >= self.every_s:
            logger.warning(
                "%s: still nothing listens at %s:%d (connection refused) after %.0f s of "
                "rollout.ready_timeout_s = %g s",
                url, host, port, waited, self.timeout_s,
            )  # fmt: skip
        else:
            return
        self._noted[url] = now

    def nothing_listens(self, url: str) -> str | None:
        """For a server that was never ready: that nothing listens at its address, if so."""
        since = self.refused.get(url)
        if since is None:
            return None
        host, port = address(url)
        return (
            f"nothing listens at {host}:{port} (connection refused for the last "
            f"{time.monotonic() - since:.0f} s): start a rollout server there, or fix the URL"
        )
