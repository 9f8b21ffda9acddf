"""Environments, tool-call parsing, the chat format's token accounting, and the episode runner."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import ClassVar

import pytest
from pydantic import BaseModel, Field

from rewards.chat import HFChatFormat
from rewards.env import (
    Environment,
    EnvironmentDefinitionError,
    ToolResult,
    UnknownSplitError,
    get_tasks,
    tool,
)
from rewards.episode import (
    EnvironmentStuckError,
    GenerationFailed,
    abandoned_episodes,
    reduce_rewards,
    run_episodes,
)
from rewards.errors import PluginError
from rewards.toolcalls import MalformedCall, ToolCall, parse_tool_calls


class GuessArgs(BaseModel):
    number: int = Field(description="your guess")


class AnswerArgs(BaseModel):
    answer: str


class GuessEnv(Environment):
    """Guess a secret number. ``events`` records what happened, for the tests."""

    events: ClassVar[list[tuple]] = []

    @classmethod
    def list_splits(cls):
        return ["train"]

    @classmethod
    async def list_tasks(cls, split):
        return [{"key": f"task{i}", "target": i} for i in range(3)]

    async def setup(self):
        if self.task.get("fail") == "setup":
            raise RuntimeError("no sandbox today")
        self.events.append(("setup", self.task["key"]))

    async def teardown(self):
        self.events.append(("teardown", self.task["key"]))

    def get_prompt(self):
        return f"[{self.task['key']}] Guess the number."

    @tool
    async def guess(self, args: GuessArgs) -> ToolResult:
        """Guess the secret number."""
        self.events.append(("guess", self.task["key"], args.number))
        if self.task.get("fail") == "tool":
            raise ValueError("the grader crashed")
        if self.task.get("fail") == "exit":  # environment code that calls sys.exit
            raise SystemExit(3)
        hit = args.number == self.task["target"]
        return ToolResult(text="right" if hit else "wrong", reward=float(hit), finished=hit)

    @tool
    def hint(self) -> ToolResult:
        """Is the number even?"""
        return ToolResult(text="even" if self.task["target"] % 2 == 0 else "odd")

    @tool(terminal=True)
    async def answer(self, args: AnswerArgs) -> ToolResult:
        """Grade a final answer."""
        self.events.append(("answer", self.task["key"], args.answer))
        return ToolResult(text="graded", reward=0.5, finished=True)


def call(name: str, **arguments) -> str:
    import json

    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


@pytest.fixture(autouse=True)
def _clear_events():
    GuessEnv.events.clear()


def test_tools_schema_from_pydantic_and_terminal_hidden_flag():
    specs = {s.name: s for s in GuessEnv.list_tools()}
    assert set(specs) == {"answer", "guess", "hint"}
    assert specs["guess"].parameters == GuessArgs.model_json_schema()
    assert specs["guess"].description == "Guess the secret number."
    assert specs["hint"].parameters == {"type": "object", "properties": {}}
    assert specs["answer"].terminal and specs["answer"].terminal_arg == "answer"
    assert specs["guess"].to_openai()["function"]["parameters"]["properties"]["number"] == {
        "description": "your guess",
        "title": "Number",
        "type": "integer",
    }


def test_bad_tool_declarations_are_named():
    class TwoArgs(Environment):
        @tool
        def f(self, a: GuessArgs, b: GuessArgs) -> ToolResult: ...

    class TwoTerminals(Environment):
        @tool(terminal=True)
        def a(self) -> ToolResult: ...

        @tool(terminal=True)
        def b(self) -> ToolResult: ...

    with pytest.raises(
        EnvironmentDefinitionError,
        match=r"TwoArgs\.f takes \(a: GuessArgs, b: GuessArgs\); a tool takes exactly one",
    ):
        TwoArgs.list_tools()
    with pytest.raises(EnvironmentDefinitionError, match="several terminal tools"):
        TwoTerminals.list_tools()


def test_a_tool_argument_model_that_cannot_be_resolved_is_named():
    class LocalArgs(BaseModel):  # local: the string annotation (PEP 563) cannot find it
        x: int

    class Local(Environment):
        @tool
        def f(self, args: LocalArgs) -> ToolResult: ...

    with pytest.raises(EnvironmentDefinitionError) as info:
        Local.list_tools()
    assert str(info.value) == (
        "tool Local.f: its annotations cannot be resolved (NameError: name 'LocalArgs' is not "
        "defined); define or import the argument model at module level"
    )


def test_an_environment_that_misses_a_required_method_is_named_when_checked():
    class NoCatalogue(Environment):
        def get_prompt(self):
            return "hi"

    with pytest.raises(EnvironmentDefinitionError) as info:
        NoCatalogue.check_definition()
    assert str(info.value) == (
        "NoCatalogue does not implement list_splits(), list_tasks(); see the example in "
        "docs/rewards.md"
    )
    GuessEnv.check_definition()


async def test_a_split_the_environment_does_not_list_is_named_with_the_ones_it_does():
    """GuessEnv.list_tasks ignores its split: without the check, 'test' would train on 'train'."""
    with pytest.raises(UnknownSplitError) as info:
        await get_tasks(GuessEnv, "test")
    assert str(info.value) == (
        "'test' is not a split of GuessEnv; its splits are 'train': set environment.split to "
        "one of them"
    )
    assert isinstance(info.value, PluginError)  # the learner reports it in one line

    class Empty(GuessEnv):
        @classmethod
        def list_tasks(cls, split):
            return []

    with pytest.raises(UnknownSplitError, match="Empty lists no tasks in split 'train'"):
        await get_tasks(Empty, "train")


async def test_call_tool_reports_model_mistakes_as_text():
    env = GuessEnv({"key": "t", "target": 2})
    assert (await get_tasks(GuessEnv, "train"))[2] == {"key": "task2", "target": 2}
    unknown = await env.call_tool("guesss", {"number": 1})
    assert unknown.is_error and "unknown tool 'guesss'" in unknown.text and "hint" in unknown.text
    assert (await env.call_tool("answer", {"answer": "2"})).is_error  # terminal: not callable
    invalid = await env.call_tool("guess", {"number": "two"})
    assert invalid.is_error and "invalid arguments for 'guess'" in invalid.text
    assert (await env.call_tool("hint", {})).text == "even"
    assert (await env.call_tool("guess", {"number": 2})).finished
    late = await env.call_tool("guess", {"number": 2})
    assert late.is_error and "finished" in late.text


def test_parse_tool_calls_hermes_format():
    text = (
        "Let me try.\n"
        + call("guess", number=3)
        + "\n<tool_call>{not json}</tool_call>"
        + '<tool_call>{"name": "hint", "arguments": "{}"}</tool_call>'
    )
    parsed = parse_tool_calls(text)
    assert parsed.content == "Let me try."
    assert parsed.calls[0] == ToolCall("guess", {"number": 3})
    assert isinstance(parsed.calls[1], MalformedCall) and "not valid JSON" in parsed.calls[1].reason
    assert parsed.calls[2] == ToolCall("hint", {})
    assert parse_tool_calls("The answer is 4.").calls == []
    truncated = parse_tool_calls('<tool_call>{"name": "hint", "arguments": {}}')
    assert truncated.calls == [ToolCall("hint", {})]


def test_reduce_rewards():
    steps = [0.0, None, 1.0, 0.5, None]
    assert reduce_rewards(steps, "last") == 0.5
    assert reduce_rewards(steps, "sum") == 1.5
    assert reduce_rewards(steps, "mean") == 0.5
    assert reduce_rewards([None], "last") == 0.0


async def test_multi_turn_tokens_mask_and_logprobs(tokenizer, chat, scripted):
    """The episode's ids are exactly the template's rendering of the conversation, the mask is
    1 on sampled tokens only, and the log-probs are the sampler's there."""
    turns = [
        call("hint"),
        call("guess", number=1) + call("guess", number=3),
        call("guess", number=2),
    ]
    model = scripted({"task2": turns})
    [res] = await run_episodes(GuessEnv, [{"key": "task2", "target": 2}], model, chat, max_turns=5)
    assert res.error is None and res.finished and res.stop_reason == "finished"
    assert res.num_turns == 3 and res.step_rewards == [None, 0.0, 0.0, 1.0]
    assert res.reward == 1.0

    # What the template renders for this conversation, with the raw assistant text.
    convo = [{"role": "user", "content": "[task2] Guess the number."}]
    tool_texts = [["even"], ["wrong", "wrong"], ["right"]]
    for text, results in zip(turns, tool_texts, strict=True):
        convo.append({"role": "assistant", "content": text})
        convo += [{"role": "tool", "content": r} for r in results]
    tools = [s.to_openai() for s in GuessEnv.list_tools() if not s.terminal]
    full = tokenizer.apply_chat_template(convo[:-1], tools=tools, tokenize=False)
    assert tokenizer.decode(res.prompt_ids + res.completion_ids) == full.removesuffix("\n")
    assert res.prompt_ids == model.calls[0]

    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    sampled = [[*tokenizer.encode(t, add_special_tokens=False), im_end] for t in turns]
    mask, ids, lps = res.completion_mask, res.completion_ids, res.completion_logprobs
    assert len(mask) == len(ids) == len(lps)
    assert [i for i, m in zip(ids, mask, strict=True) if m] == [i for s in sampled for i in s]
    expected_lps = [-(i + 1) / 1000 for s in sampled for i in range(len(s))]
    assert [lp for lp, m in zip(lps, mask, strict=True) if m] == expected_lps
    assert all(lp == 0.0 for lp, m in zip(lps, mask, strict=True) if not m)
    masked_text = tokenizer.decode([i for i, m in zip(ids, mask, strict=True) if not m])
    assert "<tool_response>\nwrong\n</tool_response>" in masked_text and "even" in masked_text
    assert ("guess", "task2", 3) in GuessEnv.events  # both calls of turn 2 ran
    assert res.messages[1]["tool_calls"][0]["function"] == {"name": "hint", "arguments": {}}


