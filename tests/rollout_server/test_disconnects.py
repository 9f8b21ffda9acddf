"""A client that goes away takes its generation with it, and SIGTERM stops a busy server within
its grace: neither leaves the engine decoding for nobody."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from grpo_common.net import free_port
from rollout_server.settings import ServerSettings
from tests.rollout_server.cli_process import wait_ready
from tests.server_metrics import metric

# Many rows of the longest completions the default limits allow: minutes of CPU decoding.
BIG = {"prompts": ["hello"] * 32, "n": 8, "max_tokens": 4096, "ignore_eos": True}
SMALL = {"prompts": ["hi"], "n": 1, "max_tokens": 2}


def _in_flight(url: str) -> float:
    return metric(httpx.get(f"{url}/metrics", timeout=10).text, "rollout_generate_in_flight")


def _disconnect_after(url: str, seconds: float) -> None:
    """Send BIG and hang up after ``seconds`` (a read timeout closes the connection)."""
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/generate", json=BIG, timeout=httpx.Timeout(10, read=seconds))


def test_a_disconnected_client_frees_the_server_for_the_next_request(start_server, tiny_model_dir):
    settings = ServerSettings(model=str(tiny_model_dir), max_num_seqs=16)
    with start_server(settings) as server:
        _disconnect_after(server.url, 1.0)
        start = time.monotonic()
        r = httpx.post(f"{server.url}/generate", json=SMALL, timeout=60)
        took = time.monotonic() - start
        assert r.status_code == 200
        assert took < 5, f"the next request waited {took:.1f} s behind an abandoned generation"
        assert _in_flight(server.url) == 0
        metrics = httpx.get(f"{server.url}/metrics").text
        assert 'rollout_http_requests_total{method="POST",route="/generate",status="499"} 1.0' in (
            metrics
        )


def test_sigterm_stops_a_busy_server_within_its_grace(tiny_model_dir):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "ROLLOUT_API_KEY": ""}
    proc = subprocess.Popen(
        [sys.executable, "-m", "rollout_server", "--model", str(tiny_model_dir), "--port",
         str(port), "--max-num-seqs", "16", "--shutdown-timeout", "2", "--log-level", "warning"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        with httpx.Client(base_url=url) as http:
            wait_ready(proc, http)
        answers: list[object] = []

        def busy() -> None:  # a client that stays connected, waiting for its answer
            try:
                answers.append(httpx.post(f"{url}/generate", json=BIG, timeout=120).status_code)
            except httpx.HTTPError as exc:
                answers.append(exc)

        client = threading.Thread(target=busy, daemon=True)
        client.start()
        while _in_flight(url) == 0:
            time.sleep(0.1)
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)
        took = time.monotonic() - start
        assert code in (0, -15)
        assert took < 2 + 8, f"SIGTERM took {took:.1f} s with a 2 s grace"
        client.join(timeout=10)
        assert answers and answers[0] != 200  # the abandoned generation was not completed
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
