"""The learner's path for a stock ``vllm serve`` (``rollout.server_api = "vllm"``, ``[rollout.sync]
type = "vllm"``): generation through ``/v1/completions``, readiness through ``/health``, the
weights through vLLM's RL routes, against a real server on loopback that answers those routes as
vLLM documents them (ours, its transformers engine behind them; the bytes over the gloo twin of
vLLM's NCCL engine). The run ends with the server serving exactly the model the learner saved."""

from __future__ import annotations

import asyncio

import pytest
import torch

from learner.config import load_config
from learner.run.metrics import read_metrics
from tests.learner.demo_runs import DEMO, run_ok

STEPS = 3


def test_a_run_over_vllms_routes_ends_serving_the_saved_final_model(tmp_path, start_server):
    from transformers import AutoModelForCausalLM

    from rollout_server.client import RolloutClient
    from rollout_server.settings import ServerSettings
    from rollout_server.tiny import save_tiny_model
    from rollout_server.weight_digest import params_checksum

    run_dir = tmp_path / "run"
    demo = load_config(DEMO)  # the server serves the model the run makes for itself
    save_tiny_model(run_dir / "model", seed=demo.run.seed, **demo.model.tiny)

    async def served(url: str):
        async with RolloutClient(url) as client:  # our server's own routes, to check
            (checksum,) = await client.weights_checksum()
            (info,) = await client.info()
            return checksum.checksum, info

    settings = ServerSettings(model=str(run_dir / "model"))
    with start_server(settings) as server:
        run_ok(
            run_dir,
            f"run.steps={STEPS}",
            'rollout.server_api="vllm"',
            'rollout.sync={type = "vllm", backend = "gloo"}',
            f'rollout.servers=["{server.url}"]',
        )
        digest, info = asyncio.run(served(server.url))
    final = AutoModelForCausalLM.from_pretrained(run_dir / "final", dtype=torch.float32).eval()
    assert digest == pytest.approx(params_checksum(final), rel=1e-9)
    assert info.weight_version == STEPS  # one finished update per step
    records = read_metrics(run_dir)
    assert [r["weight_version"] for r in records] == list(range(1, STEPS + 1))
    assert all(r["loss"] == r["loss"] for r in records)  # trained: finite losses every step


def test_the_client_reads_vllms_completions_as_samples(start_server, tiny_model_dir):
    """``VllmServeClient.generate``: n samples per token-id prompt, in prompt order, each with
    its token ids and one log-prob per token, from ``/v1/completions`` alone."""
    from rollout_server.client import RolloutClient
    from rollout_server.client_vllm import VllmServeClient
    from rollout_server.protocol import GenerateRequest
    from rollout_server.settings import ServerSettings

    req = GenerateRequest(prompts=[[5, 6, 7], [8, 9]], n=2, max_tokens=6, seed=3, ignore_eos=True)

    async def both(url: str):
        vllm = VllmServeClient(url, dtype="float32", vocab_size=1, eos_token_ids=[])
        async with vllm, RolloutClient(url) as ours:
            await vllm.wait_ready(30)
            (info,) = await vllm.info()
            return await vllm.generate(req), await ours.generate(req), info

    with start_server(ServerSettings(model=str(tiny_model_dir))) as server:
        got, want, info = asyncio.run(both(server.url))
    assert info.engine == "vllm-serve" and info.max_model_len > 0
    assert info.tensor_parallel_size == 1
    assert [r.prompt_token_ids for r in got.results] == [[5, 6, 7], [8, 9]]
    for result in got.results:
        assert len(result.samples) == 2
        for s in result.samples:
            assert len(s.token_ids) == 6 and len(s.logprobs) == 6
            assert all(lp <= 0 for lp in s.logprobs)
    # the same server's /generate, with the same seed, gives every prompt the same first sample
    assert got.results[0].samples[0].token_ids == want.results[0].samples[0].token_ids
