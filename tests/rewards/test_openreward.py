"""An environment written with the ``openreward`` SDK, served by the SDK's own ``Server`` under
uvicorn on a loopback port, run through our adapter and episode runner with a scripted model."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest
from pydantic import BaseModel

openreward = pytest.importorskip("openreward")
from openreward.environments import (  # noqa: E402
    Environment,
    Server,
    TextBlock,
    ToolOutput,
    terminal,
    tool,
)

from rewards.env import get_splits, get_tasks  # noqa: E402
from rewards.episode import run_episodes  # noqa: E402
from rewards.errors import PluginError  # noqa: E402
from rewards.openreward_adapter import OpenRewardAdapterError, parse_target  # noqa: E402
from rewards.registry import load_environment  # noqa: E402

CALLS: list[tuple[str, str, object]] = []  # (task key, tool, argument): what the server ran
TEARDOWNS: list[str] = []


class GuessParams(BaseModel):
    number: int


class Submission(BaseModel):
    answer: str


class GuessNumber(Environment):
    """Guess the secret number; or just say it, and the terminal tool grades the message."""

    @classmethod
    def list_splits(cls):
        return ["train", "test"]

    @classmethod
    def list_tasks(cls, split):
        return [{"key": f"{split}-{i}", "secret": i} for i in range(3)]

    def get_prompt(self):
        return [TextBlock(text=f"[{self.task_spec['key']}] Guess the secret number (0-9).")]

    async def teardown(self):
        TEARDOWNS.append(self.task_spec["key"])

    @tool
    async def guess(self, params: GuessParams) -> ToolOutput:
        """Guess the number."""
        CALLS.append((self.task_spec["key"], "guess", params.number))
        hit = params.number == self.task_spec["secret"]
        text = (
            "correct"
            if hit
            else ("too low" if params.number < self.task_spec["secret"] else "too high")
        )
        return ToolOutput(blocks=[TextBlock(text=text)], reward=1.0 if hit else 0.0, finished=hit)

    @terminal
    @tool
    async def submit(self, params: Submission) -> ToolOutput:
        """Grade a plain final answer."""
        CALLS.append((self.task_spec["key"], "submit", params.answer))
        hit = params.answer.strip().endswith(str(self.task_spec["secret"]))
        return ToolOutput(
            blocks=[TextBlock(text="graded")], reward=0.25 if hit else 0.0, finished=True
        )


@pytest.fixture(scope="module")
def server_url():
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(Server([GuessNumber]).app, log_level="warning", lifespan="on")
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "the ORS server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)
    sock.close()


def guess(n: int) -> str:
    return f"<tool_call>\n{json.dumps({'name': 'guess', 'arguments': {'number': n}})}\n</tool_call>"


async def test_catalogue_through_the_adapter(server_url):
    env_cls = load_environment(f"openreward:{server_url}")
    assert await get_splits(env_cls) == ["train", "test"]
    assert (await get_tasks(env_cls, "test"))[1] == {"key": "test-1", "secret": 1}
    named = load_environment(f"openreward:{server_url}/guessnumber")  # env name as URL path
    assert len(await get_tasks(named, "train")) == 3


async def test_episodes_rewards_and_finished_arrive(server_url, tokenizer, chat, scripted):
    CALLS.clear()
    TEARDOWNS.clear()
    env_cls = load_environment(f"openreward:{server_url}")
    tasks = await get_tasks(env_cls, "train")  # secrets 0, 1, 2
    model = scripted(
        {
            # too low, then right; the extra call after `finished` must not reach the server
            "[train-2]": [guess(1), guess(2) + guess(7)],
            # a plain message goes to the @terminal tool
            "[train-1]": ["<think>one?</think>The secret is 1"],
            # invalid arguments come back as an error the model reads; then it runs out of turns
            "[train-0]": [
                '<tool_call>{"name": "guess", "arguments": {"number": "zero"}}</tool_call>',
                guess(5),
                guess(6),
            ],
        }
    )
    ep2, ep1, ep0 = await run_episodes(env_cls, tasks[::-1], model, chat, max_turns=3)

    assert ep2.error is None and ep2.finished and ep2.num_turns == 2
    assert ep2.step_rewards == [0.0, 1.0] and ep2.reward == 1.0
    assert [c for c in CALLS if c[0] == "train-2"] == [
        ("train-2", "guess", 1),
        ("train-2", "guess", 2),
    ]
    assert "too low" in tokenizer.decode(ep2.completion_ids)

    assert ep1.error is None and ep1.finished and ep1.reward == 0.25 and ep1.num_turns == 1
    assert ("train-1", "submit", "The secret is 1") in CALLS

    assert ep0.error is None and not ep0.finished and ep0.stop_reason == "max_turns"
    assert ep0.num_turns == 3 and ep0.step_rewards == [None, 0.0, 0.0] and ep0.reward == 0.0
    tool_text = tokenizer.decode(
        [i for i, m in zip(ep0.completion_ids, ep0.completion_mask, strict=True) if not m]
    )
    assert "Error:" in tool_text and "valid integer" in tool_text
    assert "too high" in tool_text

    # Tool tokens are masked out; the model's own tokens are not.
    for ep in (ep0, ep1, ep2):
        assert len(ep.completion_ids) == len(ep.completion_mask) == len(ep.completion_logprobs)
        assert ep.completion_mask[0] == 1
    # Every session was closed on the server (teardown ran there).
    assert sorted(TEARDOWNS) == ["train-0", "train-1", "train-2"]


async def test_the_model_sees_the_servers_tools_but_not_the_terminal_one(server_url, tokenizer):
    env_cls = load_environment(f"openreward:{server_url}")
    env = env_cls({"key": "x", "secret": 3})
    await env.setup()
    try:
        specs = {s.name: s for s in await env.get_tools()}
        assert specs["guess"].parameters["properties"]["number"]["type"] == "integer"
        assert specs["submit"].terminal and specs["submit"].terminal_arg == "answer"
        assert await env.get_prompt() == "[x] Guess the secret number (0-9)."
        late = await env.call_tool("nope", {})
        assert late.is_error and "nope" in late.text
    finally:
        await env.teardown()


async def test_a_server_that_does_not_serve_the_name_lists_what_it_serves(server_url):
    env_cls = load_environment(f"openreward:{server_url}/wordle")
    with pytest.raises(OpenRewardAdapterError) as info:
        await get_tasks(env_cls, "train")
    assert str(info.value) == (
        f"openreward:{server_url}/wordle: the server at {server_url} does not serve an "
        f"environment 'wordle' (it serves ['guessnumber']); use openreward:{server_url}/<one of "
        f"those>, or no path for its default"
    )
    assert isinstance(info.value, PluginError)  # the learner reports it in one line


async def test_a_server_that_is_not_running_fails_at_once_naming_the_url():
    from grpo_common.net import free_port

    url = f"http://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    with pytest.raises(OpenRewardAdapterError) as info:
        await get_splits(load_environment(f"openreward:{url}"))
    assert time.monotonic() - t0 < 3  # not after the SDK's retries (6 s)
    assert str(info.value).startswith(
        f"openreward:{url}: cannot reach the server at {url} (ConnectError: "
    )
    assert str(info.value).endswith("); start it, or fix the URL")


def test_parse_target():
    assert parse_target("http://127.0.0.1:8080") == (
        "127.0.0.1:8080",
        None,
        "http://127.0.0.1:8080",
    )
    assert parse_target("http://h:1/wordle") == ("wordle", "wordle", "http://h:1")
    assert parse_target("owner/env") == ("owner/env", None, None)
    assert parse_target("owner/env/hard") == ("owner/env", "hard", None)
    with pytest.raises(OpenRewardAdapterError, match="owner/env"):
        parse_target("just-a-name")


async def test_hosted_environment_without_key_says_what_to_set(monkeypatch):
    monkeypatch.delenv("OPENREWARD_API_KEY", raising=False)
    env_cls = load_environment("openreward:someone/some-env")
    with pytest.raises(OpenRewardAdapterError, match="OPENREWARD_API_KEY"):
        await get_splits(env_cls)
