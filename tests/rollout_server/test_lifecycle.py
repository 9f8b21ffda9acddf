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
        while server.service.state == "loading":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert http.get("/health").status_code == 200
        r = http.post("/generate", json={"prompts": ["hi"]})
        assert r.status_code == 503 and "not running" in r.json()["detail"]
        assert "missing-model" in http.get("/ready").json()["detail"]
