"""The learner's HTTP and file syncs send the servers' dtype: a learner in bf16 (DeepSpeed's
mixed precision) updates a float32 server. Before, the server refused every tensor ("has dtype
bfloat16, the model's is float32") and the run stopped at its first sync."""

from __future__ import annotations

import pytest
import torch

from learner.config.rollout import RolloutConfig
from learner.sync import make_transport
from rollout_server.client import RolloutClient
from rollout_server.settings import ServerSettings
from rollout_server.tiny import save_tiny_model
from rollout_server.weight_digest import params_checksum


@pytest.fixture(scope="module")
def server(start_server, tiny_model_dir, tmp_path_factory):
    base = str(tmp_path_factory.getbasetemp())  # file sync writes under each test's tmp_path
    settings = ServerSettings(model=str(tiny_model_dir), dtype="float32", weights_dir=base)
    with start_server(settings) as s:
        yield s


@pytest.mark.parametrize("transport", ["http", "file"])
async def test_a_bf16_learner_updates_a_float32_server(server, tmp_path, transport):
    from transformers import AutoModelForCausalLM

    other = save_tiny_model(tmp_path / "other", seed=int(transport == "file") + 5)
    model = AutoModelForCausalLM.from_pretrained(other, dtype=torch.bfloat16)
    file = {"type": "file", "dir": str(tmp_path / "sync")}
    section = file if transport == "file" else transport
    cfg = RolloutConfig(servers=[server.url], sync=section)
    async with RolloutClient(server.url, max_retries=0) as client:
        before = (await client.weights_checksum())[0]
        await make_transport(cfg, client).push(model)
        after = (await client.weights_checksum())[0]
    assert after.weight_version == before.weight_version + 1
    # the server holds the bf16 weights, widened to its float32
    assert after.checksum == pytest.approx(params_checksum(model.float()), rel=1e-6)