async def test_finished_stops_tool_calls_within_a_turn(chat, scripted):
    model = scripted({"task1": [call("guess", number=1) + call("guess", number=5)]})
    [res] = await run_episodes(GuessEnv, [{"key": "task1", "target": 1}], model, chat, max_turns=3)
    assert res.finished and res.step_rewards == [1.0]
    assert [e for e in GuessEnv.events if e[0] == "guess"] == [("guess", "task1", 1)]


async def test_plain_message_goes_to_terminal_tool(chat, scripted):
    model = scripted({"task0": ["<think>it is zero</think>\nMy answer: 0"]})
    [res] = await run_episodes(GuessEnv, [{"key": "task0", "target": 0}], model, chat, max_turns=3)
    assert ("answer", "task0", "My answer: 0") in GuessEnv.events
    assert res.reward == 0.5 and res.finished and res.num_turns == 1


async def test_turn_limit(chat, scripted):
    model = scripted({"task3": [call("guess", number=i) for i in range(10)]})
    [res] = await run_episodes(GuessEnv, [{"key": "task3", "target": 99}], model, chat, max_turns=4)
    assert res.num_turns == 4 and not res.finished and res.stop_reason == "max_turns"
    assert res.step_rewards == [0.0] * 4 and res.reward == 0.0
    # No tool tokens after the last turn: the completion ends with a sampled token.
    assert res.completion_mask[-1] == 1


