"""A real uvicorn server with the tiny model: /generate, status routes, bad inputs, metrics."""

from __future__ import annotations

import httpx
import pytest
import torch

from rollout_server.client import RolloutClient
from rollout_server.protocol import ChatMessage, GenerateRequest, Limits
from rollout_server.settings import ServerSettings

LIMITS = Limits(max_n=8, max_tokens=64, max_prompt_len=64, max_batch_size=8)


@pytest.fixture(scope="module")
def server(start_server, tiny_model_dir):
    settings = ServerSettings(model=str(tiny_model_dir), limits=LIMITS, max_model_len=256)
    with start_server(settings) as s:
        yield s


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(tiny_model_dir)


async def test_generate_n4_shapes_logprobs_and_seeds(server, reference):
    model, tokenizer = reference
    chat = [ChatMessage(role="user", content="What is 2+2?")]
    request = GenerateRequest(
        prompts=["hello world", [104, 105], chat], n=4, max_tokens=16, seed=42
    )
    async with RolloutClient(server.url) as client:
        resp = await client.generate(request)
        again = await client.generate(request)
    assert resp.weight_version == 0 and len(resp.results) == 3
    assert resp.results[0].prompt_token_ids == tokenizer("hello world")["input_ids"]
    assert resp.results[1].prompt_token_ids == [104, 105]
    chat_text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+2?"}], tokenize=False, add_generation_prompt=True
    )
    assert resp.results[2].prompt_token_ids == tokenizer(chat_text)["input_ids"]
    for result in resp.results:
        assert len(result.samples) == 4
        for s in result.samples:
            assert 1 <= len(s.token_ids) == len(s.logprobs) <= 16
            assert all(lp <= 0 for lp in s.logprobs)
            assert s.weight_version == 0 and s.finish_reason in ("stop", "length")
            # recompute with a plain fp32 forward over prompt + completion
            ids = torch.tensor([result.prompt_token_ids + s.token_ids])
            with torch.no_grad():
                logits = model(ids).logits[0, len(result.prompt_token_ids) - 1 : -1]
            want = logits.double().log_softmax(-1).gather(-1, torch.tensor(s.token_ids)[:, None])
            got = torch.tensor(s.logprobs, dtype=torch.float64)
            assert torch.allclose(got, want.squeeze(-1), atol=1e-4)
    assert again.model_dump() == resp.model_dump()  # same seed, same weights, same output


async def test_a_seeded_request_spread_over_servers_draws_what_one_server_draws(server):
    """The client shifts each shard's seed by its first prompt (prompt k: seed + k * n), so the
    number of servers does not change a seeded batch: here the same server, listed twice."""
    request = GenerateRequest(prompts=["a", "b", "c"], n=2, max_tokens=8, seed=5)
    async with RolloutClient(server.url) as one, RolloutClient([server.url] * 2) as two:
        alone, spread = await one.generate(request), await two.generate(request)
    assert [[s.token_ids for s in r.samples] for r in spread.results] == [
        [s.token_ids for s in r.samples] for r in alone.results
    ]


async def test_logprobs_false_returns_the_same_samples_without_logprobs(server):
    request = GenerateRequest(prompts=["hello world", [104, 105]], n=3, max_tokens=12, seed=7)
    async with RolloutClient(server.url) as client:
        full = await client.generate(request)
        bare = await client.generate(request.model_copy(update={"logprobs": False}))
    for a, b in zip(full.results, bare.results, strict=True):
        assert b.prompt_token_ids == a.prompt_token_ids
        for sa, sb in zip(a.samples, b.samples, strict=True):
            assert sb.token_ids == sa.token_ids and sb.text == sa.text
            assert sa.logprobs and sb.logprobs == []


def test_status_routes(http):
    assert http.get("/health").json() == {"status": "ok"}
    assert http.get("/ready").status_code == 200
    info = http.get("/info").json()
    assert info["engine"] == "transformers" and info["vocab_size"] == 265
    assert info["max_model_len"] == 256 and info["eos_token_ids"] == [258]
    assert info["limits"]["max_n"] == 8 and info["weight_version"] == 0
    assert info["max_num_seqs"] == 256 and info["max_batch_tokens"] == 32768  # the defaults
    assert http.get("/is_sleeping").json() == {"is_sleeping": False, "level": 0}
    assert http.get("/v1/models").json()["data"][0]["id"] == info["model"]
    paths = http.get("/openapi.json").json()["paths"]
    for path in ("/generate", "/v1/chat/completions", "/weights/update", "/sleep", "/metrics"):
        assert path in paths
    assert "swagger" in http.get("/docs").text.lower()


def _body(**overrides):
    return {"prompts": ["hi"], "max_tokens": 4, **overrides}


TOOL = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}

