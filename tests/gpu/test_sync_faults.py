"""Kills that land inside an NCCL or CUDA IPC weight sync (bench/gpu_sender.py as the learner's
side, a vLLM rollout server of its own per test, killed or not).

A weight load waits for the generations in flight (``rollout_server.gate``): long generations of
the test's own, started one after another so that one is always running, hold the sync inside
the server; a generation that queues behind it (``rollout_generate_waiting``) shows that it
arrived. Then one side is SIGKILLed:

- the sender (the learner): once the held generations end, the server refuses the update from
  a dead peer or loads all of it (its /info version and its weights' checksum stay a pair), stays
  ready, and the next sender syncs;
- the server: the sender ends within its timeout with an error, not a hang.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

SENDER = Path(__file__).resolve().parents[2] / "bench" / "gpu_sender.py"
HOLD = {"prompts": [[7] * 16], "max_tokens": 1900, "ignore_eos": True}


@pytest.fixture(params=["nccl", "ipc"])
def transport(request, vllm_ready) -> str:
    from gpu_common import gpu_count

    if request.param == "nccl" and gpu_count() < 2:
        pytest.skip("NCCL weight sync needs two GPUs")
    return request.param


def _server(model_dir: Path, transport: str, log_dir: Path, name: str):
    from gpu_common import ServerProcess

    return ServerProcess(
        model_dir,
        gpu="1" if transport == "nccl" else "0",
        gpu_memory_utilization=0.3,  # ipc: the sender shares the GPU
        extra_args=["--no-enable-prefix-caching"],
        log_path=log_dir / f"test_sync_faults.{name}.{transport}.server.log",
    ).start()


def _sender(server, model_dir: Path, transport: str, log_dir: Path, *extra: str):
    from gpu_common import gpu_env

    from grpo_common.net import free_port

    port = ["--master-port", str(free_port())] if transport == "nccl" else []  # NCCL's rendezvous
    argv = [sys.executable, str(SENDER), "--transport", transport, "--url", server.url,
            "--model", str(model_dir), *port, "--timeout-s", "20", "--bucket-mb", "64",
            *extra]  # fmt: skip
    log = (log_dir / f"test_sync_faults.{transport}.sender.log").open("a")
    log.write(f"$ {' '.join(argv)}\n")
    log.flush()
    return subprocess.Popen(argv, env=gpu_env("0"), stdout=subprocess.PIPE, stderr=log, text=True)


def _answer(proc: subprocess.Popen, timeout_s: float) -> dict:
    out, _ = proc.communicate(timeout=timeout_s)
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    return json.loads(lines[-1]) if lines else {"rc": proc.returncode}


def _gauge(server, name: str) -> float:
    from tests.server_metrics import metric

    return metric(server.get("/metrics").text, name)


def _sync_held_in_the_server(server, start_sender, timeout_s: float = 300) -> subprocess.Popen:
    """Start a long generation, and only once it runs the sender (``start_sender()``; an IPC
    update that arrived first would load at once, before anything held it); then keep a long
    generation in flight (a new one every 2 s) until one queues behind the sender's weight
    load. Returns the sender."""

    def hold() -> None:
        with contextlib.suppress(Exception):  # the server may be killed under it
            server.post("/generate", HOLD)

    deadline = time.monotonic() + timeout_s
    threading.Thread(target=hold, daemon=True).start()
    while _gauge(server, "rollout_generate_in_flight") < 1:
        assert time.monotonic() < deadline, "the holding generation never started"
        time.sleep(0.1)
    sender = start_sender()
    while _gauge(server, "rollout_generate_waiting") < 1:
        assert sender.poll() is None, "the sender ended before its sync waited in the server"
        assert time.monotonic() < deadline, "the sync never reached the server"
        threading.Thread(target=hold, daemon=True).start()
        time.sleep(2.0)
    return sender


def _settled(server) -> tuple[int, float]:
    """The served version and checksum once no generation is in flight (one read, a pair)."""
    deadline = time.monotonic() + 120
    while _gauge(server, "rollout_generate_in_flight") != 0:
        assert time.monotonic() < deadline, "the held generations never ended"
        time.sleep(0.5)
    got = server.get("/weights/checksum").json()
    assert got["weight_version"] == server.info()["weight_version"]
    return got["weight_version"], got["checksum"]


def test_a_sender_killed_while_its_sync_waits_leaves_the_server_whole(
    qwen3_dir, log_dir, transport
) -> None:
    server = _server(qwen3_dir, transport, log_dir, "sender-killed")
    try:
        version, checksum = _settled(server)
        sender = _sync_held_in_the_server(
            server, lambda: _sender(server, qwen3_dir, transport, log_dir, "--perturb-seed", "11")
        )
        sender.kill()
        sender.wait()
        after, served = _settled(server)
        # all of the update or none of it: a refused one leaves the old weights exactly
        assert after in (version, version + 1)
        if after == version:
            assert served == pytest.approx(checksum, rel=1e-9)
        assert server.get("/ready").status_code == 200
        out = _answer(_sender(server, qwen3_dir, transport, log_dir), 300)  # the next learner
        assert "responses" in out, out
        assert out["responses"][0]["weight_version"] == after + 1
        served = server.get("/weights/checksum").json()["checksum"]
        assert served == pytest.approx(out["reference_checksum"], rel=1e-9)
    finally:
        server.stop()


def test_a_server_killed_while_a_sync_waits_in_it_ends_the_sender_in_bounded_time(
    qwen3_dir, log_dir, transport
) -> None:
    import os
    import signal

    server = _server(qwen3_dir, transport, log_dir, "server-killed")
    try:
        _settled(server)
        sender = _sync_held_in_the_server(
            server, lambda: _sender(server, qwen3_dir, transport, log_dir, "--perturb-seed", "12")
        )
        os.killpg(os.getpgid(server.proc.pid), signal.SIGKILL)  # vLLM's workers with it
        t0 = time.monotonic()
        out = _answer(sender, 120)  # --timeout-s 20: the group's, and the HTTP call fails
        assert time.monotonic() - t0 < 90
        assert "responses" not in out and (out.get("error") or out.get("rc")), out
    finally:
        server.stop()