async def test_each_episode_can_have_its_own_generate(chat, scripted):
    """One generate function per task (the learner's seeded episodes): episode j calls its own."""
    task = {"key": "task1", "target": 1}
    right, wrong = (
        scripted({"task1": [call("guess", number=1)]}),
        scripted({"task1": [call("guess", number=2)]}),
    )
    hit, miss = await run_episodes(GuessEnv, [task, task], [right, wrong], chat, max_turns=1)
    assert (hit.reward, miss.reward) == (1.0, 0.0)
    assert len(right.calls) == len(wrong.calls) == 1
    with pytest.raises(ValueError, match="1 generate functions for 2 tasks"):
        await run_episodes(GuessEnv, [task, task], [right], chat, max_turns=1)


@pytest.mark.parametrize("how,expected", [("last", 1.0), ("sum", 1.0), ("mean", 1 / 3)])
async def test_reward_reduce_is_applied(chat, scripted, how, expected):
    model = scripted({"task1": [call("guess", number=n) for n in (5, 7, 1)]})
    [res] = await run_episodes(
        GuessEnv, [{"key": "task1", "target": 1}], model, chat, max_turns=5, reward_reduce=how
    )
    assert res.step_rewards == [0.0, 0.0, 1.0] and res.reward == pytest.approx(expected)


