"""Requests an attacker or a careless client could send: every count, size, version and
sampling value they name costs bounded memory and time, and is refused with a 4xx naming the
field before anything is applied; odd bodies get an answer that says what is wrong with them;
every route, the docs and refused bodies included, gets its own metrics label."""

from __future__ import annotations

import time

import httpx
import pytest
import torch
from safetensors.torch import load_file, save

from rollout_server.protocol import Limits
from rollout_server.settings import ServerSettings

INT64_MAX = 2**63 - 1


@pytest.fixture(scope="module")
def server(start_server, tiny_model_dir):
    settings = ServerSettings(model=str(tiny_model_dir), limits=Limits(max_body_mb=1))
    with start_server(settings) as s:
        yield s


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def weights(tiny_model_dir) -> dict[str, torch.Tensor]:
    return load_file(tiny_model_dir / "model.safetensors")


def _update(http: httpx.Client, tensors: dict[str, torch.Tensor], **params) -> httpx.Response:
    return http.post(
        "/weights/update",
        params=params,
        content=save(tensors),
        headers={"Content-Type": "application/octet-stream"},
    )


def _metrics(http: httpx.Client) -> dict[str, float]:
    return {
        line.split(" ")[0]: float(line.split(" ")[1])
        for line in http.get("/metrics").text.splitlines()
        if line and not line.startswith("#")
    }


# --- counts and sizes -----------------------------------------------------------------------


def test_huge_bucket_counts_and_indices_cost_nothing(http, weights):
    norm = {"model.norm.weight": weights["model.norm.weight"]}
    update_id = http.post("/weights/begin", json={}).json()["update_id"]
    blob = save(norm)
    headers = {"Content-Type": "application/octet-stream"}
    r = http.post(
        "/weights/bucket", params={"update_id": update_id, "index": 10**30}, content=blob,
        headers=headers,
    )  # fmt: skip
    assert r.status_code == 422 and "index" in r.json()["detail"], r.text
    r = http.post(
        "/weights/bucket", params={"update_id": update_id, "index": 0}, content=blob,
        headers=headers,
    )  # fmt: skip
    assert r.status_code == 200, r.text

    start = time.perf_counter()
    r = http.post("/weights/commit", json={"update_id": update_id, "num_buckets": 6227020800})
    assert r.status_code == 422, r.text
    assert "num_buckets" in r.json()["detail"]
    # the largest count allowed is answered at once too: what is missing is listed, briefly
    limit = int(r.json()["detail"].rsplit(" ", 1)[-1].replace(",", ""))
    r = http.post("/weights/commit", json={"update_id": update_id, "num_buckets": limit})
    assert r.status_code == 409, r.text
    assert "missing buckets [1, 2, 3, 4, 5, 6, 7, 8, 9, 10 ...]" in r.json()["detail"]
    assert time.perf_counter() - start < 5
    # the update is still open and commits once the count is right
    r = http.post("/weights/commit", json={"update_id": update_id, "num_buckets": 1})
    assert r.status_code == 200, r.text


# --- versions -------------------------------------------------------------------------------


@pytest.mark.parametrize("version", [10**400, 2**63, -1])
def test_out_of_range_versions_are_refused_before_anything_is_applied(http, weights, version):
    before = http.get("/info").json()["weight_version"]
    checksum = http.get("/weights/checksum").json()["checksum"]
    changed = {"model.norm.weight": weights["model.norm.weight"] * 2}

    r = _update(http, changed, version=str(version))
    assert r.status_code == 422, r.text
    detail = r.json()["detail"]
    assert "query.version" in detail, detail
    assert f"less than or equal to {INT64_MAX}" in detail or "greater than or equal to 0" in detail
    for route, body in (
        ("/weights/begin", {"version": version}),
        ("/weights/load_file", {"path": "/nonexistent", "version": version}),
    ):
        r = http.post(route, json=body)
        assert r.status_code == 422 and "version" in r.json()["detail"], (route, r.text)

    assert http.get("/info").json()["weight_version"] == before
    assert http.get("/weights/checksum").json()["checksum"] == checksum
    assert _metrics(http)["rollout_weight_version"] == before
    # later updates are fine
    r = _update(http, {"model.norm.weight": weights["model.norm.weight"]})
    assert r.status_code == 200 and r.json()["weight_version"] == before + 1, r.text


def test_the_largest_version_is_served_and_then_nothing_overflows(
    start_server, tiny_model_dir, weights
):
    norm = {"model.norm.weight": weights["model.norm.weight"]}
    with (
        start_server(ServerSettings(model=str(tiny_model_dir))) as s,
        httpx.Client(base_url=s.url, timeout=60) as http,
    ):
        r = _update(http, norm, version=str(INT64_MAX))
        assert r.status_code == 200 and r.json()["weight_version"] == INT64_MAX, r.text
        assert _metrics(http)["rollout_weight_version"] == float(INT64_MAX)
        r = _update(http, norm)  # current + 1 would leave int64
        assert r.status_code == 409 and str(INT64_MAX) in r.json()["detail"], r.text
        assert http.get("/info").json()["weight_version"] == INT64_MAX
        assert http.post("/generate", json={"prompts": ["hi"], "max_tokens": 2}).status_code == 200


# --- sampling -------------------------------------------------------------------------------

DEGENERATE = [
    # (field, a degenerate value, the documented floor or ceiling, served)
    ("top_p", 1e-300, 1e-6),
    ("top_p", 1e-7, 1e-6),
    ("repetition_penalty", 1e-40, 0.01),
    ("repetition_penalty", 0.001, 0.01),
    ("temperature", 1e-30, 0.01),
    ("temperature", 0.001, 0.01),
    ("top_k", 10**30, 2**31 - 1),
]


