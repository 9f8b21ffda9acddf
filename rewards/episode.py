"""The multi-turn episode runner: generate, call tools, append their output, generate again.

It works on token ids and takes the generation as a function (``GenerateFn``), so it needs no
server: the learner passes one that calls the rollout server, tests pass a scripted one. Per
episode it returns the ids after the prompt with a mask that is 1 exactly on the tokens the model
sampled (their log-probs alongside) and 0 on everything the template or a tool wrote, so tool
output never enters the loss; and the episode reward, reduced from the tool rewards.

Episode loop: the model's turn is parsed for ``<tool_call>`` blocks (``rewards.toolcalls``); each
call goes to the environment until one returns ``finished`` (no tool is called after that); the
tool messages are appended and the model generates again, up to ``max_turns`` generations. A turn
without tool calls ends the episode; if the environment has a terminal tool, that message is its
final answer and goes to the terminal tool to be graded.

Faults: an environment that raises (in setup, a tool, the prompt) ends its episode with ``error``
set, and the rest of the batch goes on. A failing ``generate`` is not the environment's fault:
it is raised once every episode of the batch has ended. ``teardown`` always runs.

Threads: each episode runs on an event loop of its own, in a daemon thread of its own, and its
``generate`` calls are handed back to the caller's loop (where the rollout client lives). So an
environment that blocks its loop (``time.sleep`` or a blocking HTTP call inside an ``async def``)
holds up its own episode only: the others go on concurrently and its timeout still fires. One
that stays blocked past the timeout is abandoned in its thread (its ``teardown`` cannot run) and
counted; past ``max_abandoned`` of one environment still blocked, ``run_episodes`` refuses to
start more (``EnvironmentStuckError``) instead of leaking threads step after step. Because every
episode has a new loop, environments must not share loop-bound objects (``asyncio`` locks,
an ``httpx.AsyncClient``) across episodes: make them in ``setup``.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import traceback
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from grpo_common.threads import AbandonedCalls, call_maybe_async, start_in_daemon_thread
from rewards.chat import ChatFormat, HFChatFormat
from rewards.env import Environment
from rewards.text import strip_reasoning
from rewards.toolcalls import MalformedCall, parse_tool_calls

__all__ = [
    "ChatFormat",
    "EnvironmentStuckError",
    "EpisodeResult",
    "GenerateFn",
    "Generation",
    "GenerationFailed",
    "HFChatFormat",
    "abandoned_episodes",
    "reduce_rewards",
    "run_episode",
    "run_episodes",
]

RewardReduce = Literal["last", "sum", "mean"]
StopReason = Literal["finished", "no_tool_call", "max_turns", "max_tokens", "error"]


@dataclass
class Generation:
    """One sampled assistant turn: its token ids and their log-probs under the sampler."""

    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str = "stop"


GenerateFn = Callable[[list[int]], Awaitable[Generation]]
EnvFactory = type[Environment] | Callable[[dict[str, Any]], Environment | Awaitable[Environment]]


@dataclass
class EpisodeResult:
    """``completion_ids``: everything after ``prompt_ids`` (assistant and tool tokens);
    ``completion_mask``: 1 where the model sampled the token; ``completion_logprobs``: the
    sampler's log-probs there, 0.0 elsewhere. ``reward`` is 0.0 when no step was graded
    (every entry of ``step_rewards`` None) or the episode failed (``error`` set; ``traceback``
    holds where the environment raised it)."""

    prompt_ids: list[int] = field(default_factory=list)
    completion_ids: list[int] = field(default_factory=list)
    completion_mask: list[int] = field(default_factory=list)
    completion_logprobs: list[float] = field(default_factory=list)
    reward: float = 0.0
    step_rewards: list[float | None] = field(default_factory=list)
    num_turns: int = 0
    finished: bool = False
    stop_reason: StopReason = "max_turns"
    messages: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None
    traceback: str | None = None  # of ``error``, where the environment raised it

    def _extend(self, ids: list[int], sampled: bool, logprobs: list[float] | None = None) -> None:
        self.completion_ids += ids
        self.completion_mask += [int(sampled)] * len(ids)
        self.completion_logprobs += logprobs if logprobs is not None else [0.0] * len(ids)


class GenerationFailed(RuntimeError):
    """``generate`` raised or returned something inconsistent; not the environment's fault."""


class EnvironmentStuckError(RuntimeError):
    """More than ``max_abandoned`` episodes of one environment outlived their timeout blocked in
    their threads, and are blocked still."""


TEARDOWN_LIMIT_S = 30.0
"""The most a ``teardown`` gets after its episode timed out (at most the episode timeout)."""

MAX_ABANDONED_EPISODES = 32
"""How many timed-out episodes of one environment may still be blocked in their threads before
``run_episodes`` refuses to start more (``run_episodes(max_abandoned=...)``)."""

_GRACE_S = 1.0  # the caller waits this much past the episode's own limits before abandoning it
_abandoned = AbandonedCalls()


def abandoned_episodes(env_factory: EnvFactory) -> int:
    """How many timed-out episodes of ``env_factory`` are still blocked in their threads."""
    return _abandoned.running(env_factory)


