"""What the property-based fuzzer (``make fuzz``, tests/fuzz/run_fuzz.py) checks of every answer,
pinned for the answers it found undocumented: each error status is listed for its operation in
``/openapi.json`` and its body matches the schema listed there."""

from __future__ import annotations

from typing import Any

import httpx
import jsonschema
import pytest

from rollout_server.settings import ServerSettings


@pytest.fixture(scope="module")
def served(start_server, tiny_model_dir):
    with (
        start_server(ServerSettings(model=str(tiny_model_dir))) as server,
        httpx.Client(base_url=server.url, timeout=60) as http,
    ):
        yield http, http.get("/openapi.json").json()


def _assert_documented(schema: dict[str, Any], resp: httpx.Response) -> None:
    method, path = resp.request.method.lower(), resp.request.url.path
    responses = schema["paths"][path][method]["responses"]
    code = str(resp.status_code)
    assert code in responses, f"{method.upper()} {path}: {code} not in {sorted(responses)}"
    body_schema = responses[code]["content"]["application/json"]["schema"]
    jsonschema.validate(resp.json(), {**body_schema, "components": schema["components"]})


@pytest.mark.parametrize(
    ("method", "path", "kwargs", "status"),
    [
        ("post", "/weights/begin", {"json": []}, 422),  # FastAPI documents a list of objects
        ("post", "/weights/update", {"params": {"version": -1}}, 422),
        ("post", "/v1/completions", {"json": {}}, 422),  # the /v1 body adds OpenAI's "error"
        ("post", "/v1/completions", {"json": {"prompt": ""}}, 400),
        (
            "post",
            "/v1/chat/completions",
            {"json": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**6}},
            400,
        ),
        ("post", "/weights/bucket", {"params": {"update_id": "x", "index": 0}}, 404),
        ("post", "/weights/commit", {"json": {"update_id": "x", "num_buckets": 1}}, 404),
        (
            "post",
            "/sleep",
            {"content": b"\xf8", "headers": {"content-type": "application/json"}},
            400,
        ),
        (
            "post",
            "/wake_up",
            {"content": b"\xbf", "headers": {"content-type": "application/json"}},
            400,
        ),
    ],
)
def test_error_answers_are_documented(served, method, path, kwargs, status) -> None:
    http, schema = served
    resp = http.request(method, path, **kwargs)
    assert resp.status_code == status, resp.text
    _assert_documented(schema, resp)


def test_begin_links_its_update_id_to_bucket_commit_and_abort(served) -> None:
    """The stateful fuzzer follows these links to chain begin -> bucket -> commit/abort."""
    _, schema = served
    links = schema["paths"]["/weights/begin"]["post"]["responses"]["200"]["links"]
    assert set(links) == {"bucket", "commit", "abort"}
    for link in links.values():
        target = link["operationRef"].removeprefix("#/paths/").replace("~1", "/")
        assert target.rsplit("/", 1)[0] in schema["paths"]
