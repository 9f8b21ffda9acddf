"""LoRA adapters synced as adapters: the server serves the learner's adapter (PEFT on the
transformers engine) on its base weights, exactly the policy of the learner's merged model;
each update is a new adapter version switched atomically; a bad adapter is refused whole while
the previous one serves on; sleep/wake keep it; a full update serves the base alone again."""

from __future__ import annotations

import httpx
import pytest
import torch
from safetensors.torch import save, save_file

from learner.sync.tensors import adapter_spec, adapter_tensors, merged_lora_weights
from rollout_server.client import RolloutClient
from rollout_server.protocol import GenerateRequest, WeightUpdateBegin
from rollout_server.settings import ServerSettings
from rollout_server.weight_digest import named_checksum

# Seeded sampling, not greedy alone: a tiny random model greedily repeats the last prompt
# token whatever its weights; the log-probs of sampled tokens tell the weights apart.
PROBE = GenerateRequest(prompts=["probe", "lora"], max_tokens=10, seed=0, ignore_eos=True)
GREEDY = GenerateRequest(prompts=["probe"], max_tokens=10, temperature=0.0, ignore_eos=True)


def _peft_model(model_dir, seed: int, r: int = 4):
    """The learner's policy: the tiny model with random (non-zero) LoRA adapters."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(r=r, lora_alpha=2 * r, target_modules="all-linear", init_lora_weights=False)
    return get_peft_model(base, config).eval()


def _merged(model_dir, peft_model):
    """A plain model holding the learner's merged weights (what ``final`` saves)."""
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    merged.load_state_dict(dict(merged_lora_weights(peft_model)), strict=False)
    return merged


def _logprobs_of(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    return logits.double().log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)


async def _served_by(client: RolloutClient, model) -> bool:
    """Whether every probe sample's log-probs are ``model``'s (fp32 forward, within 1e-4)."""
    response = await client.generate(PROBE)
    for result in response.results:
        for sample in result.samples:
            want = _logprobs_of(model, result.prompt_token_ids, sample.token_ids)
            got = torch.tensor(sample.logprobs, dtype=torch.float64)
            if not torch.allclose(got, want, atol=1e-4):
                return False
    return True


@pytest.fixture
def server(start_server, tiny_model_dir, tmp_path):
    settings = ServerSettings(model=str(tiny_model_dir), weights_dir=str(tmp_path))
    with start_server(settings) as s:
        yield s


@pytest.fixture
async def client(server):
    async with RolloutClient(server.url, max_retries=0) as c:
        yield c


async def _checksum(client: RolloutClient) -> float:
    (answer,) = await client.weights_checksum()
    return answer.checksum