def _factory_name(env_factory: EnvFactory) -> str:
    return getattr(env_factory, "__qualname__", None) or type(env_factory).__name__


def reduce_rewards(step_rewards: list[float | None], how: RewardReduce) -> float:
    """The episode reward: the last non-None step reward, or their sum or mean (0.0 if none)."""
    graded = [r for r in step_rewards if r is not None]
    if not graded:
        return 0.0
    if how == "last":
        return graded[-1]
    if how == "sum":
        return float(sum(graded))
    if how == "mean":
        return float(sum(graded) / len(graded))
    raise ValueError(f"reward_reduce={how!r}; use 'last', 'sum' or 'mean'")


async def _make_env(factory: EnvFactory, task: dict[str, Any]) -> Environment:
    env = factory(task)
    return await env if inspect.isawaitable(env) else env


async def _generate(generate: GenerateFn, ids: list[int]) -> Generation:
    try:
        gen = await generate(ids)
    except Exception as e:
        raise GenerationFailed(f"generate failed: {type(e).__name__}: {e}") from e
    if len(gen.logprobs) != len(gen.token_ids) or not gen.token_ids:
        raise GenerationFailed(
            f"generate returned {len(gen.token_ids)} token ids and {len(gen.logprobs)} log-probs; "
            f"it must return at least one token and one log-prob per token"
        )
    return gen


async def _play(
    env: Environment,
    res: EpisodeResult,
    generate: GenerateFn,
    chat: ChatFormat,
    max_turns: int,
    max_tokens: int | None,
) -> None:
    await env.setup()
    prompt = await call_maybe_async(env.get_prompt)
    res.messages = (
        [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    )
    specs = await env.get_tools()
    tools = [s.to_openai() for s in specs if not s.terminal] or None
    has_terminal = any(s.terminal for s in specs)
    res.prompt_ids = chat.prompt_ids(res.messages, tools)
    call_ids = itertools.count()
    for turn in range(max_turns):
        gen = await _generate(generate, res.prompt_ids + res.completion_ids)
        res._extend(list(gen.token_ids), True, list(gen.logprobs))
        res.num_turns += 1
        parsed = parse_tool_calls(gen.text)
        assistant: dict[str, Any] = {"role": "assistant", "content": parsed.content}
        res.messages.append(assistant)
        if not parsed.calls:
            res.stop_reason = "no_tool_call"
            if has_terminal:
                result = await env.call_terminal(strip_reasoning(parsed.content).strip())
                res.step_rewards.append(result.reward)
                res.finished = result.finished
                res.stop_reason = "finished" if result.finished else "no_tool_call"
                res.messages.append({"role": "tool", "content": result.text, "terminal": True})
            return
        assistant["tool_calls"] = []
        tool_messages = []
        for call in parsed.calls:
            call_id = f"call_{next(call_ids)}"
            if isinstance(call, MalformedCall):
                text, reward = f"Error: {call.reason}", None
            else:
                assistant["tool_calls"].append(call.to_openai(call_id))
                result = await env.call_tool(call.name, call.arguments)
                text, reward, res.finished = result.text, result.reward, result.finished
            res.step_rewards.append(reward)
            tool_messages.append({"role": "tool", "tool_call_id": call_id, "content": text})
            if res.finished:
                break
        res.messages += tool_messages
        if res.finished:
            res.stop_reason = "finished"
            return
        if turn == max_turns - 1:
            res.stop_reason = "max_turns"
            return
        close = getattr(chat, "close_turn_ids", None)  # optional in a ChatFormat
        if close is not None:
            res._extend(close(res.completion_ids), False)
        res._extend(chat.tool_message_ids(tool_messages), False)
        if max_tokens is not None and len(res.completion_ids) >= max_tokens:
            res.stop_reason = "max_tokens"
            return


def _teardown_limit(timeout_s: float | None) -> float | None:
    return None if timeout_s is None else min(timeout_s, TEARDOWN_LIMIT_S)


async def run_episode(
    env_factory: EnvFactory,
    task: dict[str, Any],
    generate: GenerateFn,
    chat: ChatFormat,
    *,
    max_turns: int,
    reward_reduce: RewardReduce = "last",
    max_tokens: int | None = None,
    timeout_s: float | None = None,
) -> EpisodeResult:
    """One episode on a loop of its own in a daemon thread; see ``run_episodes``."""
    caller = asyncio.get_running_loop()

    async def generate_on_caller(ids: list[int]) -> Generation:
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(generate(ids), caller))

    call = start_in_daemon_thread(
        _play_episode,
        env_factory,
        task,
        generate_on_caller,
        chat,
        max_turns=max_turns,
        reward_reduce=reward_reduce,
        max_tokens=max_tokens,
        timeout_s=timeout_s,
    )
    teardown = _teardown_limit(timeout_s)
    guard = asyncio.timeout(None if teardown is None else timeout_s + teardown + _GRACE_S)
    try:
        async with guard:
            return await call.future
    except TimeoutError:
        if not guard.expired():
            raise
    # its loop is blocked (its own timeout could not fire): cancelled there if it ever wakes
    _abandoned.add(env_factory, call.thread)
    return EpisodeResult(
        error=(
            f"episode timed out after {timeout_s:g} s and was abandoned: its environment "
            f"blocked its event loop (a blocking call inside an async def?), so neither the "
            f"timeout nor teardown could run there"
        ),
        stop_reason="error",
    )