async def test_malformed_call_is_answered_and_the_episode_goes_on(tokenizer, chat, scripted):
    model = scripted({"task2": ["<tool_call>{oops</tool_call>", call("guess", number=2)]})
    [res] = await run_episodes(GuessEnv, [{"key": "task2", "target": 2}], model, chat, max_turns=3)
    assert res.finished and res.num_turns == 2 and res.step_rewards == [None, 1.0]
    assert "Error: tool call is not valid JSON" in tokenizer.decode(model.calls[1])


async def test_faults_are_per_episode_and_teardown_always_runs(chat, scripted):
    """Episodes of a batch run concurrently: none can finish its first turn before all started."""
    tasks = [
        {"key": "ok", "target": 1},
        {"key": "bad-tool", "target": 1, "fail": "tool"},
        {"key": "bad-setup", "target": 1, "fail": "setup"},
    ]
    started = 0
    all_started = asyncio.Event()
    inner = scripted({t["key"]: [call("guess", number=1)] for t in tasks})

    async def generate(ids):
        nonlocal started
        started += 1
        if started == 2:  # the two episodes whose setup works
            all_started.set()
        await asyncio.wait_for(all_started.wait(), 5)
        return await inner(ids)

    results = await run_episodes(GuessEnv, tasks, generate, chat, max_turns=2)
    ok, bad_tool, bad_setup = results
    assert ok.error is None and ok.reward == 1.0
    assert bad_tool.error == "ValueError: the grader crashed" and bad_tool.reward == 0.0
    assert bad_tool.stop_reason == "error" and bad_tool.completion_mask
    assert 'test_env_episode.py", line' in bad_tool.traceback  # the environment's own frame
    assert bad_tool.traceback.rstrip().endswith("ValueError: the grader crashed")
    assert ok.traceback is None
    assert bad_setup.error == "RuntimeError: no sandbox today" and bad_setup.completion_ids == []
    teardowns = {e[1] for e in GuessEnv.events if e[0] == "teardown"}
    assert teardowns == {"ok", "bad-tool", "bad-setup"}


async def test_a_tool_that_exits_fails_its_episode_only(chat, scripted):
    """SystemExit from a tool must not escape: in the learner it would end the event loop
    that every later step waits on."""
    tasks = [{"key": "ok", "target": 1}, {"key": "exits", "target": 1, "fail": "exit"}]
    generate = scripted({t["key"]: [call("guess", number=1)] for t in tasks})
    ok, exits = await run_episodes(GuessEnv, tasks, generate, chat, max_turns=2)
    assert ok.error is None and ok.reward == 1.0
    assert exits.error == "SystemExit: 3" and exits.reward == 0.0
    assert {e[1] for e in GuessEnv.events if e[0] == "teardown"} == {"ok", "exits"}


async def test_generate_failure_is_raised_after_teardown(tokenizer, chat, scripted):
    good = scripted({"task1": [call("hint"), call("guess", number=1)]})

    async def generate(ids):
        if "flaky" in tokenizer.decode(ids):
            raise ConnectionError("rollout server went away")
        return await good(ids)

    tasks = [{"key": "flaky", "target": 1}, {"key": "task1", "target": 1}]
    with pytest.raises(GenerationFailed, match="ConnectionError: rollout server went away"):
        await run_episodes(GuessEnv, tasks, generate, chat, max_turns=3)
    assert {e[1] for e in GuessEnv.events if e[0] == "teardown"} == {"flaky", "task1"}


