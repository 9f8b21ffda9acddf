"""The API key, and the refusal to expose admin routes off loopback without one."""

from __future__ import annotations

import time

import httpx
import pytest
from pydantic import ValidationError

from rollout_server.app import build_app
from rollout_server.client import RolloutAuthError, RolloutClient, RolloutHTTPError
from rollout_server.protocol import GenerateRequest
from rollout_server.settings import ServerSettings, check_model_ref, is_loopback

KEY = "s3cret-key"


@pytest.fixture(scope="module")
def server(start_server, tiny_model_dir):
    with start_server(ServerSettings(model=str(tiny_model_dir), api_key=KEY)) as s:
        yield s


ROUTES = [
    ("GET", "/health"),
    ("GET", "/ready"),
    ("GET", "/info"),
    ("GET", "/metrics"),
    ("GET", "/docs"),
    ("GET", "/openapi.json"),
    ("GET", "/v1/models"),
    ("POST", "/generate"),
    ("POST", "/v1/completions"),
    ("POST", "/sleep"),
    ("POST", "/weights/update"),
    ("GET", "/no-such-route"),
]


@pytest.mark.parametrize(("method", "path"), ROUTES)
def test_every_route_needs_the_key(server, method, path):
    with httpx.Client(base_url=server.url) as http:
        missing = http.request(method, path)
        wrong = http.request(method, path, headers={"Authorization": "Bearer nope"})
        right = http.request(method, path, headers={"Authorization": f"Bearer {KEY}"})
        if path == "/sleep":  # no body is level 1: wake the server for the tests that follow
            http.post("/wake_up", headers={"Authorization": f"Bearer {KEY}"}).raise_for_status()
    assert missing.status_code == 401 and "missing API key" in missing.json()["detail"]
    assert missing.headers["www-authenticate"] == "Bearer"
    assert wrong.status_code == 401 and "invalid API key" in wrong.json()["detail"]
    assert right.status_code != 401
    if path.startswith("/v1/"):  # the openai client reads error.message
        assert missing.json()["error"]["message"] == missing.json()["detail"]
        assert missing.json()["error"]["type"] == "authentication_error"
    else:
        assert "error" not in missing.json()


async def test_the_client_with_and_without_the_key(server):
    request = GenerateRequest(prompts=["hi"], max_tokens=2)
    async with RolloutClient(server.url, api_key=KEY) as client:
        resp = await client.generate(request)
        assert len(resp.results[0].samples[0].token_ids) <= 2
    async with RolloutClient(server.url, max_retries=0) as client:
        with pytest.raises(RolloutHTTPError) as err:
            await client.generate(request)
    assert err.value.status == 401


@pytest.mark.parametrize("scheme", ["bearer", "BEARER", "bEaReR"])
def test_the_bearer_scheme_is_case_insensitive(server, scheme):
    with httpx.Client(base_url=server.url) as http:
        assert http.get("/ready", headers={"Authorization": f"{scheme} {KEY}"}).status_code == 200
        wrong = http.get("/ready", headers={"Authorization": f"{scheme} nope"})
    assert wrong.status_code == 401 and wrong.json()["detail"] == "invalid API key"


@pytest.mark.parametrize("header", [KEY, f"Basic {KEY}", f"Token {KEY}", "Bearer"])
def test_a_header_without_the_bearer_scheme_is_told_the_format(server, header):
    with httpx.Client(base_url=server.url) as http:
        r = http.get("/ready", headers={"Authorization": header})
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    detail = r.json()["detail"]
    assert detail == "malformed Authorization header: expected Authorization: Bearer <key>"


@pytest.mark.parametrize("order", [("nope", KEY), (KEY, "nope"), (KEY, KEY)])
def test_two_authorization_headers_are_refused_whatever_they_hold(server, order):
    headers = [("Authorization", f"Bearer {key}") for key in order]
    with httpx.Client(base_url=server.url) as http:
        r = http.get("/ready", headers=headers)
        assert r.status_code == 400, r.text
        assert r.json()["detail"] == (
            "2 Authorization headers: send exactly one, Authorization: Bearer <key>"
        )
        assert http.get("/ready", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


@pytest.mark.parametrize(
    ("key", "answer"), [(None, "missing API key"), ("nope", "invalid API key")]
)
async def test_wait_ready_fails_at_once_on_a_refused_key(server, key, answer):
    async with RolloutClient(server.url, api_key=key) as client:
        start = time.monotonic()
        with pytest.raises(RolloutAuthError) as err:
            await client.wait_ready(timeout_s=5, poll_s=0.05)
    assert time.monotonic() - start < 2  # not the 5 s of polling a server that is not ready
    message = str(err.value)
    assert f"GET /ready -> HTTP 401: {answer}" in message
    assert "rollout.api_key" in message and "ROLLOUT_API_KEY" in message
    assert err.value.status == 401


async def test_wait_ready_fails_at_once_on_a_403():
    """A proxy in front of the server may answer 403: the key is as wrong as for a 401."""
    client = RolloutClient("http://rollout.test")
    await client.aclose()
    forbidden = httpx.Response(403, json={"detail": "forbidden by the gateway"})
    client._calls._http = httpx.AsyncClient(transport=httpx.MockTransport(lambda _: forbidden))
    async with client:
        with pytest.raises(RolloutAuthError, match="HTTP 403: forbidden by the gateway; give"):
            await client.wait_ready(timeout_s=5, poll_s=0.05)


def test_the_key_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("ROLLOUT_API_KEY", "from-env")
    assert ServerSettings(model="m").api_key == "from-env"
    monkeypatch.delenv("ROLLOUT_API_KEY")
    assert ServerSettings(model="m").api_key is None


@pytest.mark.parametrize(
    ("host", "loopback"),
    [("127.0.0.1", True), ("127.8.9.1", True), ("::1", True), ("localhost", True),
     ("0.0.0.0", False), ("10.1.2.3", False), ("::", False), ("rollout.example", False)],
)  # fmt: skip
def test_is_loopback(host, loopback):
    assert is_loopback(host) is loopback


def test_admin_routes_need_a_key_off_loopback(monkeypatch):
    monkeypatch.delenv("ROLLOUT_API_KEY", raising=False)
    with pytest.raises(ValidationError, match="--api-key") as err:
        ServerSettings(model="m", host="0.0.0.0")
    assert "--disable-admin-endpoints" in str(err.value)
    assert ServerSettings(model="m", host="0.0.0.0", api_key="k").api_key == "k"
    settings = ServerSettings(model="m", host="0.0.0.0", disable_admin_endpoints=True)
    paths = set(build_app(settings).openapi()["paths"])
    assert "/generate" in paths and "/v1/chat/completions" in paths
    assert not any(p.startswith(("/weights", "/sleep", "/wake_up")) for p in paths)


def test_info_lists_no_weight_transports_without_the_admin_routes(start_server, tiny_model_dir):
    settings = ServerSettings(model=str(tiny_model_dir), disable_admin_endpoints=True)
    with start_server(settings) as s, httpx.Client(base_url=s.url) as http:
        assert http.get("/info").json()["weight_transports"] == []
        assert http.post("/weights/update", content=b"").status_code == 404


def test_a_model_written_as_a_missing_path_is_refused_by_name(tmp_path):
    for ref in (str(tmp_path / "nope"), "./nope", "~/nope-model", "a/b/c"):
        with pytest.raises(ValueError, match="no such model directory"):
            check_model_ref(ref)
    check_model_ref("Qwen/Qwen3-0.6B")  # a hub id
    check_model_ref(str(tmp_path))
