"""TransformersEngine on a CUDA GPU (run on the GPU machine: ``pytest -m gpu``)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from rollout_server.engine.transformers_engine import TransformersEngine
from rollout_server.protocol import SamplingParams
from rollout_server.settings import ServerSettings

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


async def _engine(model_dir, dtype: str) -> TransformersEngine:
    e = TransformersEngine(ServerSettings(model=str(model_dir), device="cuda", dtype=dtype))
    await e.start()
    return e


# Plain test functions that run their coroutine: the GPU machine has no pytest-asyncio.
def test_gpu_logprobs_match_a_plain_forward_and_sleep_round_trips(tiny_model_dir):
    asyncio.run(_logprobs_match_a_plain_forward_and_sleep_round_trips(tiny_model_dir))


def test_gpu_bfloat16_generates(tiny_model_dir):
    asyncio.run(_bfloat16_generates(tiny_model_dir))


async def _logprobs_match_a_plain_forward_and_sleep_round_trips(tiny_model_dir) -> None:
    from transformers import AutoModelForCausalLM

    torch.backends.cuda.matmul.allow_tf32 = False
    engine = await _engine(tiny_model_dir, "float32")
    try:
        assert engine.info().device.startswith("cuda") and engine.info().dtype == "float32"
        ref = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
        prompts = [engine.tokenize_prompt(p) for p in ("hello", "a longer prompt here")]
        params = SamplingParams(max_tokens=16, seed=3, ignore_eos=True)
        out = await engine.generate(prompts, 4, params)
        for prompt, samples in zip(prompts, out, strict=True):
            for s in samples:
                with torch.no_grad():
                    logits = ref(torch.tensor([prompt + s.token_ids])).logits[0]
                lp = logits[len(prompt) - 1 : -1].double().log_softmax(-1)
                want = lp.gather(-1, torch.tensor(s.token_ids)[:, None]).squeeze(-1)
                got = torch.tensor(s.logprobs, dtype=torch.float64)
                assert torch.allclose(got, want, atol=1e-4)

        state = {k: v.detach().cpu().clone() for k, v in engine.model.state_dict().items()}
        used = torch.cuda.memory_allocated()
        await engine.sleep(1)  # level 1: the weights go to host memory
        assert next(engine.model.parameters()).device.type == "cpu"
        assert torch.cuda.memory_allocated() < used
        await engine.wake_up()
        assert next(engine.model.parameters()).device.type == "cuda"
        assert (await engine.generate(prompts, 4, params)) == out

        await engine.sleep(2)  # level 2: freed, reallocated zero-filled, then synced
        await engine.wake_up()
        await engine.load_weights(state.items())
        again = await engine.generate(prompts, 4, params)
        assert [[s.token_ids for s in r] for r in again] == [[s.token_ids for s in r] for r in out]
    finally:
        await engine.close()


async def _bfloat16_generates(tiny_model_dir) -> None:
    engine = await _engine(tiny_model_dir, "auto")  # auto = bfloat16 on GPU
    try:
        assert engine.info().dtype == "bfloat16"
        prompt = engine.tokenize_prompt([{"role": "user", "content": "hi"}])
        (samples,) = await engine.generate(
            [prompt], 8, SamplingParams(max_tokens=32, top_p=0.9, seed=0)
        )
        for s in samples:
            assert 1 <= len(s.token_ids) <= 32
            assert all(-1e4 < lp <= 0 for lp in s.logprobs)
    finally:
        await engine.close()
