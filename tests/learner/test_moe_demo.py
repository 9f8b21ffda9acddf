"""A tiny mixture-of-experts model through the whole loop: weights synced over HTTP under the
digest, and the demo learning with routing replay."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from learner.run.metrics import read_metrics
from rollout_server.client import RolloutClient
from rollout_server.settings import ServerSettings
from rollout_server.tiny import save_tiny_model
from rollout_server.weight_digest import params_checksum
from tests.learner.demo_runs import run_ok


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny-moe"), moe="qwen3_moe")


def test_moe_weights_sync_over_http_and_the_server_serves_their_digest(
    moe_dir: Path, start_server
) -> None:
    """The fused expert tensors ([experts, 2 x width, hidden]) travel and load like any other."""
    model = AutoModelForCausalLM.from_pretrained(moe_dir)
    with torch.no_grad():
        experts = model.model.layers[1].mlp.experts.gate_up_proj
        assert experts.dim() == 3
        experts[3] += 0.5  # one expert of one layer moves: the digest must see it
    want = params_checksum(model)

    async def sync() -> tuple[float, float]:
        async with RolloutClient(server.url, max_retries=0) as client:
            (before,) = await client.weights_checksum()
            await client.update_weights(model.state_dict().items(), bucket_bytes=64 * 1024)
            (after,) = await client.weights_checksum()
            return before.checksum, after.checksum

    with start_server(ServerSettings(model=str(moe_dir))) as server:
        before, after = asyncio.run(sync())
    assert after == pytest.approx(want, rel=1e-12)
    assert before != pytest.approx(want, rel=1e-9)


@pytest.mark.slow
def test_the_tiny_moe_learns_the_demo_with_routing_replay(moe_dir: Path, tmp_path: Path) -> None:
    """16 demo steps of the tiny Qwen3-MoE with r3: the reward rises, and the learner's
    log-probs of the sampled tokens are the server's (the k3 gap of float rounding)."""
    run_dir = tmp_path / "moe"
    t0 = time.monotonic()
    run_ok(
        run_dir,
        f"model.name_or_path={moe_dir}",
        "model.routing_replay=r3",
        "run.steps=16",
        "eval.every=100",
        "run.checkpoint_every=100",
    )
    records = read_metrics(run_dir)
    rewards = [r["reward/mean"] for r in records]
    first, last = sum(rewards[:4]) / 4, sum(rewards[-4:]) / 4
    print(f"moe demo: {time.monotonic() - t0:.0f} s, reward first4={first:.3f} last4={last:.3f}")
    assert len(records) == 16
    assert last >= 2 * first, rewards
    assert max(r["off_policy/k3"] for r in records) < 1e-9
