"""Shared test helpers: a tiny random-weight model, and a real uvicorn rollout server on a free
loopback port in a background thread.

    def test_x(start_server, tiny_model_dir):
        with start_server(ServerSettings(model=str(tiny_model_dir))) as server:
            httpx.get(f"{server.url}/health")
"""

from __future__ import annotations

import contextlib
import inspect
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

# Under pytest-xdist the workers share the cores: each takes its share of OpenMP threads (torch's
# intra-op pool, and the subprocesses a test starts), not all of them, as threads spinning on a
# core another worker needs slow both down. Set before any test module imports torch.
if _workers := os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    os.environ.setdefault(
        "OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // int(_workers)))
    )


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The GPU machine has no pytest-asyncio: a gpu-marked test must be a plain function."""
    bad = [
        item.nodeid
        for item in items
        if item.get_closest_marker("gpu") is not None
        and inspect.iscoroutinefunction(getattr(item, "obj", None))
    ]
    if bad:
        raise pytest.UsageError(
            "gpu-marked tests must not be `async def` (the GPU machine has no pytest-asyncio); "
            "run the coroutine with asyncio.run in a plain test function instead: " + ", ".join(bad)
        )


@dataclass
class RunningServer:
    url: str  # http://127.0.0.1:<port>
    app: Any  # the FastAPI app (app.state.core is the ServerCore its services share)
    settings: Any  # ServerSettings

    @property
    def core(self) -> Any:
        return self.app.state.core


@contextlib.contextmanager
def run_server(
    settings: Any, engine: Any = None, *, ready_timeout_s: float = 120.0, wait_ready: bool = True
) -> Iterator[RunningServer]:
    """Serve ``build_app(settings, engine)`` with uvicorn on 127.0.0.1 (an OS-chosen port) until
    the block exits; waits for the engine to load unless ``wait_ready`` is False."""
    import uvicorn

    from rollout_server.app import build_app

    app = build_app(settings, engine)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + ready_timeout_s
        core = app.state.core
        while not server.started or (wait_ready and core.state == "loading"):
            if not thread.is_alive():
                raise RuntimeError("the uvicorn server thread exited during startup")
            if time.monotonic() > deadline:
                raise TimeoutError(f"server not ready after {ready_timeout_s}s")
            time.sleep(0.02)
        if wait_ready and core.state != "ready":
            raise RuntimeError(f"engine failed to start: {core.load_error}")
        yield RunningServer(f"http://127.0.0.1:{port}", app, settings)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


@pytest.fixture(scope="session")
def start_server() -> Callable[..., contextlib.AbstractContextManager[RunningServer]]:
    """``with start_server(settings, engine=None) as server:`` a real server on loopback."""
    return run_server


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight Qwen3 (hidden 64, 2 layers, byte-level tokenizer), built once."""
    from rollout_server.tiny import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"), seed=0)


def pids_mentioning(text: str) -> list[int]:
    """PIDs (not this one) whose command line mentions ``text``: tests use it to prove that no
    subprocess (an embedded rollout server, a benchmark's server) outlived its owner."""
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in cmd:
                pids.append(int(d.name))
    return pids


@pytest.fixture
def proc_scan() -> Callable[[str], list[int]]:
    """``pids_mentioning`` as a fixture (test modules cannot import from conftest by name)."""
    return pids_mentioning