async def test_an_adapter_update_serves_the_learners_merged_policy(client, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    policy = _peft_model(tiny_model_dir, seed=1)
    merged = _merged(tiny_model_dir, policy)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    assert await _served_by(client, base)
    (info,) = await client.info()
    assert info.lora_rank is None

    (answer,) = await client.update_weights(adapter_tensors(policy), adapter=adapter_spec(policy))
    assert answer.weight_version == 1
    full_bytes = sum(t.numel() * t.element_size() for t in base.state_dict().values())
    assert answer.num_bytes < full_bytes / 5  # the adapter alone travelled
    (info,) = await client.info()
    assert info.lora_rank == 4
    assert await _served_by(client, merged) and not await _served_by(client, base)
    greedy = (await client.generate(GREEDY)).results[0].samples[0].token_ids
    prompt = (await client.generate(GREEDY)).results[0].prompt_token_ids
    with torch.no_grad():
        want = merged.generate(
            torch.tensor([prompt]), max_new_tokens=10, do_sample=False, min_new_tokens=10
        )[0, len(prompt) :].tolist()
    assert greedy == want
    # the checksum is of the effective weights: the learner's merged model's
    assert await _checksum(client) == pytest.approx(
        named_checksum(merged_lora_weights(policy)), rel=1e-9
    )


async def test_a_second_adapter_version_switches_at_once(client, tiny_model_dir, tmp_path):
    first, second = _peft_model(tiny_model_dir, seed=1), _peft_model(tiny_model_dir, seed=2)
    await client.update_weights(adapter_tensors(first), adapter=adapter_spec(first))
    (answer,) = await client.update_weights(
        adapter_tensors(second), adapter=adapter_spec(second), bucket_bytes=4096
    )
    assert answer.weight_version == 2  # moved once, for all of its buckets
    assert await _served_by(client, _merged(tiny_model_dir, second))
    assert not await _served_by(client, _merged(tiny_model_dir, first))
    # over a file, too
    third = _peft_model(tiny_model_dir, seed=3, r=8)
    path = tmp_path / "adapter.safetensors"
    save_file({n: t.contiguous() for n, t in adapter_tensors(third)}, str(path))
    (answer,) = await client.load_weights_file(str(path), adapter=adapter_spec(third))
    assert answer.weight_version == 3
    (info,) = await client.info()
    assert info.lora_rank == 8
    assert await _served_by(client, _merged(tiny_model_dir, third))


async def test_a_generation_in_flight_is_served_by_one_adapter_version(
    client, server, tiny_model_dir
):
    """Generations racing an adapter switch each come from one whole version, the one they
    report: never a mix of the two adapters."""
    import asyncio

    first, second = _peft_model(tiny_model_dir, seed=1), _peft_model(tiny_model_dir, seed=2)
    merged = {1: _merged(tiny_model_dir, first), 2: _merged(tiny_model_dir, second)}
    await client.update_weights(adapter_tensors(first), adapter=adapter_spec(first))
    request = GenerateRequest(prompts=["race"] * 4, max_tokens=48, seed=0, ignore_eos=True)
    racing = [asyncio.create_task(client.generate(request)) for _ in range(3)]
    for _ in range(500):  # until one is decoding (the server runs in its own thread)
        if server.core.gate.readers:
            break
        await asyncio.sleep(0.01)
    (answer,) = await client.update_weights(adapter_tensors(second), adapter=adapter_spec(second))
    assert answer.weight_version == 2
    versions = set()
    for response in await asyncio.gather(*racing):
        versions.add(response.weight_version)
        model = merged[response.weight_version]
        for result in response.results:
            for sample in result.samples:
                want = _logprobs_of(model, result.prompt_token_ids, sample.token_ids)
                got = torch.tensor(sample.logprobs, dtype=torch.float64)
                assert torch.allclose(got, want, atol=1e-4)
    assert 1 in versions  # the request in flight finished on the old adapter


@pytest.mark.parametrize("fault", ["shape", "module", "missing"])
async def test_a_bad_adapter_is_refused_and_the_previous_one_serves_on(
    client, server, tiny_model_dir, fault
):
    good = _peft_model(tiny_model_dir, seed=1)
    await client.update_weights(adapter_tensors(good), adapter=adapter_spec(good))
    before = await _checksum(client)
    bad = dict(adapter_tensors(_peft_model(tiny_model_dir, seed=2)))
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    if fault == "shape":
        bad[name] = torch.zeros(3, bad[name].shape[1])
    elif fault == "module":
        name = "base_model.model.model.layers.0.self_attn.q_norm.lora_A.weight"
        bad[name] = torch.zeros(4, 16)
    else:
        del bad[name]
    spec = adapter_spec(good)
    async with httpx.AsyncClient(base_url=server.url) as http:
        begin = WeightUpdateBegin(adapter=spec).model_dump(mode="json")
        update_id = (await http.post("/weights/begin", json=begin)).json()["update_id"]
        answer = await http.post(
            "/weights/bucket", params={"update_id": update_id, "index": 0}, content=save(bad)
        )
        if answer.status_code == 200:  # a missing tensor shows at commit
            answer = await http.post(
                "/weights/commit", json={"update_id": update_id, "num_buckets": 1}
            )
    assert answer.status_code == 400, answer.text
    assert name in answer.json()["detail"]
    (info,) = await client.info()
    assert info.weight_version == 1 and info.lora_rank == 4
    assert await _checksum(client) == before
    assert await _served_by(client, _merged(tiny_model_dir, good))


async def test_sleep_and_wake_keep_the_adapter(client, tiny_model_dir):
    policy = _peft_model(tiny_model_dir, seed=1)
    await client.update_weights(adapter_tensors(policy), adapter=adapter_spec(policy))
    served = await _checksum(client)
    await client.sleep(1)
    await client.wake_up()
    assert await _checksum(client) == served
    assert await _served_by(client, _merged(tiny_model_dir, policy))
    (info,) = await client.info()
    assert info.lora_rank == 4


async def test_a_full_update_serves_the_base_weights_alone_again(client, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    policy = _peft_model(tiny_model_dir, seed=1)
    await client.update_weights(adapter_tensors(policy), adapter=adapter_spec(policy))
    merged = dict(merged_lora_weights(policy))
    (answer,) = await client.update_weights(merged.items())  # merged-weight sync
    assert answer.weight_version == 2
    (info,) = await client.info()
    assert info.lora_rank is None
    assert await _checksum(client) == pytest.approx(named_checksum(merged.items()), rel=1e-9)
    assert await _served_by(client, _merged(tiny_model_dir, policy))
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    assert not await _served_by(client, base)


def test_the_vllm_adapter_directory_and_engine_arguments(tiny_model_dir):
    """What the vllm engine gives vLLM (its serving runs on the GPU only): PEFT's layout with
    the spec's rank, alpha and targets, and the LoRA engine arguments with --enable-lora."""
    import json

    from safetensors.torch import load_file

    from rollout_server.engine.vllm_lora import VllmAdapters, lora_engine_kwargs

    policy = _peft_model(tiny_model_dir, seed=1)
    spec = adapter_spec(policy)
    tensors = dict(adapter_tensors(policy))
    off = ServerSettings(model=str(tiny_model_dir))
    on = ServerSettings(model=str(tiny_model_dir), enable_lora=True, max_lora_rank=16)
    assert lora_engine_kwargs(off) == {}
    assert lora_engine_kwargs(on) == {"enable_lora": True, "max_lora_rank": 16, "max_loras": 2}
    adapters = VllmAdapters(on)
    try:
        path = adapters.write(spec, tensors)
        assert adapters.write(spec, tensors) != path  # every update a directory of its own
        config = json.loads((path / "adapter_config.json").read_text())
        assert config["r"] == 4 and config["lora_alpha"] == 8 and config["peft_type"] == "LORA"
        assert config["target_modules"] == sorted(
            ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        )
        saved = load_file(path / "adapter_model.safetensors")
        assert saved.keys() == tensors.keys()
        assert all(torch.equal(saved[k], tensors[k]) for k in tensors)
    finally:
        adapters.close()
    assert not path.exists()
    from rollout_server.engine.base import UnsupportedError, WeightsError

    with pytest.raises(UnsupportedError, match="--enable-lora"):
        VllmAdapters(off).check(spec)
    small = ServerSettings(model=str(tiny_model_dir), enable_lora=True, max_lora_rank=2)
    with pytest.raises(WeightsError, match="--max-lora-rank 2"):
        VllmAdapters(small).check(spec)


def _announce(policy, **changes) -> dict:
    """An NCCL announce of ``policy``'s adapter as the learner makes it (one float32 bucket)."""
    from learner.sync.tensors import announced_payload

    specs, _, spec = announced_payload(policy, "adapter", "float32")
    body = {
        "tensors": [s.model_dump() for s in specs],
        "buckets": [list(range(len(specs)))],
        "bucket_dtypes": ["float32"],
        "adapter": spec.model_dump(mode="json"),
    }
    return {**body, **changes}


async def test_an_adapter_announced_over_nccl_is_validated_before_anything_is_received(
    client, tiny_model_dir
):
    """The adapter's announce is checked as an adapter (names, rank, every targeted module) and
    refused with a 400 naming the tensor before a byte is broadcast; a sound one reaches the
    engine (only the vllm engine receives NCCL: 501 here); prepare refuses adapters; nothing
    moves the version."""
    policy = _peft_model(tiny_model_dir, seed=5)
    version = (await client.info())[0].weight_version
    good = _announce(policy)
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    bad_shape = [
        {**t, "shape": [5, t["shape"][1]]} if t["name"] == name else t for t in good["tensors"]
    ]
    missing = [t for t in good["tensors"] if t["name"] != name]
    base_name = [{**good["tensors"][0], "name": "model.norm.weight"}, *good["tensors"][1:]]
    async with httpx.AsyncClient(base_url=client.servers[0], timeout=60) as http:
        r = await http.post("/weights/nccl/update", json=good)
        assert r.status_code == 501 and "NCCL" in r.json()["detail"], r.text
        r = await http.post("/weights/nccl/update", json={**good, "tensors": bad_shape})
        assert r.status_code == 400 and "rank 4 on" in r.json()["detail"], r.text
        body = {**good, "tensors": missing, "buckets": [list(range(len(missing)))]}
        r = await http.post("/weights/nccl/update", json=body)
        assert r.status_code == 400 and f"the adapter lacks tensor {name!r}" in r.text, r.text
        r = await http.post("/weights/nccl/update", json={**good, "tensors": base_name})
        assert r.status_code == 400 and "is not a LoRA adapter tensor" in r.text, r.text
        r = await http.post("/weights/nccl/prepare", json=good)
        assert r.status_code == 400 and "/weights/nccl/update" in r.json()["detail"], r.text
    assert (await client.info())[0].weight_version == version


def test_an_adapter_the_workers_write_loads_as_the_learners_policy(tiny_model_dir, tmp_path):
    """An adapter received over NCCL or CUDA IPC: the first GPU worker writes the received
    tensors (views into a flat bucket, as the receiver holds them) into the directory the
    engine made with the adapter's config; PEFT loads that directory as the learner's own
    policy (vLLM reads the same layout); other workers write nothing."""
    from types import SimpleNamespace

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from learner.sync.nccl_buckets import plan_buckets
    from learner.sync.tensors import announced_payload
    from rollout_server.engine.vllm_lora import ADAPTER_FILE, VllmAdapters
    from rollout_server.engine.worker_loader import WorkerLoader
    from rollout_server.nccl_wire import bucket_layout, unflatten

    policy = _peft_model(tiny_model_dir, seed=6)
    specs, tensors, spec = announced_payload(policy, "adapter", "float32")
    plan = plan_buckets(specs, 1 << 20)
    layout = bucket_layout([s.model_dump() for s in specs], plan.buckets, plan.dtypes)
    by_name = dict(tensors)
    received = []
    for bucket in layout:  # what the receiver holds: views into flat buckets
        flat = torch.cat([by_name[e.name].detach().reshape(-1) for e in bucket.entries])
        received += unflatten(flat, bucket)
    adapters = VllmAdapters(ServerSettings(model=str(tiny_model_dir), enable_lora=True))
    try:
        other = adapters.directory(spec)
        assert WorkerLoader(SimpleNamespace(rank=1)).save_adapter(received, str(other))
        assert not (other / ADAPTER_FILE).exists()
        path = adapters.directory(spec)
        loader = WorkerLoader(SimpleNamespace(rank=0))
        assert loader.save_adapter(received, str(path)) == "adapter-file"
        assert sorted(p.name for p in path.iterdir()) == ["adapter_config.json", ADAPTER_FILE]
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        served = PeftModel.from_pretrained(base, str(path)).eval()
        prompt, tokens = [1, 2, 3, 4], [5, 6, 7, 8, 9]
        want = _logprobs_of(policy, prompt, tokens)
        assert torch.allclose(_logprobs_of(served, prompt, tokens), want, atol=1e-6)
    finally:
        adapters.close()
