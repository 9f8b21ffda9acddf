"""What a learner rank records of its own embedded server as the run ends: the checksum of the
weights it serves, read right before the server is stopped, so that a check after the run
(the e2e bench) compares it with the saved final model without racing the server's stop."""

from __future__ import annotations

import json

import httpx
import pytest

from grpo_common.net import free_port
from tests.learner.demo_runs import DEMO


def test_a_rank_records_what_its_server_serves_before_stopping_it(tmp_path, tiny_model_dir):
    import torch
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM

    from learner.config import load_config
    from learner.config.sync import HttpSyncConfig
    from learner.servers.pool import EventLoopThread, own_server, served_record
    from learner.sync.http import HttpTransport
    from rollout_server.client import RolloutClient
    from rollout_server.tiny import save_tiny_model
    from rollout_server.weight_digest import params_checksum

    cfg = load_config(DEMO, [f'model.name_or_path="{tiny_model_dir}"',
                             "rollout.embedded.per_rank=true"])  # fmt: skip
    learner_dir = save_tiny_model(tmp_path / "learner", seed=1)
    model = AutoModelForCausalLM.from_pretrained(learner_dir, dtype=torch.float32)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    record = served_record(run_dir, 0)
    loop = EventLoopThread()
    try:
        with own_server(cfg, str(tiny_model_dir), run_dir, Accelerator(cpu=True)) as (urls, key):
            client = RolloutClient(urls, api_key=key, max_retries=0)
            loop.run(HttpTransport(HttpSyncConfig(), client, ready_timeout_s=30).push(model, 5))
            loop.run(client.aclose())
            assert not record.exists()  # written as the server stops, not before
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{urls[0]}/health", timeout=5)  # the server is gone
    finally:
        loop.close()
    got = json.loads(record.read_text())
    assert got["rank"] == 0 and got["url"] == urls[0] and got["weight_version"] == 5
    assert got["checksum"] == pytest.approx(params_checksum(model), rel=1e-9)


def test_a_server_that_does_not_answer_is_recorded_as_an_error(tmp_path):
    from learner.servers.embedded import record_served

    url = f"http://127.0.0.1:{free_port()}"
    record_served(url, "key", tmp_path / "served.json", 1)
    got = json.loads((tmp_path / "served.json").read_text())
    assert got["rank"] == 1 and got["url"] == url and "ConnectError" in got["error"]
    assert "checksum" not in got and list(tmp_path.iterdir()) == [tmp_path / "served.json"]