BAD_INPUTS = [
    # (description, route, json body or raw bytes, status, words the detail must contain)
    ("n over the limit", "/generate", _body(n=9), 400, ["n=9", "limit of 8", "--max-n"]),
    ("huge n", "/generate", _body(n=10**30), 400, ["limit of 8"]),
    ("max_tokens over", "/generate", _body(max_tokens=65), 400, ["max_tokens=65", "64"]),
    ("prompt too long", "/generate", _body(prompts=[[97] * 65]), 400, ["65 tokens", "max_prompt_len = 64", "larger --max-prompt-len"]),
    ("batch too large", "/generate", _body(prompts=["a"] * 9), 400, ["9 prompts", "limit of 8"]),
    ("no prompts", "/generate", _body(prompts=[]), 422, ["prompts"]),
    ("empty text prompt", "/generate", _body(prompts=["ok", ""]), 400, ["prompts[1] is empty"]),
    ("empty id prompt", "/generate", _body(prompts=[[]]), 400, ["prompts[0] is empty"]),
    ("id past the vocab", "/generate", _body(prompts=[[1, 265]]), 400, ["vocabulary", "265"]),
    ("negative id", "/generate", _body(prompts=[[-1]]), 400, ["vocabulary"]),
    ("float id", "/generate", _body(prompts=[[1.5]]), 422, ["prompts"]),
    ("prompts not a list", "/generate", _body(prompts="hello"), 422, ["prompts"]),
    ("negative temperature", "/generate", _body(temperature=-1), 422, ["temperature"]),
    ("top_p zero", "/generate", _body(top_p=0), 422, ["top_p"]),
    ("min_p above one", "/generate", _body(min_p=2), 422, ["min_p"]),
    ("top_k below -1", "/generate", _body(top_k=-5), 422, ["top_k"]),
    ("n zero", "/generate", _body(n=0), 422, ["n"]),
    ("n true", "/generate", _body(n=True), 422, ["body.n: Input should be a valid integer"]),
    ("max_tokens 2.0", "/generate", _body(max_tokens=2.0), 422, ["body.max_tokens"]),
    ("ignore_eos 1", "/generate", _body(ignore_eos=1), 422, ["body.ignore_eos"]),
    ("max_tokens zero", "/generate", _body(max_tokens=0), 422, ["max_tokens"]),
    ("max_tokens a word", "/generate", _body(max_tokens="ten"), 422, ["max_tokens"]),
    ("seed a word", "/generate", _body(seed="abc"), 422, ["seed"]),
    ("unknown field", "/generate", _body(bogus=1), 422, ["bogus"]),
    ("stop id past the vocab", "/generate", _body(stop_token_ids=[100000]), 400, ["stop_token_ids"]),
    ("tools with a text prompt", "/generate", _body(tools=[TOOL]), 400, ["prompts[0] is text", "tools apply only to chat-message prompts"]),
    ("tools with token ids", "/generate", _body(prompts=[[{"role": "user", "content": "x"}], [97]], tools=[TOOL]), 400, ["prompts[1] is token ids", "chat-message prompts"]),
    ("bad chat role", "/generate", _body(prompts=[[{"role": "robot", "content": "x"}]]), 422, ["role"]),
    ("malformed JSON", "/generate", b'{"prompts": [', 422, ["malformed JSON at character 13"]),
    ("JSON array body", "/generate", b"[1, 2]", 422, ["body"]),
    ("empty body", "/generate", b"", 422, ["body"]),
    ("openai stream", "/v1/completions", {"prompt": "hi", "stream": True}, 400, ["stream"]),
    ("openai n over", "/v1/completions", {"prompt": "hi", "n": 9}, 400, ["n=9"]),
    ("openai image part", "/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, ["image_url"]),
    ("openai prompt too long", "/v1/completions", {"prompt": "a" * 200}, 400, ["prompt[0] has", "--max-prompt-len"]),
    ("openai chat too long", "/v1/chat/completions", {"messages": [{"role": "user", "content": "a" * 200}]}, 400, ["messages (the rendered chat prompt) has", "--max-prompt-len"]),
    ("openai unknown field", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "bogus": 1}, 422, ["bogus"]),
    ("openai no messages", "/v1/chat/completions", {"messages": []}, 422, ["messages"]),
    ("stale weight version", "/weights/load_file", {"path": "/nonexistent", "version": 0}, 409, ["version=0", "not newer"]),
    ("unreadable weight file", "/weights/load_file", {"path": "/nonexistent"}, 400, ["/nonexistent", "no such file"]),
]  # fmt: skip


@pytest.mark.parametrize(
    ("route", "body", "status", "words"),
    [case[1:] for case in BAD_INPUTS],
    ids=[case[0] for case in BAD_INPUTS],
)
def test_bad_inputs_get_the_right_4xx(http, route, body, status, words):
    if isinstance(body, bytes):
        resp = http.post(route, content=body, headers={"Content-Type": "application/json"})
    else:
        resp = http.post(route, json=body)
    assert resp.status_code == status, resp.text
    detail = resp.json()["detail"]
    assert isinstance(detail, str)
    for word in words:
        assert word.lower() in detail.lower(), detail


def test_the_server_is_unharmed_by_bad_inputs(http):
    assert http.get("/nope").status_code == 404
    assert http.get("/generate").status_code == 405
    resp = http.post("/generate", json=_body(seed=2**70, n=2))
    assert resp.status_code == 200
    assert http.get("/info").json()["weight_version"] == 0


def test_metrics_count_requests_and_tokens(http):
    http.post("/generate", json=_body(n=2, max_tokens=3, ignore_eos=True))
    text = http.get("/metrics").text
    values = {
        line.split(" ")[0]: float(line.split(" ")[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }
    assert values["rollout_generation_tokens_total"] >= 6
    assert values['rollout_http_requests_total{method="POST",route="/generate",status="200"}'] >= 1
    assert values["rollout_weight_version"] == 0
    assert values["rollout_generate_in_flight"] == 0
    assert "/nope" not in text  # raw paths never become labels (GET /nope ran above)
