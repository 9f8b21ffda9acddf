"""Sleep and wake: generation answers 503 (never hangs) while asleep; level 2 needs new weights."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from safetensors.torch import load_file, save

from rollout_server.client import RolloutClient, RolloutHTTPError
from rollout_server.protocol import GenerateRequest
from rollout_server.settings import ServerSettings

PROBE = GenerateRequest(prompts=["sleepy"], max_tokens=8, seed=0, ignore_eos=True)
PROBE_JSON = PROBE.model_dump(mode="json")


@pytest.fixture(scope="module")
def server(start_server, tiny_model_dir):
    with start_server(ServerSettings(model=str(tiny_model_dir))) as s:
        yield s


@pytest.fixture
async def client(server):
    async with RolloutClient(server.url, max_retries=0, timeout_s=60) as c:
        yield c


async def _probe(client) -> tuple[list[int], list[float]]:
    s = (await client.generate(PROBE)).results[0].samples[0]
    return s.token_ids, s.logprobs


async def test_sleep_waits_for_in_flight_generation_then_refuses_with_503(client, server):
    before = await _probe(client)
    long = GenerateRequest(prompts=["long"], n=8, max_tokens=200, seed=1, ignore_eos=True)
    in_flight = asyncio.create_task(client.generate(long))
    await asyncio.sleep(0.05)
    sleeping = asyncio.create_task(client.sleep(1))
    await asyncio.sleep(0.05)
    queued = asyncio.create_task(client.generate(PROBE))  # arrives while sleep waits
    resp = await in_flight  # finished, not cut off
    assert all(len(s.token_ids) == 200 for s in resp.results[0].samples)
    await sleeping
    with pytest.raises(RolloutHTTPError) as queued_err:
        await asyncio.wait_for(queued, timeout=30)
    assert queued_err.value.status == 503 and "asleep" in queued_err.value.detail

    async with httpx.AsyncClient(base_url=server.url) as http:
        r = await http.post("/generate", json={"prompts": ["x"]})
        assert r.status_code == 503 and r.headers["retry-after"]
        assert "POST /wake_up" in r.json()["detail"]
        assert (await http.get("/ready")).status_code == 503
        info = (await http.get("/info")).json()
        assert info["sleeping"] and info["sleep_level"] == 1
        r = await http.post("/weights/load_file", json={"path": "/x"})
        assert r.status_code == 409 and "asleep" in r.json()["detail"]
        chat = {"messages": [{"role": "user", "content": "hi"}]}
        assert (await http.post("/v1/chat/completions", json=chat)).status_code == 503
    assert [s.model_dump() for s in await client.is_sleeping()] == [
        {"is_sleeping": True, "level": 1}
    ]
    await client.wake_up()
    assert await _probe(client) == before  # level 1 kept the weights


async def test_waking_weights_first_allows_an_update_before_the_kv_cache(client, tiny_model_dir):
    before = await _probe(client)
    await client.sleep(1)
    await client.wake_up(["weights"])
    assert (await client.is_sleeping())[0].is_sleeping
    with pytest.raises(RolloutHTTPError) as err:
        await client.generate(PROBE)
    assert err.value.status == 503
    (resp,) = await client.load_weights_file(str(tiny_model_dir))  # allowed: weights awake
    await client.wake_up(["kv_cache"])
    assert not (await client.is_sleeping())[0].is_sleeping
    assert await _probe(client) == before
    assert (await client.info())[0].weight_version == resp.weight_version


async def test_level_2_discards_weights_until_they_are_synced(client, tiny_model_dir):
    before = await _probe(client)
    await client.sleep(2)
    assert (await client.is_sleeping())[0].level == 2
    await client.wake_up()
    with pytest.raises(RolloutHTTPError) as err:
        await client.generate(PROBE)
    assert err.value.status == 503 and "discarded by sleep level 2" in err.value.detail
    assert (await client.ready()) == [False]
    await client.load_weights_file(str(tiny_model_dir))
    assert (await client.ready()) == [True]
    assert await _probe(client) == before  # the synced weights are the original ones


async def test_after_level_2_a_partial_update_keeps_generation_refused(client, tiny_model_dir):
    """Level 2 zero-fills every parameter: an update of some of them must not make the server
    serve on the others' zeros. Generation waits until each tensor has been loaded again, over
    any transport and in any number of updates (the tied lm_head comes with the embedding)."""
    weights = load_file(tiny_model_dir / "model.safetensors")
    assert "lm_head.weight" not in weights  # tied: the checkpoint, like the learner, omits it
    before = await _probe(client)
    await client.sleep(2)
    await client.wake_up()
    async with httpx.AsyncClient(base_url=client.servers[0], timeout=60) as http:
        norm = {"model.norm.weight": weights["model.norm.weight"]}
        r = await http.post("/weights/update", content=save(norm))
        assert r.status_code == 200, r.text
        for path in ("/ready", "/generate"):
            r = await (http.get(path) if path == "/ready" else http.post(path, json=PROBE_JSON))
            assert r.status_code == 503, r.text
            detail = r.json()["detail"]
            total = len(weights)
            assert f"{total - 1} of {total} tensors have not been loaded since" in detail
            assert "'model.embed_tokens.weight'" in detail and "and " in detail
    rest = [(n, t) for n, t in weights.items() if n != "model.embed_tokens.weight"]
    await client.update_weights(rest, bucket_bytes=64 * 1024)  # all but one, in buckets
    with pytest.raises(RolloutHTTPError) as err:
        await client.generate(PROBE)
    assert err.value.status == 503
    assert "1 of" in err.value.detail and "('model.embed_tokens.weight')" in err.value.detail
    assert (await client.ready()) == [False]
    await client.update_weights(
        [("model.embed_tokens.weight", weights["model.embed_tokens.weight"])]
    )
    assert (await client.ready()) == [True]
    assert await _probe(client) == before


def test_every_parameter_must_come_back_after_level_2_tied_ones_once(tiny_model_dir):
    """What the service waits for after a level-2 sleep: on the transformers engine the
    parameters (tied ones under their first name); on vLLM the checkpoint names but tied
    aliases, which its loader skips."""
    from transformers import AutoModelForCausalLM

    from rollout_server.engine.transformers_engine import TransformersEngine
    from rollout_server.engine.vllm_engine import hf_weight_metadata

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    params = {n for n, _ in model.named_parameters()}
    assert "lm_head.weight" not in params and "model.embed_tokens.weight" in params

    engine = TransformersEngine(ServerSettings(model=str(tiny_model_dir)))
    engine._load()
    assert engine.required_weights() == params
    assert "lm_head.weight" in engine.weight_metadata()  # an update may still name it

    metadata = hf_weight_metadata(str(tiny_model_dir), "float32")
    assert metadata["lm_head.weight"].tied_to == "model.embed_tokens.weight"
    assert {n for n, m in metadata.items() if m.tied_to is None} == params