QWEN3_LIKE = (
    "{% for m in messages %}"
    "{% if m.role == 'assistant' %}<|im_start|>assistant\n"
    "{% if loop.last %}<think>\n\n</think>\n\n{% endif %}{{ m.content }}<|im_end|>\n"
    "{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}"
    "\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_chat_format_when_the_last_assistant_turn_renders_differently(tokenizer):
    """Qwen3 adds an empty think block to the last assistant turn only; the suffix must still be
    cut right after the assistant content, not at the length of a rendered prefix."""
    import copy

    tok = copy.deepcopy(tokenizer)
    tok.chat_template = QWEN3_LIKE
    fmt = HFChatFormat(tok)
    assert fmt.end_text == "<|im_end|>\n"
    ids = fmt.tool_message_ids([{"role": "tool", "content": "42"}])
    expected = "<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n"
    assert tok.decode(ids) == expected + "<|im_start|>assistant\n"
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    newline = tok.encode("\n", add_special_tokens=False)
    assert fmt.close_turn_ids([5, 6, im_end]) == newline
    assert fmt.close_turn_ids([5, 6]) == [im_end, *newline]  # a sample cut off mid-turn
    assert fmt.close_turn_ids([5, im_end, *newline]) == []


class HangingEnv(GuessEnv):
    @tool
    def guess(self, args: GuessArgs) -> ToolResult:
        """Never returns."""
        time.sleep(3600)


async def test_hung_environment_times_out_its_episode_only(chat, scripted):
    model = scripted({"task": [call("guess", number=1)]})
    tasks = [{"key": "task-hang", "target": 1}, {"key": "task-ok", "target": 1}]
    t0 = time.perf_counter()
    hung, ok = await asyncio.gather(
        run_episodes(HangingEnv, tasks[:1], model, chat, max_turns=2, episode_timeout_s=0.5),
        run_episodes(GuessEnv, tasks[1:], model, chat, max_turns=2, episode_timeout_s=0.5),
    )
    assert time.perf_counter() - t0 < 2.0
    assert hung[0].error == "episode timed out after 0.5 s" and hung[0].stop_reason == "error"
    assert ok[0].error is None and ok[0].reward == 1.0
    assert ("teardown", "task-hang") in GuessEnv.events


class BlockingEnv(GuessEnv):
    """An async tool that blocks its event loop (a sync sleep inside ``async def``) until
    ``release`` is set or ``block_s`` passes."""

    release = threading.Event()
    block_s = 0.0

    @tool
    async def guess(self, args: GuessArgs) -> ToolResult:
        """Blocks the loop it runs on."""
        self.release.wait(self.block_s)  # the mistake under test
        return ToolResult(text="right", reward=1.0, finished=True)


@pytest.fixture
def blocking_env():
    BlockingEnv.release.clear()
    yield BlockingEnv
    BlockingEnv.release.set()  # the abandoned threads end
    deadline = time.monotonic() + 5
    while abandoned_episodes(BlockingEnv) and time.monotonic() < deadline:
        time.sleep(0.01)


async def test_an_environment_that_blocks_its_loop_holds_up_its_own_episode_only(
    chat, scripted, blocking_env
):
    """Four episodes whose tool blocks its loop for 0.4 s run side by side, not one after
    another as they would on one shared loop."""
    blocking_env.block_s = 0.4
    tasks = [{"key": f"t{i}", "target": 1} for i in range(4)]
    model = scripted({t["key"]: [call("guess", number=1)] for t in tasks})
    t0 = time.perf_counter()
    results = await run_episodes(blocking_env, tasks, model, chat, max_turns=2)
    assert time.perf_counter() - t0 < 1.2
    assert [r.reward for r in results] == [1.0] * 4 and not any(r.error for r in results)


async def test_an_episode_blocked_past_its_timeout_is_abandoned_and_counted(
    chat, scripted, blocking_env
):
    blocking_env.block_s = 60.0
    model = scripted({"task": [call("guess", number=1)]})

    def episode(env, key, **kw):
        task = {"key": key, "target": 1}
        return run_episodes(env, [task], model, chat, max_turns=2, episode_timeout_s=0.3, **kw)

    t0 = time.perf_counter()
    blocked, ok = await asyncio.gather(
        episode(blocking_env, "task-b", max_abandoned=0), episode(GuessEnv, "task-ok")
    )
    # the episode's own limit (0.3 s) + teardown's (0.3 s) + the caller's grace (1 s)
    assert time.perf_counter() - t0 < 3.0
    assert blocked[0].stop_reason == "error" and blocked[0].reward == 0.0
    assert "abandoned" in blocked[0].error and "async def" in blocked[0].error
    assert ok[0].error is None and ok[0].reward == 1.0
    assert abandoned_episodes(blocking_env) == 1
    with pytest.raises(EnvironmentStuckError, match=r"1 timed-out episodes of BlockingEnv"):
        await episode(blocking_env, "task-b", max_abandoned=0)
    blocking_env.release.set()  # it wakes, sees its cancellation, tears down and ends
    deadline = time.monotonic() + 5
    while abandoned_episodes(blocking_env) and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert abandoned_episodes(blocking_env) == 0
    assert ("teardown", "task-b") in GuessEnv.events
