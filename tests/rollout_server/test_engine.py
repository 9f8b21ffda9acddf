"""TransformersEngine on the tiny model, without HTTP: log-probs, seeds, stops, batching."""

from __future__ import annotations

import asyncio

import pytest
import torch

from rollout_server.engine.transformers_engine import TransformersEngine
from rollout_server.protocol import SamplingParams
from rollout_server.settings import ServerSettings

PROMPTS = ["hello", "a somewhat longer prompt", "x"]


@pytest.fixture
async def engine(tiny_model_dir):
    e = TransformersEngine(ServerSettings(model=str(tiny_model_dir)))
    await e.start()
    yield e
    await e.close()


@pytest.fixture(scope="module")
def reference_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def _full_logprobs(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """log-softmax of a plain (unpadded, uncached) forward over prompt + completion, [C, V]."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0].double()  # [P+C, V]
    return logits[len(prompt) - 1 : -1].log_softmax(-1)


async def test_logprobs_match_a_plain_forward_of_the_model(engine, reference_model):
    prompts = [engine.tokenize_prompt(p) for p in PROMPTS]  # different lengths: left padding
    params = SamplingParams(temperature=1.0, max_tokens=12, seed=7)
    out = await engine.generate(prompts, 4, params)
    assert [len(samples) for samples in out] == [4, 4, 4]
    for prompt, samples in zip(prompts, out, strict=True):
        for s in samples:
            assert len(s.token_ids) == len(s.logprobs) == 12 and s.finish_reason == "length"
            ref = _full_logprobs(reference_model, prompt, s.token_ids)
            want = ref.gather(-1, torch.tensor(s.token_ids)[:, None]).squeeze(-1)
            assert torch.allclose(torch.tensor(s.logprobs, dtype=torch.float64), want, atol=1e-4)
            assert s.text == engine.decode(s.token_ids)


async def test_logprobs_are_under_the_filtered_distribution(engine, reference_model):
    prompt = engine.tokenize_prompt("top-k")
    params = SamplingParams(temperature=0.7, top_k=5, max_tokens=6, seed=1)
    (samples,) = await engine.generate([prompt], 2, params)
    for s in samples:
        ref = _full_logprobs(reference_model, prompt, s.token_ids)
        logits = (ref / 0.7).log_softmax(-1)  # temperature on the logits (log-probs + const)
        for step, (tok, lp) in enumerate(zip(s.token_ids, s.logprobs, strict=True)):
            top = logits[step].topk(5)
            assert tok in top.indices.tolist()  # never outside the top 5
            renorm = top.values.log_softmax(-1)[top.indices.tolist().index(tok)]
            assert lp == pytest.approx(renorm.item(), abs=1e-4)


async def test_top_k_one_is_greedy_with_log_prob_zero(engine):
    prompt = engine.tokenize_prompt("greedy")
    (greedy,) = await engine.generate([prompt], 1, SamplingParams(temperature=0, max_tokens=8))
    (top1,) = await engine.generate([prompt], 2, SamplingParams(top_k=1, max_tokens=8, seed=3))
    assert top1[0].token_ids == top1[1].token_ids == greedy[0].token_ids
    assert top1[0].logprobs == [0.0] * 8
    assert all(lp < 0 for lp in greedy[0].logprobs)  # greedy reports the unfiltered softmax


async def test_seeds_reproduce_regardless_of_batching(engine):
    prompt = engine.tokenize_prompt("seeded")
    params = SamplingParams(max_tokens=10, seed=123)
    (alone,) = await engine.generate([prompt], 3, params)
    # the same request again, this time batched with unrelated concurrent requests
    others = [
        engine.generate([engine.tokenize_prompt(p)], 2, SamplingParams(max_tokens=15, top_p=0.8))
        for p in PROMPTS
    ]
    (again,), *_ = await asyncio.gather(engine.generate([prompt], 3, params), *others)
    assert [s.token_ids for s in again] == [s.token_ids for s in alone]
    for a, b in zip(again, alone, strict=True):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    # sample i of a request uses seed + i
    (shifted,) = await engine.generate([prompt], 1, params.model_copy(update={"seed": 124}))
    assert shifted[0].token_ids == alone[1].token_ids
    assert len({tuple(s.token_ids) for s in alone}) == 3  # the samples differ
    # prompt k's sample i uses seed + k * n + i: a repeated prompt gets new samples
    first, second = await engine.generate([prompt, prompt], 3, params)
    assert [s.token_ids for s in first] == [s.token_ids for s in alone]
    (later,) = await engine.generate([prompt], 3, params.model_copy(update={"seed": 126}))
    assert [s.token_ids for s in second] == [s.token_ids for s in later]


async def test_stop_token_ids_and_eos_end_the_sample_including_the_stop_token(engine):
    prompt = engine.tokenize_prompt("stop")
    (ref,) = await engine.generate([prompt], 1, SamplingParams(max_tokens=30, seed=5))
    tokens = ref[0].token_ids
    k = next(i for i in range(2, 30) if tokens[i] not in tokens[:i])
    stopped = SamplingParams(max_tokens=30, seed=5, stop_token_ids=[tokens[k]])
    (out,) = await engine.generate([prompt], 1, stopped)
    assert out[0].token_ids == tokens[: k + 1] and out[0].finish_reason == "stop"
    assert out[0].logprobs == pytest.approx(ref[0].logprobs[: k + 1], abs=1e-5)
    engine.eos_token_ids = [tokens[k]]  # make that token the model's end-of-sequence
    (eos,) = await engine.generate([prompt], 1, SamplingParams(max_tokens=30, seed=5))
    assert eos[0].token_ids == tokens[: k + 1] and eos[0].finish_reason == "stop"
    ignore = SamplingParams(max_tokens=30, seed=5, ignore_eos=True)
    (ignored,) = await engine.generate([prompt], 1, ignore)
    assert ignored[0].token_ids == tokens and ignored[0].finish_reason == "length"


async def test_stop_strings_cut_the_text_before_the_stop(engine):
    prompt = engine.tokenize_prompt("stop strings")
    (ref,) = await engine.generate([prompt], 1, SamplingParams(max_tokens=60, seed=11))
    tokens = ref[0].token_ids
    # the first printable ASCII token whose character did not occur earlier in the text
    k = next(
        i
        for i in range(1, 60)
        if 33 <= tokens[i] < 127 and chr(tokens[i]) not in engine.decode(tokens[:i])
    )
    stop = chr(tokens[k])
    (out,) = await engine.generate([prompt], 1, SamplingParams(max_tokens=60, seed=11, stop=stop))
    assert out[0].finish_reason == "stop"
    assert out[0].token_ids == tokens[: k + 1]  # tokens through the one completing the stop
    assert out[0].text == engine.decode(tokens[:k])  # text without the stop string


async def test_max_model_len_caps_the_completion(tiny_model_dir):
    e = TransformersEngine(ServerSettings(model=str(tiny_model_dir), max_model_len=12))
    await e.start()
    try:
        prompt = list(range(97, 107))  # 10 tokens
        (out,) = await e.generate([prompt], 1, SamplingParams(max_tokens=50, seed=0))
        assert len(out[0].token_ids) == 2 and out[0].finish_reason == "length"
        assert e.info().max_model_len == 12
    finally:
        await e.close()


async def test_weights_load_in_place_and_tied_names_share_storage(engine):
    meta = engine.weight_metadata()
    assert meta["model.embed_tokens.weight"].shape == (265, 64)
    assert meta["lm_head.weight"] == meta["model.embed_tokens.weight"]  # tied, both loadable
    new = torch.randn(265, 64)
    await engine.load_weights([("lm_head.weight", new)])
    assert torch.equal(engine.model.get_input_embeddings().weight, new)


async def test_sleep_level_2_frees_the_weights_and_wake_reallocates(engine):
    await engine.sleep(1)
    assert engine.is_sleeping()
    assert engine.model.get_input_embeddings().weight.numel() == 265 * 64  # CPU: kept
    await engine.wake_up(["weights"])
    assert engine.is_sleeping()  # kv_cache still asleep
    await engine.wake_up(["kv_cache"])
    assert not engine.is_sleeping()
    await engine.sleep(2)
    assert engine.model.get_input_embeddings().weight.numel() == 0
    await engine.wake_up()
    assert not engine.is_sleeping()
    weight = engine.model.get_input_embeddings().weight
    assert weight.shape == (265, 64) and not weight.any()


async def test_small_batch_limits_split_requests_without_changing_results(engine, tiny_model_dir):
    small = TransformersEngine(
        ServerSettings(model=str(tiny_model_dir), max_num_seqs=2, max_batch_tokens=8)
    )
    await small.start()
    try:
        prompts = [engine.tokenize_prompt(p) for p in PROMPTS]  # one is 24 tokens > 8
        params = SamplingParams(max_tokens=6, seed=9, ignore_eos=True)
        want = await engine.generate(prompts, 3, params)
        got = await small.generate(prompts, 3, params)
        assert [[s.token_ids for s in r] for r in got] == [[s.token_ids for s in r] for r in want]
    finally:
        await small.close()