async def _play_episode(
    env_factory: EnvFactory,
    task: dict[str, Any],
    generate: GenerateFn,
    chat: ChatFormat,
    *,
    max_turns: int,
    reward_reduce: RewardReduce,
    max_tokens: int | None,
    timeout_s: float | None,
) -> EpisodeResult:
    """The episode itself, on the loop of its thread."""
    res = EpisodeResult()
    env: Environment | None = None
    deadline = asyncio.timeout(timeout_s)
    try:
        async with deadline:
            env = await _make_env(env_factory, task)
            await _play(env, res, generate, chat, max_turns, max_tokens)
    except GenerationFailed:
        raise
    except TimeoutError as e:
        expired = deadline.expired()
        res.error = f"episode timed out after {timeout_s:g} s" if expired else f"TimeoutError: {e}"
        res.stop_reason = "error"
    except asyncio.CancelledError:
        raise
    except BaseException as e:  # environment code; SystemExit & co. must not kill the loop
        res.error = f"{type(e).__name__}: {e}"
        res.traceback = traceback.format_exc()
        res.stop_reason = "error"
    finally:
        if env is not None:
            try:
                # a hung teardown must not hang the batch
                async with asyncio.timeout(_teardown_limit(timeout_s)):
                    await env.teardown()
            except asyncio.CancelledError:
                raise
            except BaseException as e:
                if res.error is None:
                    res.error = f"teardown failed: {type(e).__name__}: {e}"
                    res.traceback = traceback.format_exc()
    res.reward = 0.0 if res.error else reduce_rewards(res.step_rewards, reward_reduce)
    return res


async def run_episodes(
    env_factory_or_cls: EnvFactory,
    tasks: list[dict[str, Any]],
    generate: GenerateFn | Sequence[GenerateFn],
    chat: ChatFormat,
    *,
    max_turns: int,
    reward_reduce: RewardReduce = "last",
    max_tokens: int | None = None,
    max_concurrency: int | None = None,
    episode_timeout_s: float | None = None,
    max_abandoned: int = MAX_ABANDONED_EPISODES,
) -> list[EpisodeResult]:
    """Run one episode per task, concurrently (at most ``max_concurrency`` at once), each on an
    event loop of its own in a daemon thread.

    ``env_factory_or_cls``: an ``Environment`` subclass or a callable that builds one from a
    task. ``generate``: one function for every episode, or one per task (e.g. each seeded on
    its own). ``max_turns``: generations per episode. ``max_tokens``: stop once the completion (tool
    tokens included) is this long. ``episode_timeout_s``: wall-clock limit of an episode (a hung
    environment ends its episode with an error instead of hanging the batch; generation time
    counts too; ``teardown`` then gets at most ``TEARDOWN_LIMIT_S`` more). ``max_abandoned``:
    how many timed-out episodes of this environment may still be blocked in their threads before
    this refuses to start (``EnvironmentStuckError``). Results are in task order.
    """
    stuck = abandoned_episodes(env_factory_or_cls)
    if stuck > max_abandoned:
        raise EnvironmentStuckError(
            f"{stuck} timed-out episodes of {_factory_name(env_factory_or_cls)} are still "
            f"blocked in their threads (more than max_abandoned={max_abandoned}): its code "
            f"blocks (a blocking call inside an async def, or a deadlock) past the "
            f"{episode_timeout_s} s episode timeout. Fix it, or raise the timeout "
            f"(environment.episode_timeout_s)."
        )
    if max_turns < 1:
        raise ValueError(f"max_turns={max_turns}; an episode needs at least one turn")
    if reward_reduce not in ("last", "sum", "mean"):
        raise ValueError(f"reward_reduce={reward_reduce!r}; use 'last', 'sum' or 'mean'")
    generators = [generate] * len(tasks) if callable(generate) else list(generate)
    if len(generators) != len(tasks):
        raise ValueError(f"{len(generators)} generate functions for {len(tasks)} tasks")
    sem = asyncio.Semaphore(max_concurrency or len(tasks) or 1)

    async def one(task: dict[str, Any], generate: GenerateFn) -> EpisodeResult:
        async with sem:
            return await run_episode(
                env_factory_or_cls,
                task,
                generate,
                chat,
                max_turns=max_turns,
                reward_reduce=reward_reduce,
                max_tokens=max_tokens,
                timeout_s=episode_timeout_s,
            )

    outcomes = await asyncio.gather(
        *(one(t, g) for t, g in zip(tasks, generators, strict=True)), return_exceptions=True
    )
    for out in outcomes:
        if isinstance(out, BaseException):
            raise out
    return outcomes  # type: ignore[return-value]
