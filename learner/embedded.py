"""The embedded rollout server: started by the learner when no server is configured.

It is a real ``rollout-server`` subprocess on a free loopback port, spoken to over HTTP exactly
like a remote one. It must never outlive the learner: it is stopped at the end, on Ctrl-C and on
an exception (context manager), and on Linux the kernel sends it SIGTERM if the learner dies
abruptly (``PR_SET_PDEATHSIG``), so even a SIGKILLed learner leaves no orphan.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx


class EmbeddedServerError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:  # runs in the child between fork and exec
    os.setsid()
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@contextlib.contextmanager
def embedded_server(
    model: str,
    *,
    log_path: Path,
    engine: str = "transformers",
    dtype: str = "float32",
    startup_timeout_s: float = 120.0,
    extra_args: list[str] | None = None,
) -> Iterator[str]:
    """Start a rollout server on a free loopback port; yield its URL; always stop it."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [
        sys.executable,
        "-m",
        "rollout_server",
        "--model",
        model,
        "--engine",
        engine,
        "--dtype",
        dtype,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *(extra_args or []),
    ]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = log_path.open("ab")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("ROLLOUT_API_KEY", None)  # loopback only: the embedded server needs no key
    proc = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, env=env, preexec_fn=_die_with_parent
    )
    try:
        _wait_ready(proc, url, startup_timeout_s, log_path)
        yield url
    finally:
        _stop(proc)
        log.close()


def _wait_ready(proc: subprocess.Popen[bytes], url: str, timeout_s: float, log_path: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log_path.read_text(errors="replace")[-2000:]
            raise EmbeddedServerError(
                f"the embedded rollout server exited with code {proc.returncode}; "
                f"its log ({log_path}) ends with:\n{tail}"
            )
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/ready", timeout=2.0).status_code == 200:
                return
        time.sleep(0.25)
    raise EmbeddedServerError(
        f"the embedded rollout server was not ready after {timeout_s:.0f} s; see {log_path}"
    )


def _stop(proc: subprocess.Popen[bytes], grace_s: float = 10.0) -> None:
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
