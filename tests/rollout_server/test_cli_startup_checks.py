"""What ``rollout-server`` checks before it loads a model (which takes minutes with vLLM): the
port it is to listen on, and that the engine it is to run is installed. Each answer is one line
on stderr, exit code 2, no traceback."""

from __future__ import annotations

import importlib.util
import socket
import subprocess
import sys
import time

import pytest

from rollout_server.cli import cannot_listen


def _serve(*args: str) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "rollout_server", *args, "--log-level", "info"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    return proc, time.monotonic() - t0


def test_a_port_in_use_is_one_line_before_the_model_loads(tiny_model_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc, seconds = _serve("--model", str(tiny_model_dir), "--port", str(port))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip() == (
        f"rollout-server: error: --port {port}: 127.0.0.1:{port} is already in use; "
        "choose another with --port"
    )
    assert "Application startup" not in proc.stderr + proc.stdout  # no model, no app
    assert seconds < 30


def test_a_free_port_and_one_in_time_wait_pass():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert cannot_listen("127.0.0.1", port) is None
    # a connection closed by its server leaves the port in TIME_WAIT: uvicorn binds it anyway
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", port))
        server.listen()
        client = socket.create_connection(("127.0.0.1", port))
        conn, _ = server.accept()
        conn.close()  # the server side closes first: its side of the port waits
        client.close()
    assert cannot_listen("127.0.0.1", port) is None


def test_a_host_that_does_not_resolve_is_named():
    assert cannot_listen("no-such-host.invalid", 8000).startswith("--host no-such-host.invalid:")


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed")
def test_engine_vllm_without_vllm_is_one_line(tiny_model_dir):
    proc, seconds = _serve("--model", str(tiny_model_dir), "--engine", "vllm", "--port", "1")
    assert proc.returncode == 2, proc.stderr[-2000:]
    line = proc.stderr.strip()
    assert "\n" not in line and "Traceback" not in line
    assert line.startswith("rollout-server: error: --engine vllm: vLLM is not installed")
    assert 'pip install -e ".[vllm]"' in line and "--engine transformers" in line
    assert seconds < 30
