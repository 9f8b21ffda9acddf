"""The official ``openai`` client against /v1/completions and /v1/chat/completions."""

from __future__ import annotations

import json

import openai
import pytest

from rollout_server.openai_compat.serving import parse_tool_calls
from rollout_server.settings import ServerSettings

API_KEY = "sk-test-key"


@pytest.fixture(scope="module")
def server(start_server, tiny_model_dir):
    with start_server(ServerSettings(model=str(tiny_model_dir), api_key=API_KEY)) as s:
        yield s


@pytest.fixture
async def client(server):
    async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY) as c:
        yield c


async def test_completions_with_logprobs_and_token_ids(client, tiny_model_dir):
    resp = await client.completions.create(
        model="anything",
        prompt=["hello", "bye"],
        max_tokens=5,
        n=2,
        seed=3,
        logprobs=0,
        extra_body={"ignore_eos": True, "top_k": 50},
    )
    assert len(resp.choices) == 4 and [c.index for c in resp.choices] == [0, 1, 2, 3]
    assert resp.usage.completion_tokens == 20 and resp.usage.prompt_tokens == 5 + 3
    for i, choice in enumerate(resp.choices):
        extra = choice.model_extra
        assert len(extra["token_ids"]) == 5 and choice.finish_reason == "length"
        assert extra["prompt_token_ids"] == list(b"hello" if i < 2 else b"bye")
        assert len(choice.logprobs.token_logprobs) == 5
        assert all(lp <= 0 for lp in choice.logprobs.token_logprobs)
        assert "".join(choice.logprobs.tokens) == choice.text  # ASCII-safe here or replacement
    # the same seed through /generate gives the same tokens and log-probs
    import httpx

    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {API_KEY}"}) as http:
        native = (
            await http.post(
                str(client.base_url).replace("/v1/", "/generate"),
                json={
                    "prompts": ["hello"],
                    "n": 2,
                    "max_tokens": 5,
                    "seed": 3,
                    "ignore_eos": True,
                    "top_k": 50,
                },
            )
        ).json()
    for choice, sample in zip(resp.choices[:2], native["results"][0]["samples"], strict=True):
        assert choice.model_extra["token_ids"] == sample["token_ids"]
        assert choice.logprobs.token_logprobs == pytest.approx(sample["logprobs"], abs=1e-6)


async def test_chat_completions_with_logprobs_and_token_ids(client):
    resp = await client.chat.completions.create(
        model="tiny",
        messages=[
            {"role": "developer", "content": "Be brief."},
            {
                "role": "user",
                "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}],
            },
        ],
        max_completion_tokens=6,
        n=3,
        temperature=0.8,
        seed=1,
        logprobs=True,
    )
    assert len(resp.choices) == 3 and resp.object == "chat.completion"
    prompt_ids = resp.choices[0].model_extra["prompt_token_ids"]
    prompt_text = bytes(t for t in prompt_ids if t < 256).decode()
    assert "system\nBe brief." in prompt_text and "user\nHi there" in prompt_text
    for choice in resp.choices:
        ids = choice.model_extra["token_ids"]
        assert 1 <= len(ids) <= 6
        assert len(choice.logprobs.content) == len(ids)
        assert all(t.logprob <= 0 for t in choice.logprobs.content)
        assert choice.message.role == "assistant"
    assert resp.usage.completion_tokens == sum(
        len(c.model_extra["token_ids"]) for c in resp.choices
    )


async def test_models_and_errors_through_the_client(client):
    models = await client.models.list()
    assert len(models.data) == 1
    with pytest.raises(openai.BadRequestError, match="stream"):
        await client.completions.create(model="m", prompt="x", stream=True)
    bad = openai.AsyncOpenAI(base_url=str(client.base_url), api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        await bad.models.list()
    await bad.close()


def test_openai_requests_ask_the_engine_for_logprobs_only_when_the_client_does():
    from rollout_server.openai_compat.protocol import ChatCompletionRequest, CompletionRequest

    assert not CompletionRequest(prompt="x").to_generate(16).logprobs
    assert CompletionRequest(prompt="x", logprobs=0).to_generate(16).logprobs
    chat = [{"role": "user", "content": "hi"}]
    assert not ChatCompletionRequest(messages=chat).to_generate(16).logprobs
    assert ChatCompletionRequest(messages=chat, logprobs=True).to_generate(16).logprobs


def test_hermes_tool_calls_are_parsed():
    text = 'Let me check.\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    content, calls = parse_tool_calls(text)
    assert content == "Let me check."
    assert calls[0]["function"] == {"name": "add", "arguments": json.dumps({"a": 1})}
    assert parse_tool_calls("<tool_call>not json</tool_call>") == (
        "<tool_call>not json</tool_call>",
        [],
    )


async def test_wrongly_typed_fields_are_refused_by_name(server):
    """Strict types, as on /generate: no silent `true` -> 1 or "0.5" -> 0.5."""
    import httpx

    headers = {"Authorization": f"Bearer {API_KEY}"}
    async with httpx.AsyncClient(base_url=server.url, headers=headers) as http:
        for body in ({"n": True}, {"temperature": "0.5"}, {"max_tokens": 2.5}):
            r = await http.post("/v1/completions", json={"prompt": "x", **body})
            assert r.status_code == 422, (body, r.text)
            assert next(iter(body)) in r.json()["error"]["message"]
        r = await http.post(
            "/v1/completions", json={"prompt": "x", "max_tokens": 2, "logprobs": True}
        )
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"][0]["logprobs"]["token_logprobs"]) == 2
        r = await http.post(
            "/v1/completions", json={"prompt": "x", "max_tokens": 2, "logprobs": False}
        )
        assert r.json()["choices"][0]["logprobs"] is None
