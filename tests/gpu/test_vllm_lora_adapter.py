"""LoRA adapters served by the vllm engine (``--enable-lora``): a real ``rollout-server --engine
vllm`` on GPU 0 serving the random-weight Qwen3-0.6B-shaped model, adapters sent as the learner
sends them (``rollout.sync.lora = "adapter"``) over HTTP, and over NCCL (from GPU 1) and CUDA IPC
(from GPU 0) through the learner's own transports.

Covered: an adapter update serves the policy of the learner's merged model (the same server's
generations after a merged-weight sync of that policy agree with it), a second version switches
(the version moves once; a smaller rank too), a bad adapter is a 400 and the previous one serves
on, sleep level 1 keeps the adapter, and a full update serves the base weights alone again. Over
NCCL and CUDA IPC: only the adapter's bytes travel, and the server then serves the policy a
merged-weight sync of it serves.
"""

from __future__ import annotations

import asyncio

import pytest

pytestmark = pytest.mark.gpu

PROMPTS = [[(7 * i + 3 * j) % 256 for j in range(24)] for i in range(4)]  # byte tokens
RANK = 8


@pytest.fixture(scope="module")
def server(qwen3_dir, log_dir):
    from gpu_common import ServerProcess

    # No prefix caching: a cached prefix changes the arithmetic, and comparisons between calls
    # of this near-tied random model would be flaky.
    proc = ServerProcess(
        qwen3_dir,
        gpu="0",
        extra_args=["--no-enable-prefix-caching", "--enable-lora", "--max-lora-rank", "16"],
        log_path=log_dir / "test_vllm_lora_adapter.server.log",
    )
    proc.start()
    yield proc
    proc.stop()


