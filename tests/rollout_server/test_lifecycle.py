"""The server is up before the model: /health at once, 503 with Retry-After until loaded, and a
model that fails to load is reported rather than hanging requests."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx

from rollout_server.engine.transformers_engine import TransformersEngine
from rollout_server.settings import ServerSettings


class _HeldStart(TransformersEngine):
    """The real engine, whose loading waits until the test lets it go."""

    def __init__(self, settings: ServerSettings) -> None:
        super().__init__(settings)
        self.release = threading.Event()

    async def start(self) -> None:
        await asyncio.to_thread(self.release.wait, 60)
        await super().start()


def test_requests_during_loading_get_503_then_succeed(start_server, tiny_model_dir):
    settings = ServerSettings(model=str(tiny_model_dir))
    engine = _HeldStart(settings)
    with (
        start_server(settings, engine, wait_ready=False) as server,
        httpx.Client(base_url=server.url, timeout=30) as http,
    ):
        assert http.get("/health").status_code == 200
        for method, path, body in [
            ("GET", "/ready", None),
            ("GET", "/info", None),
            ("POST", "/generate", {"prompts": ["hi"]}),
            ("POST", "/sleep", {"level": 1}),
        ]:
            r = http.request(method, path, json=body)
            assert r.status_code == 503 and r.headers["retry-after"] == "5"
            assert "still loading" in r.json()["detail"]
        engine.release.set()
        deadline = time.monotonic() + 60
        while http.get("/ready").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert http.post("/generate", json={"prompts": ["hi"], "max_tokens": 2}).status_code == 200


def test_a_model_that_fails_to_load_is_reported(start_server, tmp_path):
    settings = ServerSettings(model=str(tmp_path / "missing-model"))
    with (
        start_server(settings, wait_ready=False) as server,
        httpx.Client(base_url=server.url, timeout=30) as http,
    ):
        deadline = time.monotonic() + 60
        while server.core.state == "loading":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert http.get("/health").status_code == 200
        r = http.post("/generate", json={"prompts": ["hi"]})
        assert r.status_code == 503 and "not running" in r.json()["detail"]
        assert "missing-model" in http.get("/ready").json()["detail"]


def test_wait_ready_says_why_now_and_then_not_a_warning_per_poll(
    start_server, tiny_model_dir, caplog
):
    """A learner started with its server waits through the model's load: it says which server
    it waits for and why (the server's own 503), not one warning every half second."""
    from rollout_server.client import RolloutClient

    settings = ServerSettings(model=str(tiny_model_dir))
    engine = _HeldStart(settings)

    async def wait() -> float:
        async with RolloutClient(server.url, max_retries=0) as client:
            threading.Timer(1.5, engine.release.set).start()
            t0 = time.monotonic()
            await client.wait_ready(timeout_s=60, poll_s=0.05, note_every_s=0.5)
            return time.monotonic() - t0

    caplog.set_level("INFO", logger="rollout_server.client")
    with start_server(settings, engine, wait_ready=False) as server:
        waited = asyncio.run(wait())
    records = [r for r in caplog.records if r.name == "rollout_server.client"]
    assert waited >= 1.4
    assert not [r for r in records if r.levelname == "WARNING"]
    notes = [r.getMessage() for r in records if "waiting for 1 of 1" in r.getMessage()]
    assert 2 <= len(notes) <= 1 + waited / 0.5 + 1, notes  # at once, then every 0.5 s
    assert server.url in notes[0] and "still loading" in notes[0]
    assert "ready after" in records[-1].getMessage()


def test_wait_ready_on_nothing_names_the_server_and_the_last_error(caplog):
    from grpo_common.net import free_port
    from rollout_server.client import RolloutClient, RolloutUnavailableError

    url = f"http://127.0.0.1:{free_port()}"

    async def wait() -> None:
        async with RolloutClient(url, max_retries=3) as client:
            await client.wait_ready(timeout_s=0.6, poll_s=0.05, note_every_s=10)

    caplog.set_level("INFO", logger="rollout_server.client")
    try:
        asyncio.run(wait())
    except RolloutUnavailableError as e:
        msg = str(e)
    else:
        raise AssertionError("wait_ready returned with no server")
    assert url in msg and "not ready after 1 s" in msg and "failed to connect" in msg
    records = [r for r in caplog.records if r.name == "rollout_server.client"]
    assert len(records) == 1 and records[0].levelname == "INFO"  # one note, no warnings


def test_the_startup_heap_is_kept_out_of_the_garbage_collector_while_serving(
    start_server, tiny_model_dir
):
    """Once the engine is ready, what loading allocated is frozen out of the collector (full
    collections while serving walk only what serving allocates), and thawed at shutdown."""
    import gc

    assert gc.get_freeze_count() == 0
    with start_server(ServerSettings(model=str(tiny_model_dir))) as server:
        assert server.core.state == "ready"
        assert gc.get_freeze_count() > 10_000  # torch, transformers, the model's modules
        with httpx.Client(base_url=server.url, timeout=30) as http:
            r = http.post("/generate", json={"prompts": ["hi"], "max_tokens": 2})
            assert r.status_code == 200
    assert gc.get_freeze_count() == 0
    with start_server(ServerSettings(model=str(tiny_model_dir), gc_freeze=False)) as server:
        assert server.core.state == "ready" and gc.get_freeze_count() == 0
