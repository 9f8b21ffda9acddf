"""Weight updates over HTTP (one blob, streamed buckets) and from files: atomic, versioned,
refused whole when anything is wrong, and never mixed into a generation."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import torch
from safetensors.torch import load_file, save, save_file

from rollout_server.client import RolloutClient, WeightSyncError
from rollout_server.protocol import GenerateRequest, Limits
from rollout_server.settings import ServerSettings
from rollout_server.tiny import save_tiny_model

# Seeded sampling, not greedy: tiny random models with tied embeddings greedily repeat the last
# prompt token whatever their weights, which would hide a failed update.
PROBE = GenerateRequest(prompts=["probe"], max_tokens=12, seed=0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_b(tmp_path_factory):
    """The same architecture with other random weights."""
    return save_tiny_model(tmp_path_factory.mktemp("tiny-b"), seed=1)


@pytest.fixture(scope="module")
def states(tiny_model_dir, model_b):
    return {
        "A": load_file(tiny_model_dir / "model.safetensors"),
        "B": load_file(model_b / "model.safetensors"),
    }


@pytest.fixture(scope="module")
def models(tiny_model_dir, model_b):
    from transformers import AutoModelForCausalLM

    def load(path):
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    return {"A": load(tiny_model_dir), "B": load(model_b)}


def _weights_of(models, prompt: list[int], tokens: list[int], logprobs: list[float]) -> str:
    """Which reference model ("A"/"B") reproduces these log-probs within 1e-4 (fp32 forward
    over prompt + completion); fails unless exactly one does."""
    matching = []
    for name, model in models.items():
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
        want = logits.double().log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None])
        if torch.allclose(torch.tensor(logprobs, dtype=torch.float64), want.squeeze(-1), atol=1e-4):
            matching.append(name)
    assert len(matching) == 1, f"log-probs match the weights of {matching or 'no model'}"
    return matching[0]


@pytest.fixture(scope="module")
def server(start_server, tiny_model_dir, tmp_path_factory):
    settings = ServerSettings(
        model=str(tiny_model_dir),
        limits=Limits(max_body_mb=1, max_json_body_mb=1),
        weights_dir=str(tmp_path_factory.getbasetemp()),  # the files of the bad-update cases
    )
    with start_server(settings) as s:
        yield s


@pytest.fixture
async def client(server):
    async with RolloutClient(server.url, max_retries=0) as c:
        yield c


async def _probe(client, models) -> tuple[str, int, list[int]]:
    """(which weights produced the probe, its version, its tokens)."""
    resp = await client.generate(PROBE)
    result = resp.results[0]
    s = result.samples[0]
    return (
        _weights_of(models, result.prompt_token_ids, s.token_ids, s.logprobs),
        s.weight_version,
        s.token_ids,
    )


async def _version(client) -> int:
    return (await client.info())[0].weight_version


async def test_updates_change_outputs_and_bump_the_version(
    client, states, models, tiny_model_dir, model_b
):
    await client.load_weights_file(str(tiny_model_dir))  # start from A, whatever ran before
    weights, v0, tokens_a = await _probe(client, models)
    assert weights == "A"

    # streamed buckets (small buckets: several per update)
    (resp,) = await client.update_weights(states["B"].items(), bucket_bytes=64 * 1024)
    assert resp.weight_version == v0 + 1 and resp.num_tensors == len(states["B"])
    weights, version, tokens_b = await _probe(client, models)
    assert (weights, version) == ("B", v0 + 1) and tokens_b != tokens_a

    # one safetensors blob
    async with httpx.AsyncClient(base_url=client.servers[0]) as http:
        r = await http.post("/weights/update", content=save(states["A"]))
    assert r.status_code == 200 and r.json()["weight_version"] == v0 + 2
    assert await _probe(client, models) == ("A", v0 + 2, tokens_a)

    # a file with an explicit version, then a directory
    (resp,) = await client.load_weights_file(str(model_b / "model.safetensors"), version=v0 + 10)
    assert resp.weight_version == v0 + 10
    assert await _probe(client, models) == ("B", v0 + 10, tokens_b)
    await client.load_weights_file(str(tiny_model_dir))
    assert await _probe(client, models) == ("A", v0 + 11, tokens_a)


def _chunked(data: bytes, chunk: int = 256 * 1024):
    """A body sent with ``Transfer-Encoding: chunked`` (no Content-Length)."""

    async def chunks():
        for start in range(0, len(data), chunk):
            yield data[start : start + chunk]

    return chunks()


def _bad_cases(states, tmp):
    """(name, method, path, kwargs, status, words) for requests that must be refused whole."""
    b = states["B"]
    nan = dict(b) | {"model.norm.weight": torch.full((64,), float("nan"))}
    inf = dict(b) | {"model.layers.1.mlp.up_proj.weight": torch.full((128, 64), float("inf"))}
    save_file(inf, tmp / "inf.safetensors")
    big_json = json.dumps({"prompts": ["x" * 3 * 2**20]}).encode()
    wrong_shape = dict(b) | {"model.embed_tokens.weight": torch.zeros(265, 32)}
    wrong_dtype = dict(b) | {"model.norm.weight": b["model.norm.weight"].to(torch.bfloat16)}
    unknown = dict(b) | {"model.layers.9.mlp.up_proj.weight": torch.zeros(128, 64)}
    save_file(wrong_shape, tmp / "wrong_shape.safetensors")
    (tmp / "truncated.safetensors").write_bytes(save(b)[:-100])
    (tmp / "empty_dir").mkdir(exist_ok=True)
    blob = "/weights/update"
    return [
        ("unknown name", blob, {"content": save(unknown)}, 400, ["unknown tensor", "layers.9"]),
        ("wrong shape", blob, {"content": save(wrong_shape)}, 400, ["shape [265, 32]", "[265, 64]"]),
        ("wrong dtype", blob, {"content": save(wrong_dtype)}, 400, ["dtype bfloat16", "float32"]),
        ("truncated", blob, {"content": save(b)[:-100]}, 400, ["not a valid safetensors"]),
        ("garbage", blob, {"content": b"\x00" * 64}, 400, ["not a valid safetensors"]),
        ("empty body", blob, {"content": b""}, 400, ["empty"]),
        ("too large", blob, {"content": b"\x00" * (2 * 2**20)}, 413, ["max_body_mb=1"]),
        ("too large JSON", "/generate", {"json": {"prompts": ["x" * 2**21]}}, 413, ["max_json_body_mb=1"]),
        ("too large chunked JSON", "/generate", {"content": _chunked(big_json), "headers": {"Content-Type": "application/json"}}, 413, ["max_json_body_mb=1"]),
        ("too large chunked", blob, {"content": _chunked(b"\x00" * (2 * 2**20))}, 413, ["max_body_mb=1"]),
        ("too large chunked OpenAI", "/v1/completions", {"content": _chunked(big_json)}, 413, ["max_json_body_mb=1"]),
        ("NaN tensor", blob, {"content": save(nan)}, 400, ["'model.norm.weight' holds 64 non-finite values (NaN or inf)"]),
        ("inf in a file", "/weights/load_file", {"json": {"path": str(tmp / "inf.safetensors")}}, 400, ["'model.layers.1.mlp.up_proj.weight' holds 8192 non-finite"]),
        ("stale version", blob + "?version=0", {"content": save(b)}, 409, ["version=0"]),
        ("missing file", "/weights/load_file", {"json": {"path": str(tmp / "nope")}}, 400, ["no such file"]),
        ("no files in dir", "/weights/load_file", {"json": {"path": str(tmp / "empty_dir")}}, 400, ["no .safetensors"]),
        ("truncated file", "/weights/load_file", {"json": {"path": str(tmp / "truncated.safetensors")}}, 400, ["cannot read"]),
        ("wrong-shape file", "/weights/load_file", {"json": {"path": str(tmp / "wrong_shape.safetensors")}}, 400, ["shape"]),
        ("unknown update id", "/weights/bucket?update_id=x&index=0", {"content": save(b)}, 404, ["no open weight update"]),
        ("commit unknown id", "/weights/commit", {"json": {"update_id": "x", "num_buckets": 1}}, 404, ["no open"]),
    ]  # fmt: skip


BAD_NAMES = [
    "unknown name", "wrong shape", "wrong dtype", "truncated", "garbage", "empty body",
    "too large", "too large JSON", "too large chunked JSON", "too large chunked",
    "too large chunked OpenAI", "NaN tensor", "inf in a file", "stale version", "missing file", "no files in dir", "truncated file",
    "wrong-shape file", "unknown update id", "commit unknown id",
]  # fmt: skip


@pytest.mark.parametrize("case", BAD_NAMES)
async def test_bad_updates_leave_outputs_and_version_unchanged(
    client, states, models, tmp_path, case
):
    (_, path, kwargs, status, words) = next(c for c in _bad_cases(states, tmp_path) if c[0] == case)
    before = await _probe(client, models)
    async with httpx.AsyncClient(base_url=client.servers[0], timeout=60) as http:
        refused = await _refused(http)
        r = await http.post(path, **kwargs)
        assert r.status_code == status, r.text
        for word in words:
            assert word in r.json()["detail"], r.json()["detail"]
        # every refusal by a weight route is counted (not a body over the size limit)
        counted = path.startswith("/weights/") and status != 413
        assert await _refused(http) == refused + counted
    assert await _probe(client, models) == before


async def _refused(http: httpx.AsyncClient) -> float:
    """rollout_weight_updates_total{result="refused"}, summed over the transports."""
    text = (await http.get("/metrics")).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("rollout_weight_updates_total{") and 'result="refused"' in line
    )


async def test_a_bucket_update_with_a_gap_or_a_bad_bucket_is_refused(client, states, models):
    before = await _probe(client, models)
    names = sorted(states["B"])
    async with httpx.AsyncClient(base_url=client.servers[0], timeout=60) as http:
        uid = (await http.post("/weights/begin", json={})).json()["update_id"]
        first = {n: states["B"][n] for n in names[:3]}
        r = await http.post(f"/weights/bucket?update_id={uid}&index=1", content=save(first))
        assert r.status_code == 200
        bad = {names[3]: torch.zeros(1)}
        r = await http.post(f"/weights/bucket?update_id={uid}&index=0", content=save(bad))
        assert r.status_code == 400 and "shape [1]" in r.json()["detail"]
        r = await http.post("/weights/commit", json={"update_id": uid, "num_buckets": 2})
        assert r.status_code == 409 and "missing buckets [0]" in r.json()["detail"]
        assert (await http.post("/weights/abort", json={"update_id": uid})).status_code == 200
    # through the client: a bad tensor aborts the whole update on the server
    broken = [*states["B"].items(), ("lm_head.weight", torch.zeros(3))]
    with pytest.raises(WeightSyncError, match="old weights still serve"):
        await client.update_weights(broken, bucket_bytes=64 * 1024)
    assert await _probe(client, models) == before


async def test_nccl_routes_answer_501_on_the_transformers_engine(client):
    version = await _version(client)
    announce = {
        "tensors": [{"name": "model.norm.weight", "dtype": "float32", "shape": [64]}],
        "buckets": [[0]],
        "bucket_dtypes": ["float32"],
    }
    init = {"master_address": "127.0.0.1", "master_port": 29500, "world_size": 2}
    async with httpx.AsyncClient(base_url=client.servers[0], timeout=60) as http:
        for path, body in (("/weights/nccl/init", init), ("/weights/nccl/update", announce)):
            r = await http.post(path, json=body)
            assert r.status_code == 501 and "NCCL" in r.json()["detail"]
    assert await _version(client) == version


async def test_ipc_route_validates_then_answers_501_on_the_transformers_engine(client):
    """A well-formed CUDA IPC announce reaches the engine, which refuses it by name (only the
    vllm engine maps IPC buffers); a malformed one is a 400 that names the bucket; neither
    moves the version."""
    version = await _version(client)
    handle = {
        "dtype": "float32",
        "numel": 64,
        "handle": "AAAA",
        "storage_bytes": 256,
        "ref_counter_handle": "AAAA",
    }
    announce = {
        "tensors": [{"name": "model.norm.weight", "dtype": "float32", "shape": [64]}],
        "buckets": [[0]],
        "bucket_dtypes": ["float32"],
        "handles": [handle],
        "gpu_uuid": "GPU-0",
    }
    async with httpx.AsyncClient(base_url=client.servers[0], timeout=60) as http:
        r = await http.post("/weights/ipc/update", json=announce)
        assert r.status_code == 501 and "CUDA IPC" in r.json()["detail"], r.text
        short = {**announce, "handles": [{**handle, "numel": 63}]}
        r = await http.post("/weights/ipc/update", json=short)
        assert r.status_code == 400, r.text
        assert "handle 0 is 63 x float32; bucket 0 needs 64 x float32" in r.json()["detail"]
        r = await http.post("/weights/ipc/update", json={**announce, "handles": []})
        assert r.status_code == 400 and "0 IPC handles for 1 buckets" in r.json()["detail"]
    assert await _version(client) == version


async def test_32_concurrent_generates_race_a_weight_update(client, states, models, tiny_model_dir):
    await client.load_weights_file(str(tiny_model_dir))
    v_start = await _version(client)
    race = GenerateRequest(prompts=["race"], n=2, max_tokens=24, seed=5, ignore_eos=True)

    async def update_then_more():
        await asyncio.sleep(0.02)
        (resp,) = await client.update_weights(states["B"].items(), bucket_bytes=128 * 1024)
        after = await asyncio.gather(*(client.generate(race) for _ in range(16)))
        return resp.weight_version, after

    async def staggered(i: int):  # some start before the update, some while it waits or loads
        await asyncio.sleep(0.004 * i)
        return await client.generate(race)

    before = [asyncio.create_task(staggered(i)) for i in range(16)]
    new_version, after = await update_then_more()
    responses = [*await asyncio.gather(*before), *after]
    assert len(responses) == 32 and new_version == v_start + 1
    for i, resp in enumerate(responses):
        result = resp.results[0]
        assert {s.weight_version for s in result.samples} == {resp.weight_version}
        want = {v_start: "A", new_version: "B"}[resp.weight_version]
        for s in result.samples:  # every token of every sample from the weights of its version
            assert _weights_of(models, result.prompt_token_ids, s.token_ids, s.logprobs) == want
        if i >= 16:
            assert resp.weight_version == new_version  # sent after the update returned


async def test_the_checksum_route_tells_which_weights_serve(client, states, models):
    """``GET /weights/checksum`` equals the learner-side ``params_checksum`` of the model whose
    weights serve (an HF model, not the server's own copy), before and after an update."""
    from rollout_server.weight_digest import params_checksum

    want = {name: params_checksum(m) for name, m in models.items()}
    assert want["A"] != pytest.approx(want["B"], rel=1e-6)
    for name in ("A", "B", "A"):
        (resp,) = await client.update_weights(states[name].items(), bucket_bytes=64 * 1024)
        (got,) = await client.weights_checksum()
        assert got.weight_version == resp.weight_version
        assert got.checksum == pytest.approx(want[name], rel=1e-9), name


async def test_chunked_bodies_under_the_limit_are_served(client, states, models):
    """A body without a Content-Length is counted as it streams, not refused."""
    body = json.dumps({"prompts": ["chunked"], "max_tokens": 2}).encode()
    async with httpx.AsyncClient(base_url=client.servers[0], timeout=60) as http:
        json_type = {"Content-Type": "application/json"}
        r = await http.post("/generate", content=_chunked(body, chunk=8), headers=json_type)
        assert r.status_code == 200, r.text
        version = await _version(client)
        r = await http.post("/weights/update", content=_chunked(save(states["A"])))
        assert r.status_code == 200 and r.json()["weight_version"] == version + 1, r.text
    assert (await _probe(client, models))[0] == "A"


async def test_weights_holding_nan_answer_500_not_null_log_probs(
    client, server, states, models, tiny_model_dir
):
    """NaN weights can still arrive where nothing scans them (NCCL, CUDA IPC): generation then
    answers a 500 that says so rather than log-probs of null, which break ``list[float]``; the
    checksum answers the same instead of null. Loading finite weights heals the server."""
    await client.load_weights_file(str(tiny_model_dir))
    version = await _version(client)
    norm = server.core.engine.model.get_parameter("model.norm.weight")
    norm.data.fill_(float("nan"))  # the server is idle: as if an NCCL update had carried it
    try:
        async with httpx.AsyncClient(base_url=client.servers[0], timeout=60) as http:
            r = await http.post("/generate", json={"prompts": ["nan"], "max_tokens": 3})
            assert r.status_code == 500, r.text
            detail = r.json()["detail"]
            assert f"served weights (version {version}) produce non-finite log-probs" in detail
            r = await http.post("/v1/completions", json={"prompt": "nan", "logprobs": 0})
            assert r.status_code == 500 and "non-finite log-probs" in r.json()["error"]["message"]
            r = await http.get("/weights/checksum")
            assert r.status_code == 500, r.text
            assert "hold non-finite values (NaN or inf)" in r.json()["detail"]
    finally:
        await client.load_weights_file(str(tiny_model_dir))
    assert (await _probe(client, models))[0] == "A"
    (checksum,) = await client.weights_checksum()
    assert checksum.weight_version == version + 1
