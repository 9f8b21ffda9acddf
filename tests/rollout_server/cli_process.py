"""A ``rollout-server`` CLI process in a test: wait until it serves."""

from __future__ import annotations

import subprocess
import time

import httpx


def wait_ready(
    proc: subprocess.Popen, http: httpx.Client, headers: dict[str, str] | None = None
) -> None:
    """Poll ``/ready`` until it answers 200; fail with the process's output if it exits, or
    after 90 s."""
    deadline = time.monotonic() + 90
    while True:
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else proc.returncode
        try:
            if http.get("/ready", headers=headers, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"the server at {http.base_url} never became ready"
        time.sleep(0.2)
