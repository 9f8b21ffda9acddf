"""Weights that are finite but overflow the forward pass (a norm weight of 3e38) pass every
NaN/inf scan; the probe after the load catches them before any generation is served from them.
Over each transport the previous weights are restored and keep serving (400); where nothing
can be restored (an adapter loaded in place) the server says it is not ready until good weights
load, rather than answer 200 on /ready and 500 on every generation."""

from __future__ import annotations

import httpx
import pytest
import torch
from safetensors.torch import load_file, save, save_file

from rollout_server.settings import ServerSettings

GREEDY = {"prompts": [[5, 6, 7]], "max_tokens": 6, "temperature": 0, "ignore_eos": True}
BLOB = {"Content-Type": "application/octet-stream"}


@pytest.fixture(scope="module")
def weights(tiny_model_dir) -> dict[str, torch.Tensor]:
    return load_file(tiny_model_dir / "model.safetensors")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return tmp_path_factory.mktemp("probe-files")


@pytest.fixture(scope="module")
def server(start_server, tiny_model_dir, files):
    with start_server(ServerSettings(model=str(tiny_model_dir), weights_dir=str(files))) as s:
        yield s


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def _served(http: httpx.Client) -> tuple[int, list[int], list[float]]:
    r = http.post("/generate", json=GREEDY)
    assert r.status_code == 200, r.text
    sample = r.json()["results"][0]["samples"][0]
    return sample["weight_version"], sample["token_ids"], sample["logprobs"]


def _send(http: httpx.Client, how: str, tensors: dict[str, torch.Tensor], files) -> httpx.Response:
    if how == "update":
        return http.post("/weights/update", content=save(tensors), headers=BLOB)
    if how == "file":
        save_file(tensors, files / "overflow.safetensors")
        return http.post("/weights/load_file", json={"path": str(files / "overflow.safetensors")})
    update_id = http.post("/weights/begin", json={}).json()["update_id"]
    r = http.post(
        "/weights/bucket", params={"update_id": update_id, "index": 0},
        content=save(tensors), headers=BLOB,
    )  # fmt: skip
    assert r.status_code == 200, r.text
    return http.post("/weights/commit", json={"update_id": update_id, "num_buckets": 1})


@pytest.mark.parametrize("how", ["update", "file", "buckets"])
def test_overflowing_weights_are_refused_and_the_previous_ones_serve_on(http, weights, files, how):
    before = _served(http)
    checksum = http.get("/weights/checksum").json()
    overflow = {"model.norm.weight": torch.full_like(weights["model.norm.weight"], 3e38)}
    r = _send(http, how, overflow, files)
    assert r.status_code == 400, r.text
    detail = r.json()["detail"]
    assert "probe generation gives non-finite log-probs" in detail, detail
    assert f"previous weights (version {before[0]}) were restored" in detail, detail
    assert http.get("/ready").status_code == 200
    assert http.get("/weights/checksum").json() == checksum
    assert _served(http) == before  # the same tokens and log-probs, the same version
    # sane weights load as ever
    r = _send(http, how, {"model.norm.weight": weights["model.norm.weight"] * 1.5}, files)
    assert r.status_code == 200 and r.json()["weight_version"] == before[0] + 1, r.text


def test_weights_that_cannot_be_restored_leave_the_server_not_ready(http, weights):
    """An adapter is loaded in place (no copy of the previous one is kept): one whose delta
    overflows leaves /ready and generation at 503, saying why, until good weights load."""
    version = _served(http)[0]
    module = "model.layers.0.mlp.down_proj"
    out_features, in_features = weights[f"{module}.weight"].shape
    spec = {"r": 2, "lora_alpha": 2, "target_modules": [module]}
    adapter = {
        f"base_model.model.{module}.lora_A.weight": torch.full((2, in_features), 3e38),
        f"base_model.model.{module}.lora_B.weight": torch.full((out_features, 2), 3e38),
    }
    update_id = http.post("/weights/begin", json={"adapter": spec}).json()["update_id"]
    r = http.post(
        "/weights/bucket", params={"update_id": update_id, "index": 0},
        content=save(adapter), headers=BLOB,
    )  # fmt: skip
    assert r.status_code == 200, r.text
    r = http.post("/weights/commit", json={"update_id": update_id, "num_buckets": 1})
    assert r.status_code == 500, r.text
    assert "loaded but cannot generate" in r.json()["detail"], r.text
    assert f"the version stays {version}" in r.json()["detail"], r.text
    for answer in (http.get("/ready"), http.post("/generate", json=GREEDY)):
        assert answer.status_code == 503, answer.text
        assert "the served weights cannot generate" in answer.json()["detail"], answer.text
    # full weights that pass the probe make it ready again
    r = http.post("/weights/update", content=save(dict(weights)), headers=BLOB)
    assert r.status_code == 200 and r.json()["weight_version"] == version + 1, r.text
    assert http.get("/ready").status_code == 200
    assert _served(http)[0] == version + 1