def _policy(model_dir, seed: int, r: int = RANK):
    """The learner's policy on CPU in bf16 (the server's dtype): random adapters, small enough
    that the model stays sane, large enough to move the log-probs well past bf16 noise."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    config = LoraConfig(r=r, lora_alpha=2 * r, target_modules="all-linear", init_lora_weights=False)
    return get_peft_model(base, config).eval()


def _push(server, tensors, adapter=None) -> int:
    """One update over HTTP as the learner's transport sends it (cast to the server's dtype:
    PEFT keeps the adapters in float32); the new weight version."""
    from gpu_common import API_KEY

    from learner.sync.tensors import in_dtype
    from rollout_server.client import RolloutClient

    async def push() -> int:
        async with RolloutClient(server.url, api_key=API_KEY) as client:
            cast = in_dtype(tensors, "bfloat16")
            (answer,) = await client.update_weights(cast, adapter=adapter)
            return answer.weight_version

    return asyncio.run(push())


def _push_adapter(server, policy) -> int:
    from learner.sync.tensors import adapter_spec, adapter_tensors

    return _push(server, adapter_tensors(policy), adapter_spec(policy))


def _push_merged(server, policy) -> int:
    from learner.sync.tensors import merged_lora_weights

    return _push(server, merged_lora_weights(policy))


def test_an_adapter_serves_the_merged_policy_and_versions_switch(server, qwen3_dir) -> None:
    from gpu_common import greedy

    base = greedy(server, PROMPTS)
    first, second = _policy(qwen3_dir, seed=1), _policy(qwen3_dir, seed=2, r=4)
    version = _push_adapter(server, first)
    assert server.info()["lora_rank"] == RANK
    served = greedy(server, PROMPTS)
    assert not served.matches(base), "the adapter changed nothing"
    assert _push_merged(server, first) == version + 1  # the same policy, merged
    assert server.info()["lora_rank"] is None
    merged = greedy(server, PROMPTS)
    assert served.matches(merged), served.mismatch(merged)
    # a second adapter version, another rank: switched to at once
    assert _push_adapter(server, second) == version + 2
    assert server.info()["lora_rank"] == 4
    assert not greedy(server, PROMPTS).matches(served)
    assert _push_adapter(server, first) == version + 3
    again = greedy(server, PROMPTS)
    # the base now holds the first policy merged, its adapter on top: another policy again
    assert not again.matches(served)


def test_a_bad_adapter_is_refused_and_the_previous_one_serves_on(server, qwen3_dir) -> None:
    import safetensors.torch
    import torch
    from gpu_common import greedy

    from learner.sync.tensors import adapter_spec, adapter_tensors, in_dtype
    from rollout_server.protocol import WeightUpdateBegin

    policy = _policy(qwen3_dir, seed=3)
    version = _push_adapter(server, policy)
    before = greedy(server, PROMPTS)
    bad = dict(in_dtype(adapter_tensors(policy), "bfloat16"))
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    bad[name] = torch.zeros(RANK + 1, bad[name].shape[1], dtype=torch.bfloat16)
    begin = WeightUpdateBegin(adapter=adapter_spec(policy)).model_dump(mode="json")
    update_id = server.post("/weights/begin", begin).json()["update_id"]
    r = server.http.post(
        "/weights/bucket",
        params={"update_id": update_id, "index": 0},
        content=safetensors.torch.save(bad),
    )
    assert r.status_code == 400 and name in r.text, r.text
    server.post("/weights/abort", {"update_id": update_id})
    assert server.info()["weight_version"] == version
    after = greedy(server, PROMPTS)
    assert after.matches(before), after.mismatch(before)


def test_sleep_level_1_keeps_the_adapter(server, qwen3_dir) -> None:
    from gpu_common import greedy

    _push_adapter(server, _policy(qwen3_dir, seed=4))
    before = greedy(server, PROMPTS)
    r = server.post("/sleep", {"level": 1})
    assert r.status_code == 200, r.text
    assert server.post("/wake_up", {}).status_code == 200
    assert server.info()["lora_rank"] == RANK
    after = greedy(server, PROMPTS)
    assert after.matches(before), after.mismatch(before)


def _push_base(server, model_dir) -> int:
    """The base weights the policies adapt, served again (over HTTP, merged: no adapter)."""
    import torch
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    return _push(server, ((n, p.detach()) for n, p in base.named_parameters()))


async def _push_over(server, policy, transport: str, device: str):
    """One push of ``policy``'s adapter through the learner's own ``transport``; its answer."""
    import torch
    from gpu_common import API_KEY

    from learner.config import RolloutConfig
    from learner.config.sync import SYNC_SECTIONS
    from learner.sync import make_transport
    from rollout_server.client import RolloutClient

    sync_config = SYNC_SECTIONS[transport](lora="adapter")
    async with RolloutClient(server.url, api_key=API_KEY) as client:
        rollout = RolloutConfig(servers=[server.url], sync=sync_config)
        sync = make_transport(rollout, client, device=torch.device(device))
        try:
            await sync.connect()  # NCCL: the group of this process and the server's worker
            (answer,) = await sync.push(policy)
        finally:
            sync.close()
    return answer


@pytest.mark.parametrize("transport", ["nccl", "ipc"])
def test_an_adapter_over_nccl_or_ipc_serves_the_merged_policy(server, qwen3_dir, transport):
    from gpu_common import gpu_count, greedy

    from learner.sync.tensors import adapter_tensors

    if transport == "nccl" and gpu_count() < 2:
        pytest.skip("the NCCL sender needs a GPU of its own")
    device = "cuda:1" if transport == "nccl" else "cuda:0"  # IPC: the server's GPU
    policy = _policy(qwen3_dir, seed=5 if transport == "nccl" else 6)
    _push_base(server, qwen3_dir)  # earlier tests left another policy merged into the base
    adapter_bytes = sum(t.numel() * 2 for _, t in adapter_tensors(policy))  # in bf16
    before = server.info()["weight_version"]
    answer = asyncio.run(_push_over(server, policy, transport, device))
    assert answer.weight_version == before + 1
    assert answer.num_bytes == adapter_bytes  # the adapter alone: MBs, not the model's GBs
    assert server.info()["lora_rank"] == RANK
    served = greedy(server, PROMPTS)
    assert _push_merged(server, policy) == before + 2  # the same policy, merged, over HTTP
    assert server.info()["lora_rank"] is None
    merged = greedy(server, PROMPTS)
    assert served.matches(merged), served.mismatch(merged)
    # another adapter over the same transport: switched to at once
    second = asyncio.run(_push_over(server, _policy(qwen3_dir, seed=7, r=4), transport, device))
    assert second.weight_version == before + 3 and server.info()["lora_rank"] == 4
    assert not greedy(server, PROMPTS).matches(merged)
