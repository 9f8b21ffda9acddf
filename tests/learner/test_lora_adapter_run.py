"""A LoRA run whose sync sends the adapters alone (rollout.sync.lora = "adapter"): the server
ends serving exactly the merged model the learner saved, and each sync moved a fraction of the
model's bytes."""

from __future__ import annotations

import asyncio
import re

import httpx
import pytest
import torch

from learner.config import load_config
from learner.run.metrics import read_metrics
from tests.learner.demo_runs import DEMO, run_ok

STEPS = 3


def _loaded_bytes(url: str) -> float:
    """The server's ``rollout_weight_update_bytes_total``: bytes of every update it loaded."""
    text = httpx.get(f"{url}/metrics").text
    return float(re.search(r"^rollout_weight_update_bytes_total (\S+)$", text, re.M).group(1))


@pytest.mark.parametrize("transport", ["http", "file"])
def test_an_adapter_sync_run_ends_serving_the_saved_final_model(tmp_path, start_server, transport):
    from transformers import AutoModelForCausalLM

    from rollout_server.client import RolloutClient
    from rollout_server.protocol import GenerateRequest
    from rollout_server.settings import ServerSettings
    from rollout_server.tiny import save_tiny_model
    from rollout_server.weight_digest import params_checksum

    run_dir = tmp_path / "lora"
    demo = load_config(DEMO)  # the server serves the model the run makes for itself
    save_tiny_model(run_dir / "model", seed=demo.run.seed, **demo.model.tiny)
    sync = f'type = "{transport}", lora = "adapter"'
    if transport == "file":
        sync += f', dir = "{tmp_path / "sync"}"'
    probe = GenerateRequest(prompts=["probe"], max_tokens=8, seed=0, ignore_eos=True)

    async def served(url: str):
        async with RolloutClient(url) as client:
            (checksum,) = await client.weights_checksum()
            (info,) = await client.info()
            return checksum.checksum, info, (await client.generate(probe)).results[0]

    settings = ServerSettings(model=str(run_dir / "model"), weights_dir=str(tmp_path))
    with start_server(settings) as server:
        run_ok(
            run_dir,
            f"run.steps={STEPS}",
            "model.lora.r=4",
            f"rollout.sync={{{sync}}}",
            f'rollout.servers=["{server.url}"]',
        )
        digest, info, result = asyncio.run(served(server.url))
        loaded = _loaded_bytes(server.url)
    final = AutoModelForCausalLM.from_pretrained(run_dir / "final", dtype=torch.float32).eval()
    assert info.lora_rank == 4 and info.weight_version == STEPS
    assert digest == pytest.approx(params_checksum(final), rel=1e-9)
    # the served samples' log-probs are the saved final model's
    tokens, prompt = result.samples[0].token_ids, result.prompt_token_ids
    with torch.no_grad():
        logits = final(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    want = logits.double().log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)
    assert torch.allclose(
        torch.tensor(result.samples[0].logprobs, dtype=torch.float64), want, atol=1e-4
    )
    assert [r["weight_version"] for r in read_metrics(run_dir)] == list(range(1, STEPS + 1))
    full = sum(t.numel() * t.element_size() for t in final.state_dict().values())
    per_sync = loaded / STEPS
    print(f"bytes per sync over {transport}: adapter {per_sync:.0f}, merged {full}")
    assert per_sync < full / 5


ADAPTER = 'rollout.sync={type = "http", lora = "adapter"}'


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        ([ADAPTER], "needs model.lora"),
        (["model.lora.r=4", 'model.lora.quantization="nf4"', ADAPTER], "with QLoRA"),
        (["model.lora.r=4", "rollout.sleep_while_training=2", ADAPTER], "level 2 discards"),
        (
            ["model.lora.r=4", 'rollout.sync={type = "vllm", lora = "adapter"}'],
            'rollout.sync.lora: "adapter" goes over type = "http", "file", "nccl" or "ipc"',
        ),
        (
            [
                "model.lora.r=4",
                'sft.data="learner/data/sft_demo.jsonl"',
                'rollout.servers=["http://127.0.0.1:1"]',
                ADAPTER,
            ],
            "an [sft] warm start and rollout.servers",
        ),
    ],
)
def test_adapter_sync_is_refused_where_it_cannot_serve_the_learners_policy(overrides, fragment):
    from learner.config import ConfigError

    with pytest.raises(ConfigError) as e:
        load_config(DEMO, overrides)
    assert fragment in str(e.value), str(e.value)


def test_adapter_sync_is_accepted_with_lora_over_every_transport_of_ours(tmp_path):
    syncs = ('type = "http"', f'type = "file", dir = "{tmp_path}"', 'type = "nccl"', 'type = "ipc"')
    for sync in syncs:
        cfg = load_config(DEMO, ["model.lora.r=4", f'rollout.sync={{{sync}, lora = "adapter"}}'])
        assert cfg.rollout.sync.lora == "adapter"
        assert not cfg.rollout.sync.prepares  # an adapter's MBs are never prepared
    assert load_config(DEMO).rollout.sync.lora == "merged"
    assert load_config(DEMO, ['rollout.sync={type = "nccl"}']).rollout.sync.prepares