@pytest.mark.parametrize("logprobs", [True, False])
@pytest.mark.parametrize(("field", "value", "bound"), DEGENERATE)
def test_degenerate_sampling_values_are_refused_naming_the_field(
    http, field, value, bound, logprobs
):
    body = {"prompts": ["hi"], "max_tokens": 4, "logprobs": logprobs, "seed": 0, field: value}
    r = http.post("/generate", json=body)
    assert r.status_code == 422, r.text
    assert f"body.{field}" in r.json()["detail"], r.text
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, field: value}
    r = http.post("/v1/chat/completions", json=chat)
    assert r.status_code == 422 and field in r.json()["detail"], r.text
    # the bound itself is served, with finite log-probs
    r = http.post("/generate", json=body | {field: bound})
    assert r.status_code == 200, r.text
    assert all(lp <= 0 for lp in r.json()["results"][0]["samples"][0]["logprobs"])


@pytest.mark.parametrize("literal", [b"NaN", b"Infinity", b"-Infinity"])
def test_non_finite_sampling_literals_are_refused_as_such(http, literal):
    r = http.post(
        "/generate",
        content=b'{"prompts": ["hi"], "max_tokens": 2, "temperature": ' + literal + b"}",
        headers={"Content-Type": "application/json"},
    )
    assert r.status_code == 422, r.text
    assert "body.temperature: Input should be a finite number" in r.json()["detail"], r.text


def test_finite_weights_that_overflow_are_refused_without_blaming_nan_weights(http, weights):
    """Finite but absurd weights (3e38) overflow the forward pass: the weight probe refuses
    them (the previous weights serve on), and the answer must not say they hold NaN/inf."""
    huge = {"model.norm.weight": torch.full_like(weights["model.norm.weight"], 3e38)}
    r = _update(http, huge)
    assert r.status_code == 400, r.text
    detail = r.json()["detail"]
    assert "hold NaN/inf" not in detail and "hold no NaN or inf" in detail, detail
    r = http.post("/generate", json={"prompts": ["hi"], "max_tokens": 2, "top_p": 0.9})
    assert r.status_code == 200, r.text


# --- bodies, metrics labels, sleep ----------------------------------------------------------


def test_invalid_utf8_and_lone_surrogates_say_what_is_wrong(http):
    headers = {"Content-Type": "application/json"}
    r = http.post("/generate", content=b'{"prompts": ["\xff\xfe"]}', headers=headers)
    assert r.status_code in (400, 422), r.text
    assert "UTF-8" in r.json()["detail"] and "byte 14" in r.json()["detail"], r.text
    for body in (
        b'{"prompts": ["a\\ud800b"]}',
        b'{"prompts": [[{"role": "user", "content": "\\udfff"}]]}',
        b'{"prompts": ["hi"], "stop": ["\\ud83d"]}',
    ):
        r = http.post("/generate", content=body, headers=headers)
        assert r.status_code in (400, 422), r.text
        detail = r.json()["detail"]
        assert "surrogate" in detail and "TypeError" not in detail, detail
    r = http.post(
        "/v1/completions", content=b'{"prompt": "\\ud800", "max_tokens": 2}', headers=headers
    )
    assert r.status_code in (400, 422) and "surrogate" in r.json()["detail"], r.text
    # a surrogate pair is a real character
    r = http.post("/generate", content=b'{"prompts": ["\\ud83d\\ude00"], "max_tokens": 2}',
                  headers=headers)  # fmt: skip
    assert r.status_code == 200, r.text


def test_docs_openapi_and_refused_bodies_have_route_labels(http):
    assert http.get("/docs").status_code == 200
    assert http.get("/openapi.json").status_code == 200
    big = b"\0" * (2 << 20)
    r = http.post(
        "/weights/update", content=big, headers={"Content-Type": "application/octet-stream"}
    )
    assert r.status_code == 413
    values = _metrics(http)
    assert values['rollout_http_requests_total{method="GET",route="/docs",status="200"}'] >= 1
    key = 'rollout_http_requests_total{method="GET",route="/openapi.json",status="200"}'
    assert values[key] >= 1
    key = 'rollout_http_requests_total{method="POST",route="/weights/update",status="413"}'
    assert values[key] >= 1
    http.get("/nope")
    assert 'route="/nope"' not in http.get("/metrics").text  # still no raw paths


def test_made_up_methods_and_paths_fold_into_one_label_each(http):
    before = http.get("/metrics").text.count("rollout_http_requests_total{")
    for i in range(40):
        assert http.request(f"BREW{i}", "/health").status_code == 405
        assert http.get(f"/made-up-{i}").status_code == 404
        assert http.request(f"BREW{i}", f"/made-up-{i}").status_code == 404
    text = http.get("/metrics").text
    assert "BREW" not in text and "made-up" not in text
    assert 'method="other",route="/health",status="405"' in text
    assert 'method="other",route="unmatched",status="404"' in text
    # a handful of new series (and /metrics' own), not 120
    assert text.count("rollout_http_requests_total{") - before <= 4


def test_sleep_without_a_body_is_level_one_like_wake_up(http):
    r = http.post("/sleep")
    assert r.status_code == 200, r.text
    assert r.json() == {"is_sleeping": True, "level": 1}
    r = http.post("/wake_up")
    assert r.status_code == 200 and r.json() == {"is_sleeping": False, "level": 0}, r.text
    sleep = http.get("/openapi.json").json()["paths"]["/sleep"]["post"]
    assert not sleep.get("requestBody", {}).get("required", False)
    assert "level 1" in sleep["description"]
